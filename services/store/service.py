"""Trajectory store: the data buffer of the mesh (docs/DESIGN.md §1.1, §3).

::

      TaskSampler ──▶ admission_loop ── gate.try_admit(G) ──▶ TASKS (one prompt × G)
                          ▲  wakes on: capacity freed, learner version advanced
                          │
   TRAJ_GRADED ──▶ intake_loop ── parse ─ known task? ─ validate ─ dedupe ─▶ groups
                                  │ quarantine (reason) ─────────────────────┐   │ complete (G received)
                                  ▼                                          ▼   ▼
                               Parquet archive ◀── filtered (zero variance) ◀─ ready groups (bounded)
                                                                                  │
                                        learner ◀── gRPC NextBatch ◀──────────────┘
                                        learner ──▶ gRPC Report (trained / quarantined) ──▶ archive

Redis holds the store's record (every key named in keys.py, written through repo.py): the task
records, the final and settled marks (dedupe), the groups' membership and their gate accounting,
the tasks admitted but not yet published, the sampler cursor and the run's end; the gate's
counters beside it. Other services read or write only through record.py (the grader a task's
reference, the learner the run's end and the cursor). Every record the store sees
goes to the archive; every admitted trajectory ends as exactly one of trained, filtered,
quarantined, failed_infra or (when a finished run stops) in_flight_at_stop.

With `store.replicas` > 1 each replica owns a partition of the groups (`trajmesh.bus.partition_of`):
it consumes its partition's TRAJ_GRADED subject, waits for, recovers and finalizes its own groups,
and serves the learner its share (services/store/client.py gathers a batch from every replica). All
replicas admit, through the one gate; a replica's death leaves its partition to its restart.

This module is the wiring: the states and transitions of held trajectories and groups live in
`trajmesh.services.store.state.StoreState` (pure), the Redis bookkeeping in `trajmesh.services.store.repo.StoreRepo`.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import re
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import nats.errors
import nats.js.errors
import numpy as np
import pyarrow.parquet as pq
from prometheus_client import Counter, Gauge

from trajmesh import bus as busmod
from trajmesh import security
from trajmesh.bus import Bus, Consumer
from trajmesh.config import RunConfig
from trajmesh.contract import ContractError, Trajectory, varint
from trajmesh.gate import AsyncStalenessGate
from trajmesh.service import STOP_WORK_S, Service, supervise
from trajmesh.services.store import roc as roc_mod
from trajmesh.services.store.archive import ArchiveWriter
from trajmesh.services.store.intake import (
    INFRA_REASONS,
    OUTCOME_VALID,
    Prejudged,
    judge_parsed,
    judge_prejudged,
    parse,
    prejudge,
)
from trajmesh.services.store.keys import RedisKeys
from trajmesh.services.store.repo import (
    FINISH_LEFT,
    NOT_COMPLETE,
    IntakeFacts,
    IntakeItem,
    Lookup,
    Membership,
    StoreRepo,
    base_task_id,
    task_id_at,
)
from trajmesh.services.store.state import (
    ACCEPTED_BEFORE_CRASH,
    NOT_RETURNED,
    UNUSED_AT_END,
    Final,
    Group,
    StoreState,
    filter_reason,
)
from trajmesh.tasks import MixtureTracker, TaskSampler, profile_path
from trajmesh.tokenizer import load_tokenizer
from trajmesh.v1 import services_pb2, services_pb2_grpc, trajectory_pb2

log = logging.getLogger("trajmesh.store")

TASKS_ADMITTED = Counter("trajmesh_store_tasks_admitted_total", "Tasks (prompt x G) admitted by the gate", ["source"])
TRAJ_ADMITTED = Counter("trajmesh_store_trajectories_admitted_total", "Trajectories admitted (tasks x G)")
SOURCE_WEIGHT_SHARE = Gauge("trajmesh_store_source_weight_share_ratio",
                            "A source's mixture weight over the sum of weights (trajmesh/tasks.py)", ["source"])
SOURCE_ADMITTED_SHARE = Gauge("trajmesh_store_source_admitted_share_ratio",
                              "A source's share of the tasks this store admitted", ["source"])
MIXTURE_DRIFT = Gauge("trajmesh_store_mixture_drift_ratio",
                      "Largest |admitted share - weight share| over sources (TrajmeshMixtureDrift)")
REPROFILES = Counter("trajmesh_store_task_reprofiles_total",
                     "Curriculum re-profiles from the run's outcomes (tasks.reprofile_every_versions)")
OUTCOMES = Counter(
    "trajmesh_store_trajectories_total", "Trajectory records by outcome and reason", ["outcome", "reason"]
)
GROUPS_READY = Gauge("trajmesh_store_groups_ready", "Assembled groups waiting for the learner")
GROUPS_FILTERED = Counter("trajmesh_store_groups_filtered_total", "Groups dropped by a filter", ["reason"])
GATE_CAPACITY = Gauge("trajmesh_store_gate_capacity_trajectories", "Staleness gate capacity")
GATE_RUNNING = Gauge("trajmesh_store_gate_running_trajectories", "Trajectories admitted and not yet back")
LEARNER_VERSION = Gauge("trajmesh_store_learner_version", "Policy version the learner reported")
GATE_ETA = Gauge("trajmesh_store_gate_max_lag_versions", "The staleness bound η the gate enforces (versions)")
TASKS_DONE = Counter("trajmesh_store_tasks_total",
                     "Tasks (groups) completed, by source, outcome (accepted|filtered) and filter reason",
                     ["source", "outcome", "reason"])
ZERO_VARIANCE = Counter("trajmesh_store_zero_variance_groups_total",
                        "Completed groups whose rewards are all equal (counted whether or not they are dropped)",
                        ["source"])
ZERO_VARIANCE_RATIO = Gauge("trajmesh_store_zero_variance_groups_ratio",
                            "Fraction of the last 100 completed groups whose rewards are all equal")
DISTINCT_ANSWERS_RATIO = Gauge("trajmesh_store_group_distinct_answers_ratio",
                               "Mean over the last 100 groups of distinct answers (sampled token sequences) / members")
TRUNCATED = Counter("trajmesh_store_trajectories_truncated_total",
                    "Trajectories received truncated (MAX_TOKENS / MAX_TURNS)", ["source"])
RETRIED = Counter("trajmesh_store_trajectories_retried_total",
                  "Trajectories received again (a task or message was redelivered and retried)", ["source"])
QUEUE_PENDING = Gauge("trajmesh_store_queue_pending_messages",
                      "JetStream messages not yet delivered to the stream's durable consumer", ["stream"])
QUEUE_ACK_PENDING = Gauge("trajmesh_store_queue_ack_pending_messages",
                          "JetStream messages delivered and awaiting an ack", ["stream"])
QUEUE_AGE = Gauge("trajmesh_store_queue_oldest_age_seconds",
                  "Age of the oldest message still in a work-queue stream (not yet acked); 0 when empty",
                  ["stream"])
READY_AGE = Gauge("trajmesh_store_ready_group_oldest_age_seconds",
                  "Age of the oldest assembled group waiting for the learner; 0 when none")
RECOVERY_OWED = Gauge("trajmesh_store_recovery_owed_trajectories",
                      "Trajectories a previous store held that have not come back yet (NextBatch waits for them)")
RECOVERY_MISSING = Counter("trajmesh_store_recovery_missing_trajectories_total",
                           "Owed trajectories still missing when the recovery wait ran out")
STALE_HANDED_OUT = Counter("trajmesh_store_stale_handed_out_trajectories_total",
                           "Trajectories handed to the learner already staler than the bound η (it will "
                           "quarantine them as stale; a healthy run keeps this at 0)")
HELD = Gauge("trajmesh_store_held_trajectories",
             "Trajectories the store holds unacked, by state (received: group still assembling; ready; "
             "handed_out: given to the learner, not reported)", ["state"])
QUEUE_POLL_FAILURES = Counter("trajmesh_store_queue_poll_failures_total",
                              "Backlog polls (queue_loop) that NATS did not answer in time; the loop goes on")
STRAGGLERS_GIVEN_UP = Gauge("trajmesh_store_stragglers_given_up_groups",
                            "Due groups (admitted at <= learner version - eta) the learner stopped waiting for")
INFRA_REFILLS = Counter("trajmesh_store_infra_refill_trajectories_total",
                        "Refills admitted: a new sample of a task in the place of a member that ended "
                        "INFRA_FAILURE, by the failed one's cause (store.infra_refills_per_group)", ["cause"])
INFRA_REFILLS_REFUSED = Counter("trajmesh_store_infra_failures_not_refilled_total",
                                "Infra-failed members not refilled, by why (cap: the group had "
                                "store.infra_refills_per_group; run_finished; old_task_record)", ["reason"])
STALE_ON_ARRIVAL = ("filtered", "stale_on_arrival")
"""Final outcome of a member that reached the store already staler than η at the learner's current
version (it could only be quarantined as stale): cut, never handed out, its group completes
without it. A healthy run has none; an outage longer than the straggler hold can cause them."""
STALE_CUT_SHORT = ("filtered", "stale_cut_short")
"""Final outcome of a member the rollout stopped generating (terminal reason STALE): its oldest
token lagged the loaded weights by more than η."""
POISON = "poison"
"""Quarantine reason of a TRAJ_GRADED message delivered more than `infra.max_deliveries` times."""
QUEUES = ((busmod.STREAM_TASKS, "rollout"), (busmod.STREAM_TRAJ_RAW, "grader"), (busmod.STREAM_TRAJ_GRADED, "store"))
"""(stream, durable consumer) pairs whose backlog the store exports."""
for _outcome, _reason in (("filtered", "zero_variance"), ("filtered", "group_too_small"),
                          ("quarantined", "stale"), ("quarantined", POISON), STALE_ON_ARRIVAL, STALE_CUT_SHORT,
                          ("in_flight_at_stop", "held_at_stop"), ("in_flight_at_stop", "not_returned")):
    OUTCOMES.labels(outcome=_outcome, reason=_reason)  # exported at 0 so rates exist before the first one
for _reason in INFRA_REASONS:
    OUTCOMES.labels(outcome="failed_infra", reason=_reason)
    INFRA_REFILLS.labels(cause=_reason)
for _reason in ("cap", "run_finished", "old_task_record"):
    INFRA_REFILLS_REFUSED.labels(reason=_reason)
for _stream, _ in QUEUES:
    for _g in (QUEUE_PENDING, QUEUE_ACK_PENDING, QUEUE_AGE):
        _g.labels(stream=_stream)
for _state in ("received", "ready", "handed_out"):
    HELD.labels(state=_state)


@dataclass
class _Incoming:
    """A TRAJ_GRADED message, parsed once."""
    data: bytes
    msg: Any
    peek: Trajectory | None
    tid: str


def runs_without_repeats(items: list[_Incoming]) -> list[list[_Incoming]]:
    """Consecutive runs of `items`, each without a repeated (non-empty) trajectory id."""
    runs: list[list[_Incoming]] = [[]]
    for item in items:
        if item.tid and any(item.tid == other.tid for other in runs[-1]):
            runs.append([])
        runs[-1].append(item)
    return [r for r in runs if r]


_Member = tuple[_Incoming, Trajectory, str, str, dict[str, Any]]
"""A group member of a run: its message, trajectory, outcome, reason and task record."""


def _check_round(members: list[_Member], looked_up: list[_Incoming], facts: dict[int, IntakeFacts]) -> None:
    """The intake round recorded each message's membership as the store's own verdict says:
    members and only members recorded, valid exactly when the verdict is valid."""
    verdicts = {id(it): outcome == OUTCOME_VALID for it, _, outcome, _, _ in members}
    for it in looked_up:
        f = facts[id(it)]
        if f.recorded != (id(it) in verdicts) or f.valid != verdicts.get(id(it), False):
            raise RuntimeError(f"intake round disagrees with the store's verdict on {it.tid}: recorded "
                               f"{f.recorded} valid {f.valid}, verdict {verdicts.get(id(it))}")


@dataclass
class _Wiring:
    """The store's connections and writers, made in `setup()`."""
    redis: Any
    repo: StoreRepo
    gate: AsyncStalenessGate
    bus: Bus
    intake: Consumer
    archive: ArchiveWriter
    grpc_server: Any


def straggler_wait_s(cfg: RunConfig) -> float:
    """How long the learner is held for a due straggler: as long as it can take to come back after
    one crash on its way (the slowest redelivery: a rollout's task, a grader's TRAJ_RAW message or a
    store's TRAJ_GRADED message, each after its ack wait) plus `store.straggler_slack_s` to be done
    again (90 s with the defaults). Then the learner goes on; the straggler's members that come
    back too stale to train are cut at intake (`filtered:stale_on_arrival`), never handed to the
    learner to be quarantined."""
    slowest = max(cfg.rollout.task_ack_wait_s, busmod.GRADER_ACK_WAIT_S, cfg.store.intake_ack_wait_s)
    return slowest + cfg.store.straggler_slack_s


class TrajectoryStore(Service):
    name = "store"
    stop_work_s = STOP_WORK_S["store"]
    """The finalization in `stop()` (every held and owed trajectory archived as one outcome; it
    reads the archive once): with the default `service.stop_timeout_s` the store gets 120 s, the
    launcher's allowance (trajmesh.run.run_end.STORE_STOP_S)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.io: _Wiring | None = None
        """Connections (None until `setup()`)."""
        self.state = StoreState(straggler_wait_s(self.cfg))
        """Every held trajectory's and group's state (pure)."""
        self.vocab_size = 0
        self.roc_scores: Callable[[Trajectory], roc_mod.Scores] | None = None
        """GRPO-RoC's scorer of a member (None: RoC is off)."""
        self.sampler: TaskSampler | None = None
        self.mixture = MixtureTracker(self.cfg.tasks.sources)
        """Tasks this store admitted per source against the mixture weights (exported as gauges)."""
        self.manifest_id = ""
        self.recovery_pending = False
        """Whether NextBatch waits for trajectories a previous store held."""
        self.held_at = 0.0
        """When the learner was last held for due stragglers (logging only)."""
        self.ready_changed = asyncio.Event()
        self.capacity_changed = asyncio.Event()
        self.published_tasks: list[str] = []
        """Tasks on TASKS whose unpublished mark the admission loop's next round clears."""
        self.recent_zero_variance: deque[bool] = deque(maxlen=100)
        self.recent_distinct_ratio: deque[float] = deque(maxlen=100)
        self.partitions = self.cfg.store.replicas
        """Store replicas; this one (`replica`) owns the groups whose partition is its index."""
        self.durable = busmod.store_durable(self.replica, self.partitions)
        """Its TRAJ_GRADED durable consumer."""

    @property
    def w(self) -> _Wiring:
        assert self.io is not None, "store used before setup()"
        return self.io

    async def setup(self) -> None:
        cfg = self.cfg
        keys = RedisKeys(cfg.infra.namespace)
        assert cfg.infra.nats_url and cfg.infra.redis_url, "store needs infra.nats_url and infra.redis_url"
        assert cfg.model.path, "store needs model.path (for the tokenizer's vocabulary)"
        k, n = self.replica, self.partitions
        if k >= n:
            raise ValueError(f"store replica {k} of store.replicas {n}: replicas are 0..{n - 1}")
        r = security.redis_client(cfg)
        gate = AsyncStalenessGate.from_config(r, cfg)
        repo = StoreRepo(r, keys, gate, owns=lambda gid: busmod.partition_of(gid, n) == k)
        bus = await security.connect_bus(cfg, "store", name=self.worker_id)
        intake = await bus.pull_subscribe(
            busmod.STREAM_TRAJ_GRADED, self.durable, ack_wait_s=cfg.store.intake_ack_wait_s, max_ack_pending=100_000,
            on_poison=self._on_poison, subject=busmod.graded_subject(k, n))
        tokenizer = load_tokenizer(cfg.model.path)
        self.vocab_size = tokenizer.vocab_size
        roc = cfg.store.resample_on_correct
        if roc.enabled:
            tag = re.compile(roc.answer_pattern)
            self.roc_scores = lambda t: roc_mod.scores(t, tokenizer.decode(t.token_ids_T[t.loss_mask_T == 1]), tag)
        self.sampler = TaskSampler(cfg.tasks, seed=cfg.seed, profile_in=profile_path(cfg.tasks, cfg.run_dir),
                                   profile_out=Path(cfg.run_dir) / "task_profile.json")
        for name, share in self.mixture.weight_share.items():
            SOURCE_WEIGHT_SHARE.labels(source=name).set(share)
            SOURCE_ADMITTED_SHARE.labels(source=name).set(0.0)
        archive = ArchiveWriter(Path(cfg.run_dir) / "archive", writer=f"store{self.replica}")
        self.manifest_id = await repo.manifest_id()
        GATE_ETA.set(cfg.effective_eta)
        self._export_zero_series()
        server = security.grpc_server()
        add_store_servicer(_StoreServicer(self), server)
        port = cfg.store_endpoints[k].rsplit(":", 1)[1]
        security.add_grpc_port(server, f"0.0.0.0:{port}", cfg.infra.security.grpc_tls)
        self.io = _Wiring(r, repo, gate, bus, intake, archive, server)
        await self._begin_recovery()
        await server.start()

    def _export_zero_series(self) -> None:
        for src in self.cfg.tasks.sources:  # exported at 0 so the data-mixture panels have every source
            TASKS_ADMITTED.labels(source=src.name)
            for outcome, reason in (("accepted", "none"), ("filtered", "zero_variance"),
                                    ("filtered", "group_too_small")):
                TASKS_DONE.labels(source=src.name, outcome=outcome, reason=reason)
            for c in (ZERO_VARIANCE, TRUNCATED, RETRIED):
                c.labels(source=src.name)

    async def _begin_recovery(self) -> None:
        """A previous store's held trajectories (valid members of open groups, not final) come back
        by redelivery within about one ack wait of its death; until they are all here the learner
        gets nothing, so it cannot advance past them (they would be trained stale)."""
        settled = await self.w.repo.settled_open_groups(self.cfg.admitted_group_size)
        await self.w.repo.cleanup(settled, settled)  # left by a store killed between mark and cleanup
        owed = await self.w.repo.owed_ids()
        if owed:
            wait_s = 2 * self.cfg.store.intake_ack_wait_s  # redelivery ≤ ack_wait after the last heartbeat
            self.state.begin_recovery(owed, time.time() + wait_s)
            log.warning("recovering: waiting up to %.0fs for %d trajectories a previous store held",
                        wait_s, len(owed))
        RECOVERY_OWED.set(len(self.state.owed))
        self.recovery_pending = bool(self.state.owed)

    async def run(self) -> None:
        await self._republish_unpublished()
        await supervise(self.admission_loop(), self.intake_loop(), self.flush_loop(), self.queue_loop(),
                        self.heartbeat_loop(), stopping=self.stopping)

    async def stop(self) -> None:
        io = self.io
        if io is None:
            return
        await io.grpc_server.stop(grace=1.0)
        # At the end of a finished run everything still held ends as a recorded outcome. Otherwise
        # (a crash, a restart, Ctrl-C before --resume) held messages stay unacked and come back to
        # the next store.
        if self.published_tasks:  # what the admission loop's next round would have cleared
            for task_id in self.published_tasks:
                await io.repo.published(task_id)
            self.published_tasks = []
        if await io.repo.run_finished():
            await self.finalize_run()
        await self._commit_final()
        io.archive.close()
        await io.bus.close()
        await io.redis.aclose()

    # ------------------------------------------------------------------ the end of a finished run
    async def finalize_run(self) -> None:
        """Every admitted trajectory gets a final outcome: what this store holds (`end_of_run`),
        then, from durable state, every admitted id that still has none: a valid member of a group
        the gate finished as kept (it came back and was kept by a store that died; its message
        waits unacked for a redelivery the stop does not wait for) as
        `filtered:unused_at_end_of_run`, as if that store had lived, and the rest — never returned
        from rollout, or held in a group still incomplete — as `in_flight_at_stop:not_returned`.
        Idempotent (a store killed meanwhile is restarted by the stop path and does it again)."""
        for f in self.state.end_of_run():
            self._archive_final(f)
        await self._commit_final()
        open_members = await self.w.repo.unfinished_members()
        on_disk, accepted_on_disk = self._final_in_archive()
        rows = [m for m in open_members if m.trajectory_id not in on_disk]
        # Members of a group the gate finished as kept, whose `accepted` rows a crashed store never
        # flushed: that acceptance happened (the gate counts it), so the archive records it too.
        counted = await self.w.repo.accepted_members([m.group_id for m in rows])
        unused = 0
        for m in rows:
            kept = m.trajectory_id in counted
            if kept and m.trajectory_id not in accepted_on_disk:
                self.w.archive.append(trajectory_id=m.trajectory_id, task_id=m.task_id, group_id=m.group_id,
                                      task_source=m.source, outcome="accepted", reason=ACCEPTED_BEFORE_CRASH)
            outcome, reason = UNUSED_AT_END if kept else NOT_RETURNED
            unused += kept
            self.w.archive.append(trajectory_id=m.trajectory_id, task_id=m.task_id, group_id=m.group_id,
                                  task_source=m.source, outcome=outcome, reason=reason)
            OUTCOMES.labels(outcome=outcome, reason=reason).inc()
        self.w.archive.flush()
        await self.w.repo.mark_final([m.trajectory_id for m in open_members])
        await self.w.repo.abandon_groups([m.group_id for m in open_members], self.cfg.admitted_group_size)
        await self.w.repo.not_pending(list(dict.fromkeys(m.group_id for m in open_members)))
        if open_members:
            log.warning("run finished: %d admitted trajectories a live store did not hold (%d new rows: %d unused "
                        "members of kept groups a dead store held, %d in flight at stop)",
                        len(open_members), len(rows), unused, len(rows) - unused)

    def _final_in_archive(self) -> tuple[set[str], set[str]]:
        """Ids whose last row on disk is final (a store killed between flush and mark left some),
        and ids with an ``accepted`` row on disk."""
        rows: list[tuple[int, str, str]] = []
        for path in self.w.archive.directory.glob("part-*.parquet"):
            t = pq.read_table(path, columns=["seq", "trajectory_id", "outcome"]).to_pydict()
            rows += zip(t["seq"], t["trajectory_id"], t["outcome"], strict=True)
        last: dict[str, str] = {}
        accepted: set[str] = set()
        for _, tid, outcome in sorted(rows, key=lambda r: r[0]):
            if tid and outcome != "duplicate":
                last[tid] = outcome
                if outcome == "accepted":
                    accepted.add(tid)
        return {tid for tid, outcome in last.items() if outcome != "accepted"}, accepted

    # ------------------------------------------------------------------ admission
    async def admission_loop(self) -> None:
        """Publishes tasks to TASKS while the gate has capacity for a whole group.

        Waits on `capacity_changed`, set when a group finishes (capacity freed) or the learner
        reports a new version (B more slots). A short timeout re-reads the gate, because another
        store replica or a learner recovery may change the counters behind our back.

        Each round is one Redis round trip before the admission's own script
        (`StoreRepo.admission_round`): the finished flag, the gate's counters, the next sampler
        position (drawn once, kept across rounds without capacity) and the clearing of the last
        published task's unpublished mark (`store.pipelined_admission` false: the same commands, one
        round trip each).
        """
        g = self.cfg.admitted_group_size
        cursor: int | None = None  # a sampler position drawn and not admitted yet
        pipelined = self.cfg.store.pipelined_admission
        while True:
            rnd = await self.w.repo.admission_round(draw=cursor is None, published=self.published_tasks,
                                                    pipelined=pipelined)
            self.published_tasks = []
            cursor = rnd.cursor if rnd.cursor is not None else cursor
            if rnd.finished:  # the learner is done: admit nothing more, let it drain
                await asyncio.sleep(1.0)
                continue
            GATE_CAPACITY.set(rnd.counters.capacity)
            GATE_RUNNING.set(rnd.counters.running)
            if rnd.capacity >= g:
                drawn, cursor = cursor, None
                if await self._publish_next_task(rnd.counters.version, drawn):
                    continue
            self.capacity_changed.clear()
            try:
                async with asyncio.timeout(1.0):  # not wait_for: on 3.11 it can swallow a cancel
                    await self.capacity_changed.wait()
            except TimeoutError:
                pass

    async def _publish_next_task(self, version: int, cursor: int | None = None) -> bool:
        """Draw the next task, admit and record it atomically, publish it. False when the gate had
        no capacity left by then (another replica took it; that cursor position is skipped).
        `cursor`: the position the admission loop drew in its round; the loop's next round then
        clears the task's unpublished mark (`published_tasks`). None: drawn and cleared here."""
        assert self.sampler is not None
        deferred = cursor is not None
        if cursor is None:
            cursor = await self.w.repo.next_cursor()
        if self.sampler.maybe_reprofile(version):
            REPROFILES.inc()
        task = self.sampler.task_at(cursor)
        task_id = task_id_at(task.task_id, cursor)
        record = {"group_id": f"g{cursor}-{task.task_id}", "group_size": self.cfg.admitted_group_size,
                  "source": task.source, "revision": task.revision, "environment": task.environment,
                  "answer": task.answer, "prompt": task.prompt, "metadata": task.metadata, "cursor": cursor,
                  "admitted_at_version": version}
        pb = self._task_message(task_id, record)
        data = pb.SerializeToString()
        if not await self.w.repo.try_admit(pb.task_id, record, data, pb.group_size):
            log.info("gate capacity taken meanwhile: sampler position %d skipped", cursor)
            return False
        await self.w.bus.publish(busmod.SUBJECT_TASKS, data, msg_id=pb.task_id, retry_s=busmod.PUBLISH_RETRY_S)
        if deferred:
            self.published_tasks.append(pb.task_id)
        else:
            await self.w.repo.published(pb.task_id)
        TASKS_ADMITTED.labels(source=pb.source).inc()
        TRAJ_ADMITTED.inc(pb.group_size)
        self.mixture.admit(pb.source)
        for name, share in self.mixture.admitted_share().items():
            SOURCE_ADMITTED_SHARE.labels(source=name).set(share)
        MIXTURE_DRIFT.set(self.mixture.drift())
        return True

    def _task_message(self, task_id: str, record: dict[str, Any], *, group_size: int = 0, first_sample: int = 0,
                      refill_of: str = "") -> trajectory_pb2.Task:
        """The TASKS message of an admitted task, from its record: the whole group (`group_size`
        0: the record's G), or a refill (one sample at index `first_sample`, replacing `refill_of`).
        Seed and sampling follow from the cursor and the config, so a refill samples the same task
        the same way, as a new sample."""
        s = self.cfg.tasks.sampling
        return trajectory_pb2.Task(
            task_id=task_id, group_id=str(record["group_id"]), source=str(record["source"]),
            revision=str(record.get("revision", "")), seed=self.cfg.seed * 1_000_003 + int(record["cursor"]),
            group_size=group_size or int(record["group_size"]), environment=str(record.get("environment", "")),
            prompt=str(record["prompt"]), answer=str(record["answer"]),
            metadata_json=json.dumps(record.get("metadata", {}), default=str),
            admitted_at_version=int(record["admitted_at_version"]), manifest_id=self.manifest_id,
            sampling=trajectory_pb2.SamplingParams(temperature=s.temperature, top_p=s.top_p, top_k=s.top_k,
                                                   max_new_tokens=s.max_new_tokens, max_turns=s.max_turns),
            first_sample=first_sample, refill_of=refill_of)

    async def _refill(self, traj: Trajectory, reason: str, task: dict[str, Any], refills: int) -> int:
        """`traj` ended INFRA_FAILURE (`reason`: infra_<cause>): admit and publish one new sample of
        its task in its place, unless its group has `store.infra_refills_per_group` already or the
        run is finished (then the group ends with what it has). Idempotent for a redelivered
        member. Returns the group's refills after (`refills`: before)."""
        cap = self.cfg.store.infra_refills_per_group
        if cap == 0:  # refills off (the gate step below says whether a group reached its cap)
            INFRA_REFILLS_REFUSED.labels(reason="cap").inc()
            return refills
        if "environment" not in task or "cursor" not in task:  # a record from before refills
            INFRA_REFILLS_REFUSED.labels(reason="old_task_record").inc()
            return refills
        index = int(task["group_size"]) + refills
        msg_id = f"{traj.task_id}-refill{index}"
        pb = self._task_message(traj.task_id, task, group_size=1, first_sample=index, refill_of=traj.trajectory_id)
        data = pb.SerializeToString()
        status, after = await self.w.repo.refill(traj.group_id, traj.trajectory_id, index, msg_id, data, cap)
        if status == 1:
            await self.w.bus.publish(busmod.SUBJECT_TASKS, data, msg_id=msg_id, retry_s=busmod.PUBLISH_RETRY_S)
            await self.w.repo.published(msg_id)
            INFRA_REFILLS.labels(cause=reason).inc()
            TRAJ_ADMITTED.inc()
            log.info("refilled %s (%s) with sample %d of its task", traj.trajectory_id, reason, index)
        elif status < 0:
            INFRA_REFILLS_REFUSED.labels(reason="run_finished" if status == -1 else "cap").inc()
        return after

    async def _republish_unpublished(self) -> None:
        for task_id, data in (await self.w.repo.unpublished()).items():
            await self.w.bus.publish(busmod.SUBJECT_TASKS, data, msg_id=task_id, retry_s=busmod.PUBLISH_RETRY_S)
            await self.w.repo.published(task_id)
            log.info("republished task %s admitted by an earlier store", task_id)

    # ------------------------------------------------------------------ intake
    async def intake_loop(self) -> None:
        """Consumes TRAJ_GRADED. A message is acked only once its trajectory's outcome is final and
        archived (quarantined, failed_infra, filtered, trained); group members wait unacked.

        Waits for messages (pull fetch with timeout); backpressure: stops fetching while the
        ready buffer is full (the gate keeps that rare). Returns once `stopping` is set: nats-py's
        fetch can swallow the loop's cancellation (a fetch that completed at the same moment,
        Python < 3.12 `asyncio.wait_for`), and the loop must not fetch on then (the store's stop
        waited out its whole budget on such a loop in a bench run).
        """
        while not self.stopping.is_set():
            if self.state.ready_count >= self.cfg.store.max_buffered_groups:
                self.ready_changed.clear()
                await self.ready_changed.wait()
                continue
            msgs = await self.w.intake.fetch(batch=32, timeout=1.0)
            items = []
            for msg in msgs:
                data = await self.w.intake.resolve(msg)
                peek = parse(data)  # once: the task lookup needs the task id, the verdict the rest
                items.append(_Incoming(data, msg, peek, peek.trajectory_id if peek is not None else ""))
            # Runs without a repeated trajectory id are judged together (two Redis round trips per
            # run instead of two per message); a repeat starts a new run, so every message sees the
            # effects of the ones before it exactly as if they were taken one by one.
            for run in runs_without_repeats(items):
                await self._intake_run(run)
            self._note_recovery()

    async def _on_poison(self, msg: Any) -> None:
        """A TRAJ_GRADED message delivered more than `infra.max_deliveries` times (it kept crashing
        or stalling stores); the bus terminates it right after this. Its trajectory ends as a final
        outcome, `quarantined:poison` (archived, counted, marked final), a member of its group like
        any invalid one, so the group still completes and the gate releases it. An id already
        final is a duplicate, as on the normal path; one this store still holds stays held."""
        data = await self.w.intake.resolve(msg)
        peek = parse(data)
        log.warning("poison message (%d deliveries): %s", msg.metadata.num_delivered,
                    peek.trajectory_id if peek is not None else f"{len(data)} bytes, not a trajectory")
        await self._intake_run([_Incoming(data, None, peek, peek.trajectory_id if peek is not None else "")],
                               poison=True)
        await self._commit_final()

    async def _intake_run(self, items: list[_Incoming], *, poison: bool = False) -> None:
        """Judges a run of messages without repeated ids. `poison`: they are terminated by the
        bus (no message to ack) and end as `quarantined:poison`.

        With `store.pipelined_intake` (and no poison, no infra failure to refill) the run's Redis
        bookkeeping is one round trip (`StoreRepo.intake_round`: lookup, membership and the finish
        of the groups it completes); otherwise a lookup, the membership's MULTI and one finish
        script per completed group. Both paths judge with the same code, and the one-round path
        checks that the script recorded what that judgement says."""
        todo = []
        for item in items:
            # redelivered while we still hold it, or before its outcome is marked final in Redis
            if self.state.holds(item.tid) or self.state.awaiting_commit(item.tid):
                self.state.redelivered(item.tid, item.msg)
            else:
                todo.append(item)
        if not todo:
            return
        pre = {id(it): prejudge(it.peek, vocab_size=self.vocab_size) for it in todo if it.peek is not None}
        looked_up = [it for it in todo if it.peek is not None and it.peek.task_id]
        one_round = (self.cfg.store.pipelined_intake and not poison
                     and all(it.peek.terminal_reason != trajectory_pb2.INFRA_FAILURE
                             for it in looked_up if it.peek is not None))
        facts: dict[int, IntakeFacts] | None = None
        if one_round:
            learner_version, found_facts = await self.w.repo.intake_round(
                self._intake_items(looked_up, pre), eta=self.cfg.effective_eta, place=self.cfg.tasks.group_size)
            facts = {id(it): f for it, f in zip(looked_up, found_facts, strict=True)}
            found = [f.lookup for f in found_facts]
        else:
            learner_version, found = await self.w.repo.lookup(
                [(it.peek.task_id, it.tid) for it in looked_up if it.peek is not None],
                [it.peek.group_id for it in looked_up if it.peek is not None])
        records = {id(it): f for it, f in zip(looked_up, found, strict=True)}
        members = self._judge_run(todo, records, pre, learner_version, poison=poison)
        if facts is not None:
            _check_round(members, looked_up, facts)
        if members:
            await self._take_members(members, facts)

    def _judge_run(self, todo: list[_Incoming], records: dict[int, Lookup], pre: dict[int, Prejudged],
                   learner_version: int, *, poison: bool) -> list[_Member]:
        """Each message's verdict from its lookup: non-members finalized here, the members (valid
        or not) returned in order for their membership."""
        members: list[_Member] = []
        for it in todo:
            rec = records.get(id(it))
            task = rec.task if rec is not None else None
            if it.peek is not None and it.tid and rec is not None and rec.already_final:
                RETRIED.labels(source=it.peek.pb.task_source).inc()
                self._finalize(it.peek, "duplicate", "duplicate_trajectory_id", it.msg, mark=False)
                continue
            verdict = (judge_prejudged(it.peek, pre[id(it)], task, learner_version=learner_version)
                       if it.peek is not None else judge_parsed(None, task, vocab_size=self.vocab_size,
                                                                learner_version=learner_version))
            traj = verdict.trajectory
            outcome, reason = ("quarantined", POISON) if poison else (verdict.outcome, verdict.reason)
            if traj is None:
                self._quarantine_bytes(it.data, reason, "not a trajectory")
                self.state.finalize("", it.msg, mark=False)
                continue
            if not verdict.member:  # unknown task, or not one of its G samples: must not touch a group
                self._finalize(traj, outcome, reason, it.msg, mark=False)
                continue
            assert task is not None and rec is not None
            task["refills"] = rec.refills  # the group's refills so far (not part of the stored record)
            if outcome == OUTCOME_VALID and traj.terminal_reason == trajectory_pb2.STALE:
                outcome, reason = STALE_CUT_SHORT
            elif (outcome == OUTCOME_VALID and rec.group_pending
                  and self._stale_at(pre[id(it)].oldest_sampled_version, learner_version)):
                # Only while its group is pending: one handed out may have been trained already,
                # its Report still on the way to this (restarted) store, which must record it.
                outcome, reason = STALE_ON_ARRIVAL
                log.warning("cut %s on arrival: sampled at v%d, learner at v%d (eta %d)", traj.trajectory_id,
                            pre[id(it)].oldest_sampled_version, learner_version, self.cfg.effective_eta)
            if traj.truncated:
                TRUNCATED.labels(source=traj.pb.task_source).inc()
            members.append((it, traj, outcome, reason, task))
        return members

    def _intake_items(self, looked_up: list[_Incoming], pre: dict[int, Prejudged]) -> list[IntakeItem]:
        """`StoreRepo.intake_round`'s items: each message with its prejudgement, and for its group
        what `take_member` and `_complete` will count if every valid-member message of the run is
        recorded valid (the script finishes a group only then)."""
        last = {it.peek.group_id: k for k, it in enumerate(looked_up) if it.peek is not None}
        joining: dict[str, list[Trajectory]] = {}
        for it in looked_up:
            if it.peek is not None and pre[id(it)].valid_member:
                joining.setdefault(it.peek.group_id, []).append(it.peek)
        held: dict[str, int] = {}
        out = []
        for k, it in enumerate(looked_up):
            traj, p = it.peek, pre[id(it)]
            assert traj is not None
            gid = traj.group_id
            group = self.state.assembling.get(gid)
            had = list(group.members) if group is not None else []
            held[gid] = held.get(gid, len(had)) + int(p.valid_member)
            kept = -1
            if self.roc_scores is None:  # a RoC selection is the store's, before the finish
                after = had + joining.get(gid, [])
                kept = 0 if self._filter_reason(after) else len(after)
            out.append(IntakeItem(traj.task_id, it.tid, gid, p.valid_member, p.newest_version,
                                  p.oldest_sampled_version, held[gid], group.refills if group is not None else 0,
                                  kept, last[gid] == k))
        return out

    async def _take_members(self, members: list[_Member], facts: dict[int, IntakeFacts] | None = None) -> None:
        """Records the members' membership (`facts`: recorded already by the run's one round) and
        moves them into their groups; completes a group they complete."""
        # Each infra-failed member's refill is admitted before its membership is recorded, so its
        # group can never complete without waiting for the refill (a crash in between redelivers
        # the member, and the refill's admission is idempotent per failed id).
        refills: dict[str, int] = {}
        for _, traj, outcome, reason, task in members:
            gid = traj.group_id
            refills[gid] = max(refills.get(gid, 0), int(task.get("refills", 0)))
            if outcome == "failed_infra":
                assert facts is None, "a run with an infra failure takes the separate round trips"
                refills[gid] = await self._refill(traj, reason, task, refills[gid])
        if facts is None:
            counts = await self.w.repo.record_members(
                [Membership(traj.group_id, it.tid, outcome == OUTCOME_VALID) for it, traj, outcome, _, _ in members])
            finishes: list[int | None] = [None] * len(members)
        else:
            counts = [facts[id(it)].counts for it, *_ in members]
            finishes = [facts[id(it)].finish for it, *_ in members]
        for (it, traj, outcome, reason, task), (received, valid), finish in zip(members, counts, finishes,
                                                                               strict=True):
            # Only after the membership is recorded may a message be finalized (acked at commit).
            if outcome != OUTCOME_VALID:
                self._finalize(traj, outcome, reason, it.msg)
            group = self.state.take_member(
                traj, it.msg, valid=outcome == OUTCOME_VALID, expected=int(task["group_size"]),
                order=int(task.get("cursor", 1 << 62)), source=str(task.get("source", "")),
                received=received, valid_count=valid, admitted_version=int(task.get("admitted_at_version", 0)),
                refills=refills[traj.group_id])
            if finish is not None and finish != FINISH_LEFT and (group is not None) != (finish != NOT_COMPLETE):
                raise RuntimeError(f"intake round: {traj.group_id} complete in Redis's count ({finish}) but "
                                   f"not in the store's ({group is not None}), at {it.tid}")
            if group is not None:
                await self._complete(group, finished=finish if finish in (0, 1) else None)

    def _filter_reason(self, members: list[Trajectory]) -> str:
        """Why a complete group of these members is dropped ('' = kept: `filter_reason`)."""
        # A group a teacher scored carries a per-token signal whatever its rewards (distillation).
        taught = any(t.teacher_logprobs_T is not None for t in members)
        return filter_reason([t.reward for t in members],
                             drop_zero_variance=self.cfg.store.drop_zero_variance_groups and not taught)

    async def _complete(self, group: Group, finished: int | None = None) -> None:
        """A complete group: filtered, or kept (GRPO-RoC may drop members) and made ready; its
        finish in the gate first. `finished`: the run's one round did that finish already (1: the
        first time), with the accepted count this group's members give (no RoC)."""
        rewards = [t.reward for t in group.members]
        reason = self._filter_reason(group.members)
        roc = self.cfg.store.resample_on_correct
        decisions: dict[str, roc_mod.Decision] = {}
        if not reason and self.roc_scores is not None:
            decisions = {d.trajectory_id: d for d in roc_mod.select(
                group.group_id, group.members, self.cfg.tasks.group_size, correct_above=roc.correct_above,
                penalty_floor=roc.penalty_floor, scored=self.roc_scores)}
        dropped = {tid: d.reason for tid, d in decisions.items() if not d.kept}
        kept = 0 if reason else len(group.members) - len(dropped)
        if finished is None:
            # Out of the group in Redis before their outcomes commit: a group rebuilt after a store
            # restart completes with the kept members alone (the dropped ones are final by then).
            await self.w.repo.leave_group(group.group_id, list(dropped))
            first_time = await self.w.repo.finish_group(group.group_id, accepted=kept,
                                                        rejected=group.expected - kept, place=self.cfg.tasks.group_size)
        else:
            assert not dropped, "a RoC selection is never finished by the intake round"
            first_time = bool(finished)
        if first_time:  # a group rebuilt after a store restart was counted already
            self._note_group_health(group, rewards)
            if self.sampler is not None:  # the curriculum's re-profile reads the run's own outcomes
                for t in group.members:
                    self.sampler.observe(group.source, base_task_id(t.pb.task_id), t.reward)
            TASKS_DONE.labels(source=group.source, outcome="filtered" if reason else "accepted",
                              reason=reason or "none").inc()
        if reason:
            GROUPS_FILTERED.labels(reason=reason).inc()
            log.info("group %s filtered: %s (rewards %s)", group.group_id, reason, rewards)
            for f in self.state.filter_group(group, reason):
                self._archive_row(f)
            if finished is None:  # the intake round took it out of the pending set with its finish
                await self.w.repo.not_pending([group.group_id])
        else:
            for t in group.members:
                d = decisions.get(t.trajectory_id)
                self._archive(t, "filtered" if t.trajectory_id in dropped else "accepted", d.reason if d else "",
                              roc_scores=d.scores if d else None)
            if dropped:
                log.info("group %s: RoC kept %d of %d", group.group_id, kept, len(group.members))
            self.state.make_ready(group, time.time(), dropped=dropped)
            GROUPS_READY.set(self.state.ready_count)
            self.ready_changed.set()
        self.capacity_changed.set()

    def _note_recovery(self) -> None:
        """Ends the recovery wait when every owed trajectory is back (or the wait ran out)."""
        before, owed = self.recovery_pending, len(self.state.owed)
        if owed and not self.state.recovering(time.time()):
            RECOVERY_MISSING.inc(owed)
            log.warning("recovery wait ran out: %d owed trajectories never came back", owed)
            self.state.owed.clear()
            owed = 0
        RECOVERY_OWED.set(owed)
        self.recovery_pending = bool(owed)
        if before and not owed:
            log.info("recovery complete: every trajectory the previous store held is back")
            self.ready_changed.set()

    def _finalize(self, traj: Trajectory, outcome: str, reason: str, msg: Any, *, mark: bool = True,
                  learner_version: int = -1) -> None:
        """Archive a final outcome; the message is acked (and the id marked final, for dedupe) at
        the next commit, after the archive rows are on disk."""
        self._archive(traj, outcome, reason, learner_version)
        self.state.finalize(traj.trajectory_id, msg, mark=mark)

    def _archive_final(self, f: Final) -> None:
        """Archive an outcome the state machine already finalized."""
        self._archive_row(f)

    def _archive_row(self, f: Final) -> None:
        if f.traj is not None:
            self._archive(f.traj, f.outcome, f.reason)
        else:
            self.w.archive.append(trajectory_id=f.trajectory_id, outcome=f.outcome, reason=f.reason)
            OUTCOMES.labels(outcome=f.outcome, reason=f.reason or "none").inc()

    async def _commit_final(self) -> None:
        """Flush the archive, then mark ids final and ack their messages (in that order: a crash in
        between re-delivers a message whose row exists; the reader keeps the last row)."""
        self.w.archive.flush()
        commit = self.state.take_commit()
        await self.w.repo.mark_final(commit.final_ids)
        for msg in commit.messages:
            await msg.ack()
        await self.w.repo.cleanup(commit.groups, commit.settled)

    async def heartbeat_loop(self) -> None:
        """Keeps held messages from being redelivered while this store lives (in-progress acks)."""
        while True:
            await asyncio.sleep(self.cfg.store.intake_ack_wait_s / 3)
            for msg in self.state.live_messages():
                await msg.in_progress()

    def _note_group_health(self, group: Group, rewards: list[float]) -> None:
        """Zero-variance and answer-diversity statistics of a completed group (survey §11.3)."""
        if len(rewards) >= 2:
            zero = max(rewards) == min(rewards)
            if zero:
                ZERO_VARIANCE.labels(source=group.source).inc()
            self.recent_zero_variance.append(zero)
            ZERO_VARIANCE_RATIO.set(sum(self.recent_zero_variance) / len(self.recent_zero_variance))
        if group.members:
            answers = {t.token_ids_T[t.loss_mask_T == 1].tobytes() for t in group.members}
            self.recent_distinct_ratio.append(len(answers) / len(group.members))
            DISTINCT_ANSWERS_RATIO.set(sum(self.recent_distinct_ratio) / len(self.recent_distinct_ratio))

    async def queue_loop(self, every_s: float = 2.0) -> None:
        """Exports JetStream backlog (pending, ack-pending, oldest message age) of every work queue and
        the age of the oldest ready group, every `every_s` seconds. JetStream has no subscription
        for consumer state, so this one loop polls; KEDA and the consumer-lag alert read it. It also
        ends a recovery wait that ran out while no message arrived. A poll NATS does not answer
        (its API timing out on a busy machine, a restart) is counted and tried again next round:
        these are gauges, and one such timeout once crashed the whole store."""
        while True:
            try:
                await self._poll_queues()
            except (nats.errors.Error, asyncio.TimeoutError) as exc:
                QUEUE_POLL_FAILURES.inc()
                log.warning("queue backlog poll failed (%r); next try in %.0fs", exc, every_s)
            ready = self.state.ready
            READY_AGE.set(time.time() - min(g.ready_at for g in ready) if ready else 0.0)
            for state, n in self.state.held_counts().items():
                HELD.labels(state=state).set(n)
            self._note_recovery()
            await asyncio.sleep(every_s)

    async def _poll_queues(self) -> None:
        for stream, durable in QUEUES:
            durable = self.durable if stream == busmod.STREAM_TRAJ_GRADED else durable
            try:
                p = await self.w.bus.pending(stream, durable)
                QUEUE_PENDING.labels(stream=stream).set(p.num_pending)
                QUEUE_ACK_PENDING.labels(stream=stream).set(p.num_ack_pending)
            except nats.js.errors.NotFoundError:
                pass  # the consumer's service has not started yet: its backlog stays 0
            QUEUE_AGE.labels(stream=stream).set(await self._oldest_age(stream))

    async def _oldest_age(self, stream: str) -> float:
        """Seconds since the first message still stored in `stream` was published (0 when empty)."""
        info = await self.w.bus.stream_info(stream)
        if not info.state.messages:
            return 0.0
        try:
            msg = await self.w.bus.js.get_msg(self.w.bus.layout.stream(stream), seq=info.state.first_seq)
        except nats.js.errors.NotFoundError:
            return 0.0  # acked (deleted) between the two calls: the queue just moved
        if msg.time is None:
            return 0.0
        return max(0.0, time.time() - msg.time.timestamp())

    async def flush_loop(self) -> None:
        """Commits final outcomes (archive flush, then acks) every second."""
        while True:
            await asyncio.sleep(1.0)
            await self._commit_final()

    # ------------------------------------------------------------------ archive helpers
    def _archive(self, traj: Trajectory, outcome: str, reason: str, learner_version: int = -1,
                 roc_scores: roc_mod.Scores | None = None) -> None:
        OUTCOMES.labels(outcome=outcome, reason=reason or "none").inc()
        pb = traj.pb
        self.w.archive.append(
            trajectory_id=pb.trajectory_id, task_id=pb.task_id, group_id=pb.group_id,
            task_source=pb.task_source, manifest_id=pb.manifest_id, outcome=outcome, reason=reason,
            reward=pb.reward, terminal_reason=trajectory_pb2.TerminalReason.Name(pb.terminal_reason)
            if pb.terminal_reason in trajectory_pb2.TerminalReason.values() else str(pb.terminal_reason),
            learner_version=learner_version, **_token_columns(traj),
            sequence_starts=list(pb.sequence_starts), step_rewards=list(pb.step_rewards), teacher=pb.teacher,
            reward_components=dict(pb.raw_reward_components), grader_revision=pb.grader_revision,
            verifier_output=pb.verifier_output,
            roc_tool_error_score=roc_scores.tool_error if roc_scores else None,
            roc_format_score=roc_scores.format if roc_scores else None,
        )

    def _quarantine_bytes(self, data: bytes, reason: str, detail: str) -> None:
        OUTCOMES.labels(outcome="quarantined", reason=reason).inc()
        log.warning("quarantined %d bytes: %s", len(data), detail)
        self.w.archive.append(outcome="quarantined", reason=reason, payload_sha256=hashlib.sha256(data).hexdigest())

    # ------------------------------------------------------------------ serving the learner
    async def next_batch(self, learner_version: int, max_trajectories: int, timeout_s: float,
                         max_groups: int = 0) -> list[Trajectory]:
        """Whole groups, oldest admission first, `max_groups` of them (0: learner.batch_groups) and
        up to `max_trajectories`; waits up to `timeout_s` for them (and, after a store restart,
        for the previous store's trajectories)."""
        self._note_version(learner_version)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        want = max_groups or self.cfg.learner.batch_groups
        while True:
            self.ready_changed.clear()
            due = await self.w.repo.due_groups(learner_version - self.cfg.effective_eta)
            was_held, gave_up = self.state.held_for_stragglers(), set(self.state.given_up)
            out = self.state.hand_out(want, max_trajectories, time.time(), due, learner_version)
            if self.state.held_for_stragglers() and not was_held:
                self.held_at = time.time()
                log.info("learner at v%d held for due groups not ready: %s", learner_version,
                         sorted(due - {g.group_id for g in self.state.ready}))
            elif was_held and not self.state.held_for_stragglers():
                log.info("learner at v%d released after %.1fs held", learner_version, time.time() - self.held_at)
            if self.state.given_up - gave_up:
                log.warning("learner at v%d gave up waiting (%.0fs) for due groups: %s", learner_version,
                            self.state.straggler_wait_s, sorted(self.state.given_up - gave_up))
            STRAGGLERS_GIVEN_UP.set(len(self.state.given_up))
            if out:
                break
            remaining = deadline - loop.time()
            if remaining <= 0:
                return []
            try:  # a recovery wait that runs out sets nothing: look again within a second
                async with asyncio.timeout(min(remaining, 1.0)):
                    await self.ready_changed.wait()
            except TimeoutError:
                pass
        self.w.archive.flush()  # the intake rows (tokens, versions) are on disk before anything trains
        await self.w.repo.not_pending(list(dict.fromkeys(t.group_id for t in out)))
        self._count_stale(out, learner_version)
        GROUPS_READY.set(self.state.ready_count)
        self.ready_changed.set()
        return out

    async def peek(self, learner_version: int, max_groups: int, timeout_s: float,
                   batch_ready_elsewhere: bool) -> tuple[bool, list[int]]:
        """(Whether this store holds the learner, the admission versions of its first `max_groups`
        ready groups), for a learner gathering a batch across store replicas. With `timeout_s` > 0
        it first waits, that long at most, for a change of the ready groups, unless `max_groups`
        are ready. `batch_ready_elsewhere` runs the straggler wait (`StoreState.held`)."""
        self._note_version(learner_version)
        due = await self.w.repo.due_groups(learner_version - self.cfg.effective_eta)
        if timeout_s > 0 and (self.state.ready_count < max_groups or self.state.held(time.time(), due, clock=False)):
            self.ready_changed.clear()
            try:
                async with asyncio.timeout(timeout_s):
                    await self.ready_changed.wait()
            except TimeoutError:
                pass
            due = await self.w.repo.due_groups(learner_version - self.cfg.effective_eta)
        gave_up = set(self.state.given_up)
        held = self.state.held(time.time(), due, clock=batch_ready_elsewhere)
        if self.state.given_up - gave_up:
            log.warning("learner at v%d gave up waiting (%.0fs) for due groups: %s", learner_version,
                        self.state.straggler_wait_s, sorted(self.state.given_up - gave_up))
        STRAGGLERS_GIVEN_UP.set(len(self.state.given_up))
        return held, self.state.ready_versions(max_groups)

    @staticmethod
    def _oldest_version(traj: Trajectory) -> int:
        """The oldest policy version among the trajectory's sampled tokens (-1: none sampled)."""
        v_T = traj.behavior_versions_T[traj.loss_mask_T == 1]
        return int(v_T.min()) if v_T.size else -1

    def _too_stale(self, traj: Trajectory, learner_version: int) -> bool:
        """Whether the learner, at `learner_version` or later, could only quarantine it as stale."""
        return self._stale_at(self._oldest_version(traj), learner_version)

    def _stale_at(self, oldest: int, learner_version: int) -> bool:
        """`_too_stale` of a trajectory whose oldest sampled version is `oldest` (-1: none)."""
        return oldest >= 0 and learner_version - oldest > self.cfg.effective_eta

    def _count_stale(self, trajs: list[Trajectory], learner_version: int) -> None:
        for t in trajs:
            if self._too_stale(t, learner_version):
                STALE_HANDED_OUT.inc()
                rec = self.state.records.get(t.trajectory_id)
                log.warning("handing out stale %s to the learner at v%d: sampled at v%d, admitted at v%d",
                            t.trajectory_id, learner_version, self._oldest_version(t),
                            rec.admitted_version if rec is not None else -1)

    async def report(self, req: services_pb2.ReportRequest) -> None:
        """The learner's verdict on a batch: final outcomes, committed before the reply.

        Idempotent: a learner replaying batches after its own restart reports ids again (skipped),
        and a store restarted since NextBatch may hold the ids again from redelivery (dropped from
        its groups and acked)."""
        outcomes = [(tid, "trained", "") for tid in req.trained_ids]
        outcomes += [(tid, "quarantined", r) for tid, r in zip(req.quarantined_ids, req.quarantine_reasons, strict=True)]
        finals = await self.w.repo.finals([t for t, _, _ in outcomes])
        groups: set[str] = set()
        for (tid, outcome, reason), done in zip(outcomes, finals, strict=True):
            msg, gid = self.state.report(tid)
            if gid is not None:
                groups.add(gid)
            if done:
                self.state.finalize("", msg, mark=False)
                continue
            self.w.archive.append(trajectory_id=tid, outcome=outcome, reason=reason,
                                  learner_version=req.learner_version)
            OUTCOMES.labels(outcome=outcome, reason=reason or "none").inc()
            self.state.finalize(tid, msg)
        self.state.done_reporting(groups)
        await self._commit_final()
        self._note_version(req.learner_version)
        self._note_recovery()

    async def recycle_handed_out(self, learner_version: int) -> None:
        """A new learner process at `learner_version`: what the previous one took at an older
        version and never reported was trained (its checkpoint is past that step): recorded as
        trained. The rest (it died before it saved the batch) goes back to the queue, whole
        groups in admission order."""
        for taken, ids in sorted(self.state.trained_unreported(learner_version).items()):
            log.warning("a previous learner process trained %d trajectories at v%d without reporting them: "
                        "recorded as trained", len(ids), taken)
            await self.report(services_pb2.ReportRequest(learner_version=taken, trained_ids=ids))
        groups = self.state.recycle_handed_out(time.time())
        if groups:
            await self.w.repo.pending_again(groups)
            log.warning("recycled %d unreported groups of a previous learner process", len(groups))
            GROUPS_READY.set(self.state.ready_count)
            self.ready_changed.set()

    def _note_version(self, version: int) -> None:
        LEARNER_VERSION.set(version)
        self.capacity_changed.set()


class _StoreServicer(services_pb2_grpc.TrajectoryStoreServicer):
    def __init__(self, store: TrajectoryStore) -> None:
        self.store = store

    async def NextBatch(self, request: Any, context: Any) -> bytes | services_pb2.NextBatchResponse:  # noqa: N802
        """A `NextBatchResponse`, encoded (`batch_response_bytes`; `add_store_servicer` sends it as is)."""
        if request.learner_restarted:
            await self.store.recycle_handed_out(request.learner_version)
        if request.peek:
            held, versions = await self.store.peek(request.learner_version, request.max_groups or 1 << 30,
                                                   request.timeout_seconds, request.batch_ready_elsewhere)
            return services_pb2.NextBatchResponse(held=held, ready_versions=versions)
        trajs = await self.store.next_batch(
            request.learner_version, request.max_trajectories or 1 << 30, request.timeout_seconds or 5.0,
            request.max_groups)
        return batch_response_bytes(trajs)

    async def Report(self, request: Any, context: Any) -> services_pb2.ReportResponse:  # noqa: N802
        await self.store.report(request)
        return services_pb2.ReportResponse()


def _token_columns(traj: Trajectory) -> dict[str, Any]:
    """A trajectory's per-token archive columns: its token block as it came (one bytes value, no
    Python object per token), or for a record written before the block its arrays as lists; with
    the token counts where the arrays read (not for a quarantined record's unreadable block)."""
    block = traj.token_block
    try:
        mask_T = traj.loss_mask_T
    except ContractError:
        return {"token_block": block}
    counts = {"num_tokens": len(traj), "num_action_tokens": int(mask_T.sum())}
    if block:
        return {"token_block": block, **counts}
    teacher_T = traj.teacher_logprobs_T
    return {"token_ids": traj.token_ids_T, "loss_mask": np.minimum(mask_T, 255),
            "behavior_versions": traj.behavior_versions_T, "behavior_logprobs": traj.behavior_logprobs_T,
            "teacher_logprobs": teacher_T if teacher_T is not None else [], **counts}


_BATCH_FIELD_KEY = bytes([services_pb2.NextBatchResponse.DESCRIPTOR.fields_by_name["trajectories"].number << 3 | 2])


def batch_response_bytes(trajs: list[Trajectory]) -> bytes:
    """The wire bytes of ``NextBatchResponse(trajectories=[t.pb for t in trajs])``, each trajectory
    serialized once into the repeated field. Building the response message copies every trajectory
    (~0.25 ms per 4k tokens, the copy then serialized again by gRPC); a batch of 32 took ~13 ms of
    the store's event loop, this ~1 ms. The learner parses the same bytes (`NextBatchResponse`)."""
    parts: list[bytes] = []
    for t in trajs:
        data = t.pb.SerializeToString()
        parts += (_BATCH_FIELD_KEY, varint(len(data)), data)
    return b"".join(parts)


def _serialize_response(response: Any) -> bytes:
    """gRPC's serializer of the store's replies: bytes already encoded (`batch_response_bytes`) as they are."""
    return response if isinstance(response, bytes) else bytes(response.SerializeToString())


def add_store_servicer(servicer: _StoreServicer, server: Any) -> None:
    """`services_pb2_grpc.add_TrajectoryStoreServicer_to_server`, with replies serialized by
    `_serialize_response` (NextBatch answers with encoded bytes). Same service, methods and wire."""
    handlers = {
        "NextBatch": grpc.unary_unary_rpc_method_handler(
            servicer.NextBatch, request_deserializer=services_pb2.NextBatchRequest.FromString,
            response_serializer=_serialize_response),
        "Report": grpc.unary_unary_rpc_method_handler(
            servicer.Report, request_deserializer=services_pb2.ReportRequest.FromString,
            response_serializer=_serialize_response),
    }
    name = services_pb2.DESCRIPTOR.services_by_name["TrajectoryStore"].full_name
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(name, handlers),))
    server.add_registered_method_handlers(name, handlers)
