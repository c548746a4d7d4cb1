"""The learner's side of the trajectory store: one store, or a batch gathered from every replica.

With one store a batch is one NextBatch call: the store waits for a full batch, and holds the
learner while it recovers a previous store's trajectories or waits for a due straggler.

With `store.replicas` N > 1 each replica holds the groups of its partition (`trajmesh.bus.
partition_of`), and a batch is gathered::

    peek every replica ──▶ held? the admission versions of its ready groups
         ▲   │ fewer ready than a batch across replicas, or one holds the learner
         └───┘ peek again: each waits (≤ PEEK_WAIT_S) for a change of its ready groups; once a
             │ batch is ready elsewhere, a holding replica's straggler wait runs (as one store's)
             ▼
    take from each replica its share (NextBatch max_groups = share): the batch's groups, oldest
    admission first across replicas; a replica restarted meanwhile gives none, peek again for the rest

Every replica is held to the same rule as one store, so the learner steps only when no replica
waits for a group that this step would make stale. Groups taken while the gather goes on stay
handed out to this learner (a learner that dies meanwhile gets them back on its next start,
`learner_restarted`). Report goes to the replica that handed each trajectory out.
"""

from __future__ import annotations

import asyncio
import heapq
from collections.abc import Awaitable, Callable
from typing import Any

from trajmesh import security
from trajmesh.bus import partition_of
from trajmesh.config import RunConfig
from trajmesh.v1 import services_pb2, services_pb2_grpc

PEEK_WAIT_S = 0.25
"""How long a peek waits for its replica's ready groups to change (the gather's poll interval
while it waits; a change answers at once)."""
TAKE_WAIT_S = 2.0
"""How long a take waits for its share (it was ready at the peek: only a restarted replica waits)."""

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
    wrapper: it rides out a replica's restart)."""

    def __init__(self, cfg: RunConfig, rpc: Rpc) -> None:
        self.cfg = cfg
        self.rpc = rpc
        self.channels = [security.grpc_channel(a, cfg.infra.security.grpc_tls) for a in cfg.store_endpoints]
        self.stubs = [services_pb2_grpc.TrajectoryStoreStub(c) for c in self.channels]
        self.restarted = [True] * len(self.stubs)
        """Per replica: this learner process has not called it yet (its first call says so)."""

    async def close(self) -> None:
        for channel in self.channels:
            await channel.close()

    async def _next_batch(self, k: int, request: services_pb2.NextBatchRequest) -> services_pb2.NextBatchResponse:
        request.learner_restarted = self.restarted[k]
        resp = await self.rpc(self.stubs[k].NextBatch, request)
        self.restarted[k] = False
        return resp  # type: ignore[no-any-return]

    async def next_batch(self, version: int, timeout_s: float = 5.0) -> services_pb2.NextBatchResponse:
        """A batch for the learner at `version`: `learner.batch_groups` whole groups, or none
        after `timeout_s` (unless part of one is taken already: then it waits for the rest)."""
        if len(self.stubs) == 1:
            return await self._next_batch(0, services_pb2.NextBatchRequest(
                learner_version=version, max_trajectories=self.cfg.batch_trajectories, timeout_seconds=timeout_s))
        return await self._gather(version, timeout_s)

    async def _gather(self, version: int, timeout_s: float) -> services_pb2.NextBatchResponse:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        need, wait, elsewhere = self.cfg.learner.batch_groups, 0.0, False
        batch = services_pb2.NextBatchResponse()
        while need > 0:
            peeks = await asyncio.gather(*(self._next_batch(k, services_pb2.NextBatchRequest(
                learner_version=version, peek=True, max_groups=need, timeout_seconds=wait,
                batch_ready_elsewhere=elsewhere)) for k in range(len(self.stubs))))
            elsewhere = sum(len(p.ready_versions) for p in peeks) >= need
            if elsewhere and not any(p.held for p in peeks):
                group_size = self.cfg.tasks.group_size
                takes = await asyncio.gather(*(self._next_batch(k, services_pb2.NextBatchRequest(
                    learner_version=version, max_groups=n, max_trajectories=n * group_size,
                    timeout_seconds=TAKE_WAIT_S)) for k, n in shares(peeks, need).items()))
                for resp in takes:
                    batch.trajectories.extend(resp.trajectories)
                    need -= len({t.group_id for t in resp.trajectories})
            elif not batch.trajectories and loop.time() >= deadline:
                break
            wait = PEEK_WAIT_S
        return batch

    async def report(self, request: services_pb2.ReportRequest, group_of: dict[str, str]) -> None:
        """`request` (the learner's verdict on a batch) to the replica of each id's group
        (`group_of`: trajectory id → group id, from the batch)."""
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
        await asyncio.gather(*(self.rpc(self.stubs[k].Report, part) for k, part in enumerate(parts)
                               if part.trained_ids or part.quarantined_ids))
