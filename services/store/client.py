"""The learner's side of the trajectory store: one store, or a batch gathered from every replica.

With one store a batch is one NextBatch call: the store waits for a full batch, and holds the
learner while it recovers a previous store's trajectories or waits for a due straggler.

With `store.replicas` N > 1 each replica holds the groups of its partition (`trajmesh.bus.
partition_of`), and a batch is gathered::

    peek every live replica ──▶ held? the admission versions of its ready groups
         ▲   │ fewer ready than a batch across replicas, one holds the learner, or one is
         │   │ unreachable for less than SKIP (it may hold a due group): peek again; each waits
         └───┘ (≤ PEEK_WAIT_S) for a change of its ready groups; once a batch is ready elsewhere,
             │ a holding replica's straggler wait runs (as one store's)
             ▼
    take from each replica its share (NextBatch max_groups = share): the batch's groups, oldest
    admission first across replicas; a replica restarted meanwhile gives none, peek again for the rest

Every replica is held to the same rule as one store, so the learner steps only when no replica
waits for a group that this step would make stale. A replica that does not answer (a call fails
UNAVAILABLE or runs past its deadline) is waited for SKIP = `straggler_wait_s` (the longest a live
replica holds the learner for a due straggler), counted from its first failed call; then the
learner gathers without it (it is "skipped"): its groups wait for it, and a batch may be short of
`learner.batch_groups` (what the live replicas have ready after `timeout_s`), since the skipped
replica's admitted groups keep their place in the gate. A background probe calls a skipped replica
until it answers; then it is peeked again. What its groups lost meanwhile is the store's usual
stale rule: members that reach it too stale to train are cut (`filtered:stale_on_arrival`), ready
groups the learner outran fail its per-token check (`quarantined:stale`); no trained token lags
more than η (docs/ARCHITECTURE.md "Store replicas").

Groups taken while the gather goes on stay handed out to this learner (a learner that dies
meanwhile gets them back on its next start, `learner_restarted`). Report goes to the replica that
handed each trajectory out; one that does not take it owes it: it is sent (in order) before
anything else the next time that replica is called, so a restarted replica never hands out again
what this learner trained.
"""

from __future__ import annotations

import asyncio
import functools
import heapq
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any

import grpc
from prometheus_client import Counter, Gauge

from trajmesh import security
from trajmesh.bus import partition_of
from trajmesh.config import RunConfig
from trajmesh.services.store.service import straggler_wait_s
from trajmesh.v1 import services_pb2, services_pb2_grpc

log = logging.getLogger("trajmesh.learner.store")

PEEK_WAIT_S = 0.25
"""How long a peek waits for its replica's ready groups to change (the gather's poll interval
while it waits; a change answers at once); also the pause before calling a replica that just failed."""
TAKE_WAIT_S = 2.0
"""How long a take waits for its share (it was ready at the peek: only a restarted replica waits)."""
UNREACHABLE = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)
"""A replica's call failed this way: it is down, restarting or stopped (not a bug to raise)."""

UNREACHABLE_SECONDS = Gauge("trajmesh_learner_store_replica_unreachable_seconds",
                            "Seconds since the first failed call of a store replica that does not answer "
                            "(0 while it answers); skipped from straggler_wait_s on", ["replica"])
SKIPPED_STEPS = Counter("trajmesh_learner_store_replica_skipped_steps_total",
                        "Learner steps whose batch was gathered without this store replica (unreachable "
                        "for longer than the straggler hold)", ["replica"])

Rpc = Callable[[Any, Any], Awaitable[Any]]


def shares(peeks: list[services_pb2.NextBatchResponse], groups: int) -> dict[int, int]:
    """Replica → groups to take: the `groups` oldest ready groups across replicas (admission
    version, then replica index)."""
    merged = heapq.merge(*([(v, k) for v in p.ready_versions] for k, p in enumerate(peeks)))
    out: dict[int, int] = {}
    for _, k in list(merged)[:groups]:
        out[k] = out.get(k, 0) + 1
    return out


class StoreClient:
    """NextBatch and Report against `cfg.store_endpoints`, through `rpc` (the learner's call
    wrapper: it rides out a replica's restart) for one store and for takes; across replicas, peeks
    and Reports are called with a deadline, so that one replica that stops answering cannot hold
    the learner past `skip_after_s`."""

    def __init__(self, cfg: RunConfig, rpc: Rpc) -> None:
        self.cfg = cfg
        self.rpc = rpc
        self.channels = [security.grpc_channel(a, cfg.infra.security.grpc_tls) for a in cfg.store_endpoints]
        self.stubs = [services_pb2_grpc.TrajectoryStoreStub(c) for c in self.channels]
        n = len(self.stubs)
        self.restarted = [True] * n
        """Per replica: this learner process has not called it yet (its first call says so)."""
        self.skip_after_s = straggler_wait_s(cfg)
        """How long a replica may fail to answer before the gather goes on without it: as long as
        a live replica holds the learner for a due straggler."""
        self.unreachable_since: list[float | None] = [None] * n
        """Per replica: the loop time of the first call of its current run of failed calls (None
        while it answers)."""
        self.owed: list[list[services_pb2.ReportRequest]] = [[] for _ in range(n)]
        """Per replica: Reports it did not take, sent in order before its next call."""
        self.paying = [asyncio.Lock() for _ in range(n)]
        """Per replica: one delivery of its owed Reports at a time (a probe and a Report may race)."""
        self.probes: dict[int, asyncio.Task[None]] = {}
        """Per skipped replica: the call that finds out whether it answers again."""
        for k in range(n):
            SKIPPED_STEPS.labels(replica=str(k))
            UNREACHABLE_SECONDS.labels(replica=str(k)).set_function(functools.partial(self._unreachable_s, k))

    async def close(self) -> None:
        """Stops the probes, delivers the Reports still owed (riding out a restart, until the
        learner stops), closes the channels."""
        for task in self.probes.values():
            task.cancel()
        await asyncio.gather(*self.probes.values(), return_exceptions=True)
        for k, owed in enumerate(self.owed):
            while owed:
                try:
                    await self.rpc(self.stubs[k].Report, owed[0])
                except grpc.aio.AioRpcError as exc:
                    log.error("store replica %d never took %d Reports (%s): their trajectories end as that "
                              "replica's finalization records them", k, len(owed), exc.code().name)
                    break
                owed.pop(0)
        for channel in self.channels:
            await channel.close()

    async def _next_batch(self, k: int, request: services_pb2.NextBatchRequest) -> services_pb2.NextBatchResponse:
        request.learner_restarted = self.restarted[k]
        resp = await self.rpc(self.stubs[k].NextBatch, request)
        self.restarted[k] = False
        return resp  # type: ignore[no-any-return]

    async def next_batch(self, version: int, timeout_s: float = 5.0) -> services_pb2.NextBatchResponse:
        """A batch for the learner at `version`: `learner.batch_groups` whole groups, or none
        after `timeout_s` (unless part of one is taken already: then it waits for the rest; while
        a replica is skipped, it returns that part)."""
        if len(self.stubs) == 1:
            return await self._next_batch(0, services_pb2.NextBatchRequest(
                learner_version=version, max_trajectories=self.cfg.batch_trajectories, timeout_seconds=timeout_s))
        return await self._gather(version, timeout_s)

    # ------------------------------------------------------------------ calls with a deadline
    async def _reach(self, k: int, call: Any, request: Any, wait_s: float) -> Any | None:
        """`call(request)` on replica k with the deadline `wait_s` + `skip_after_s`; None (and k
        noted unreachable) if it fails UNAVAILABLE or past the deadline."""
        loop = asyncio.get_running_loop()
        started = loop.time()
        try:
            resp = await call(request, timeout=wait_s + self.skip_after_s)
        except grpc.aio.AioRpcError as exc:
            if exc.code() not in UNREACHABLE:
                raise
            if self.unreachable_since[k] is None:
                self.unreachable_since[k] = started
                log.warning("store replica %d unreachable (%s); the learner gathers without it after %.0fs",
                            k, exc.code().name, self.skip_after_s)
            return None
        since = self.unreachable_since[k]
        if since is not None:
            log.warning("store replica %d answers again after %.1fs", k, loop.time() - since)
            self.unreachable_since[k] = None
        return resp

    async def _pay(self, k: int) -> bool:
        """Delivers replica k's owed Reports, in order. False if it did not take them all."""
        async with self.paying[k]:
            while self.owed[k]:
                if await self._reach(k, self.stubs[k].Report, self.owed[k][0], 0.0) is None:
                    return False
                self.owed[k].pop(0)
            return True

    async def _peek(self, k: int, version: int, groups: int, wait_s: float,
                    elsewhere: bool) -> services_pb2.NextBatchResponse | None:
        if not await self._pay(k):
            return None
        resp = await self._reach(k, self.stubs[k].NextBatch, services_pb2.NextBatchRequest(
            learner_version=version, peek=True, max_groups=groups, timeout_seconds=wait_s,
            batch_ready_elsewhere=elsewhere, learner_restarted=self.restarted[k]), wait_s)
        if resp is not None:
            self.restarted[k] = False
        return resp  # type: ignore[no-any-return]

    async def _probe(self, k: int, version: int) -> None:
        """One call to skipped replica k (its owed Reports, a peek); a failed one pauses
        PEEK_WAIT_S before the next probe."""
        if await self._peek(k, version, 1, 0.0, False) is None:
            await asyncio.sleep(PEEK_WAIT_S)

    def _unreachable_s(self, k: int) -> float:
        since = self.unreachable_since[k]
        return 0.0 if since is None else time.monotonic() - since  # the event loop's clock

    def _skipped(self) -> set[int]:
        now = asyncio.get_running_loop().time()
        return {k for k, since in enumerate(self.unreachable_since)
                if since is not None and now - since >= self.skip_after_s}

    def _probe_skipped(self, skipped: set[int], version: int) -> None:
        for k, task in list(self.probes.items()):
            if task.done():
                del self.probes[k]
                task.result()  # anything but an unreachable replica fails loudly
        for k in skipped - set(self.probes):
            self.probes[k] = asyncio.ensure_future(self._probe(k, version))

    # ------------------------------------------------------------------ the gather
    async def _gather(self, version: int, timeout_s: float) -> services_pb2.NextBatchResponse:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        n = len(self.stubs)
        need, wait, elsewhere = self.cfg.learner.batch_groups, 0.0, False
        batch = services_pb2.NextBatchResponse()
        without: set[int] = set()  # the replicas skipped when a take of this batch was made
        while need > 0:
            skipped = self._skipped()
            self._probe_skipped(skipped, version)
            live = [k for k in range(n) if k not in skipped]
            answers = await asyncio.gather(*(self._peek(k, version, need, wait, elsewhere) for k in live))
            peeks = [services_pb2.NextBatchResponse() for _ in range(n)]
            for k, resp in zip(live, answers, strict=True):
                if resp is not None:
                    peeks[k] = resp
            skipped = self._skipped()
            failed = [k for k, resp in zip(live, answers, strict=True) if resp is None]
            waiting = [k for k in failed if k not in skipped]  # it may hold a due group: not yet
            ready = sum(len(p.ready_versions) for p in peeks)
            late = loop.time() >= deadline
            elsewhere = ready >= need or (bool(skipped) and ready > 0)
            if not waiting and not any(p.held for p in peeks) and (ready >= need or (skipped and ready and late)):
                group_size = self.cfg.tasks.group_size
                takes = await asyncio.gather(*(self._next_batch(k, services_pb2.NextBatchRequest(
                    learner_version=version, max_groups=m, max_trajectories=m * group_size,
                    timeout_seconds=TAKE_WAIT_S)) for k, m in shares(peeks, need).items()))
                for resp in takes:
                    batch.trajectories.extend(resp.trajectories)
                    need -= len({t.group_id for t in resp.trajectories})
                without |= skipped
            if need > 0 and late and (not batch.trajectories or skipped):
                break  # nothing yet (the learner idles and asks again), or short while a replica is skipped
            wait = PEEK_WAIT_S
            if failed:
                await asyncio.sleep(PEEK_WAIT_S)  # a replica that refuses at once is not called in a tight loop
        for k in without if batch.trajectories else ():
            SKIPPED_STEPS.labels(replica=str(k)).inc()
        return batch

    async def report(self, request: services_pb2.ReportRequest, group_of: dict[str, str]) -> None:
        """`request` (the learner's verdict on a batch) to the replica of each id's group
        (`group_of`: trajectory id → group id, from the batch). A replica that does not take its
        part (or still owes an earlier one) owes it (`owed`)."""
        n = len(self.stubs)
        if n == 1:
            await self.rpc(self.stubs[0].Report, request)
            return
        parts = [services_pb2.ReportRequest(learner_version=request.learner_version) for _ in range(n)]
        for tid in request.trained_ids:
            parts[partition_of(group_of[tid], n)].trained_ids.append(tid)
        for tid, reason in zip(request.quarantined_ids, request.quarantine_reasons, strict=True):
            part = parts[partition_of(group_of[tid], n)]
            part.quarantined_ids.append(tid)
            part.quarantine_reasons.append(reason)
        for k, part in enumerate(parts):
            if part.trained_ids or part.quarantined_ids:
                self.owed[k].append(part)
        await asyncio.gather(*(self._pay(k) for k in range(n) if self.unreachable_since[k] is None))
        for k in range(n):
            if self.owed[k]:
                log.warning("store replica %d owes %d Reports: sent when it answers again", k, len(self.owed[k]))
