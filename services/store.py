"""Trajectory store: the data buffer of the mesh (DESIGN.md §1.1, §3).

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

Redis holds the gate counters, the task records (the grader reads references from them), the
set of trajectory ids already seen (dedupe), and the sampler cursor. Every record the store sees
goes to the archive; every admitted trajectory ends as exactly one of trained, filtered,
quarantined or failed_infra.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
import nats.js.errors
import numpy as np
from prometheus_client import Counter, Gauge

from trajmesh import bus as busmod
from trajmesh import security
from trajmesh.archive import ArchiveWriter
from trajmesh.contract import Trajectory
from trajmesh.gate import AsyncStalenessGate
from trajmesh.intake import OUTCOME_VALID, judge_parsed, parse
from trajmesh.keys import RedisKeys
from trajmesh.service import Service, supervise
from trajmesh.tasks import TaskSampler
from trajmesh.tokenizer import load_tokenizer
from trajmesh.v1 import services_pb2, services_pb2_grpc, trajectory_pb2

log = logging.getLogger("trajmesh.store")

TASKS_ADMITTED = Counter("trajmesh_store_tasks_admitted_total", "Tasks (prompt x G) admitted by the gate", ["source"])
TRAJ_ADMITTED = Counter("trajmesh_store_trajectories_admitted_total", "Trajectories admitted (tasks x G)")
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
QUEUES = ((busmod.STREAM_TASKS, "rollout"), (busmod.STREAM_TRAJ_RAW, "grader"), (busmod.STREAM_TRAJ_GRADED, "store"))
"""(stream, durable consumer) pairs whose backlog the store exports."""
for _outcome, _reason in (("filtered", "zero_variance"), ("filtered", "group_too_small"),
                          ("quarantined", "stale"), ("failed_infra", "infra_failure")):
    OUTCOMES.labels(outcome=_outcome, reason=_reason)  # exported at 0 so rates exist before the first one
for _stream, _ in QUEUES:
    for _g in (QUEUE_PENDING, QUEUE_ACK_PENDING, QUEUE_AGE):
        _g.labels(stream=_stream)


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


@dataclass
class _Group:
    group_id: str
    expected: int
    received: int = 0
    members: list[Trajectory] = field(default_factory=list)
    source: str = ""
    ready_at: float = 0.0
    """time.time() when the group became ready for the learner."""


class TrajectoryStore(Service):
    name = "store"

    async def setup(self) -> None:
        cfg = self.cfg
        ns = cfg.infra.namespace
        self.keys = RedisKeys(ns)
        assert cfg.infra.nats_url and cfg.infra.redis_url, "store needs infra.nats_url and infra.redis_url"
        self.redis = security.redis_client(cfg)
        self.gate = AsyncStalenessGate(
            self.redis,
            key_prefix=self.keys.gate_prefix,
            eta=cfg.effective_eta,
            batch_size=cfg.batch_trajectories,
            max_concurrent=cfg.gate.max_concurrent,
        )
        self.bus = await security.connect_bus(cfg, "store", name=self.worker_id)
        self.intake = await self.bus.pull_subscribe(
            busmod.STREAM_TRAJ_GRADED, "store", ack_wait_s=cfg.store.intake_ack_wait_s, max_ack_pending=100_000)
        # Trajectory id → its unacked TRAJ_GRADED message: held until the trajectory's outcome is
        # final and archived, so a store that dies loses nothing (JetStream redelivers).
        self.held: dict[str, Any] = {}
        self.handed_out: dict[str, Any] = {}
        self.handed_group: dict[str, str] = {}
        self.handed_traj: dict[str, Trajectory] = {}
        self.pending_final: list[tuple[str, Any]] = []
        assert cfg.model.path, "store needs model.path (for the tokenizer's vocabulary)"
        self.vocab_size = load_tokenizer(cfg.model.path).vocab_size
        self.sampler = TaskSampler(cfg.tasks, seed=cfg.seed)
        self.archive = ArchiveWriter(Path(cfg.run_dir) / "archive", writer=f"store{self.replica}")
        self.manifest_id = (await self.redis.get(self.keys.manifest_id) or b"").decode()
        self.groups: dict[str, _Group] = {}
        self.pending_group_cleanup: list[str] = []
        self.ready_groups: deque[_Group] = deque()
        self.ready_changed = asyncio.Event()
        self.capacity_changed = asyncio.Event()
        GATE_ETA.set(cfg.effective_eta)
        self.recent_zero_variance: deque[bool] = deque(maxlen=100)
        self.recent_distinct_ratio: deque[float] = deque(maxlen=100)
        for src in cfg.tasks.sources:  # exported at 0 so the data-mixture panels have every source
            TASKS_ADMITTED.labels(source=src.name)
            for outcome, reason in (("accepted", "none"), ("filtered", "zero_variance"),
                                    ("filtered", "group_too_small")):
                TASKS_DONE.labels(source=src.name, outcome=outcome, reason=reason)
            for c in (ZERO_VARIANCE, TRUNCATED, RETRIED):
                c.labels(source=src.name)
        self.grpc_server = grpc.aio.server()
        services_pb2_grpc.add_TrajectoryStoreServicer_to_server(_StoreServicer(self), self.grpc_server)
        port = cfg.infra.store_address.rsplit(":", 1)[1]
        security.add_grpc_port(self.grpc_server, f"0.0.0.0:{port}", cfg.infra.security.grpc_tls)
        await self.grpc_server.start()

    async def run(self) -> None:
        await self._republish_unpublished()
        await supervise(self.admission_loop(), self.intake_loop(), self.flush_loop(), self.queue_loop(),
                        self.heartbeat_loop())

    async def stop(self) -> None:
        if hasattr(self, "grpc_server"):
            await self.grpc_server.stop(grace=1.0)
        if hasattr(self, "archive"):
            # At the end of a finished run, groups still buffered end as filtered/unused. Otherwise
            # (a crash, a restart, Ctrl-C before --resume) their messages stay unacked and come
            # back to the next store.
            if await self._run_finished():
                for group in self.ready_groups:
                    for t in group.members:
                        self._finalize(t, "filtered", "unused_at_end_of_run", self.held.pop(t.trajectory_id, None))
                self.ready_groups.clear()
            await self._commit_final()
            self.archive.close()
        if hasattr(self, "bus"):
            await self.bus.close()
        if hasattr(self, "redis"):
            await self.redis.aclose()

    # ------------------------------------------------------------------ admission
    async def admission_loop(self) -> None:
        """Publishes tasks to TASKS while the gate has capacity for a whole group.

        Waits on `capacity_changed`, set when a group finishes (capacity freed) or the learner
        reports a new version (B more slots). A short timeout re-reads the gate, because another
        store replica or a learner recovery may change the counters behind our back.
        """
        g = self.cfg.tasks.group_size
        while True:
            if await self._run_finished():  # the learner is done: admit nothing more, let it drain
                await asyncio.sleep(1.0)
                continue
            counters = await self.gate.counters()
            GATE_CAPACITY.set(counters.capacity)
            GATE_RUNNING.set(counters.running)
            if await self.gate.try_admit(g):
                await self._publish_next_task(counters.version)
                continue
            self.capacity_changed.clear()
            try:
                await asyncio.wait_for(self.capacity_changed.wait(), timeout=1.0)
            except TimeoutError:
                pass

    async def _publish_next_task(self, version: int) -> None:
        cursor = int(await self.redis.incr(self.keys.sampler_cursor)) - 1
        task = self.sampler.task_at(cursor)
        pb = trajectory_pb2.Task(
            task_id=f"{task.task_id}-c{cursor}",
            group_id=f"g{cursor}-{task.task_id}",
            source=task.source,
            revision=task.revision,
            seed=self.cfg.seed * 1_000_003 + cursor,
            group_size=self.cfg.tasks.group_size,
            environment=task.environment,
            prompt=task.prompt,
            answer=task.answer,
            metadata_json=json.dumps(task.metadata, default=str),
            admitted_at_version=version,
            manifest_id=self.manifest_id,
        )
        s = self.cfg.tasks.sampling
        pb.sampling.CopyFrom(
            trajectory_pb2.SamplingParams(
                temperature=s.temperature, top_p=s.top_p, top_k=s.top_k,
                max_new_tokens=s.max_new_tokens, max_turns=s.max_turns,
            )
        )
        record = {"group_id": pb.group_id, "group_size": pb.group_size, "source": pb.source,
                  "answer": pb.answer, "prompt": pb.prompt, "metadata": task.metadata}
        data = pb.SerializeToString()
        # Record, count and mark unpublished in one transaction; a store that dies before the
        # publish republishes on start (same msg id: JetStream stores it once).
        pipe = self.redis.pipeline(transaction=True)
        pipe.hset(self.keys.tasks, pb.task_id, json.dumps(record, default=str))
        pipe.hset(self.keys.unpublished_tasks, pb.task_id, data)
        pipe.incrby(self.keys.admitted_trajectories, pb.group_size)
        await pipe.execute()
        await self.bus.publish(busmod.SUBJECT_TASKS, data, msg_id=pb.task_id)
        await self.redis.hdel(self.keys.unpublished_tasks, pb.task_id)
        TASKS_ADMITTED.labels(source=pb.source).inc()
        TRAJ_ADMITTED.inc(pb.group_size)

    async def _republish_unpublished(self) -> None:
        for task_id, data in (await self.redis.hgetall(self.keys.unpublished_tasks)).items():
            await self.bus.publish(busmod.SUBJECT_TASKS, data, msg_id=task_id.decode())
            await self.redis.hdel(self.keys.unpublished_tasks, task_id)
            log.info("republished task %s admitted by an earlier store", task_id.decode())

    async def _run_finished(self) -> bool:
        return bool(await self.redis.exists(self.keys.run_finished))

    # ------------------------------------------------------------------ intake
    async def intake_loop(self) -> None:
        """Consumes TRAJ_GRADED. A message is acked only once its trajectory's outcome is final and
        archived (quarantined, failed_infra, filtered, trained); group members wait unacked.

        Waits for messages (pull fetch with timeout); backpressure: stops fetching while the
        ready buffer is full (the gate keeps that rare).
        """
        while True:
            if len(self.ready_groups) >= self.cfg.store.max_buffered_groups:
                self.ready_changed.clear()
                await self.ready_changed.wait()
                continue
            msgs = await self.intake.fetch(batch=32, timeout=1.0)
            items = []
            for msg in msgs:
                data = await self.intake.resolve(msg)
                peek = parse(data)  # once: the task lookup needs the task id, the verdict the rest
                items.append(_Incoming(data, msg, peek, peek.trajectory_id if peek is not None else ""))
            # Runs without a repeated trajectory id are judged together (two Redis round trips per
            # run instead of two per message); a repeat starts a new run, so every message sees the
            # effects of the ones before it exactly as if they were taken one by one.
            for run in runs_without_repeats(items):
                await self._intake_run(run)

    async def _intake_run(self, items: list[_Incoming]) -> None:
        todo = []
        for item in items:
            holder = next((h for h in (self.held, self.handed_out) if item.tid and item.tid in h), None)
            if holder is not None:  # redelivered while we still hold it: keep the newest handle
                holder[item.tid] = item.msg
            else:
                todo.append(item)
        if not todo:
            return
        # Round trip 1: the learner version, and each message's task record and dedupe mark.
        pipe = self.redis.pipeline(transaction=False)
        pipe.get(self.gate.version_key)
        looked_up = [it for it in todo if it.peek is not None and it.peek.task_id]
        for it in looked_up:
            assert it.peek is not None
            pipe.hget(self.keys.tasks, it.peek.task_id)
            pipe.sismember(self.keys.final_trajectories, it.tid)
        version_raw, *found = await pipe.execute()
        learner_version = int(version_raw or 0)
        records = {id(it): (found[2 * k], found[2 * k + 1]) for k, it in enumerate(looked_up)}
        members: list[tuple[_Incoming, Trajectory, str, str, dict[str, Any]]] = []
        for it in todo:
            raw, already_final = records.get(id(it), (None, False))
            task = json.loads(raw) if raw is not None else None
            if it.peek is not None and it.tid and task is not None and already_final:
                RETRIED.labels(source=it.peek.pb.task_source).inc()
                self._finalize(it.peek, "duplicate", "duplicate_trajectory_id", it.msg, mark=False)
                continue
            verdict = judge_parsed(it.peek, task, vocab_size=self.vocab_size, learner_version=learner_version)
            traj = verdict.trajectory
            if traj is None:
                self._quarantine_bytes(it.data, verdict.reason, "not a trajectory")
                self.pending_final.append(("", it.msg))
                continue
            if not verdict.member:  # unknown task, or not one of its G samples: must not touch a group
                self._finalize(traj, verdict.outcome, verdict.reason, it.msg, mark=False)
                continue
            assert task is not None
            if traj.truncated:
                TRUNCATED.labels(source=traj.pb.task_source).inc()
            members.append((it, traj, verdict.outcome, verdict.reason, task))
        if not members:
            return
        # Round trip 2, one transaction: each member's group membership, then both counts as they
        # stand after it (MULTI runs the commands in order, so counts are per message).
        pipe = self.redis.pipeline(transaction=True)
        for it, traj, outcome, _, _ in members:
            pipe.sadd(self.keys.group_received(traj.group_id), it.tid)
            if outcome == OUTCOME_VALID:
                pipe.sadd(self.keys.group_valid(traj.group_id), it.tid)
            pipe.scard(self.keys.group_received(traj.group_id))
            pipe.scard(self.keys.group_valid(traj.group_id))
        results = await pipe.execute()
        k = 0
        for it, traj, outcome, reason, task in members:
            k += 2 if outcome == OUTCOME_VALID else 1
            received, valid = results[k], results[k + 1]
            k += 2
            # Only after the membership is recorded may a message be finalized (acked at commit).
            if outcome == OUTCOME_VALID:
                self.held[it.tid] = it.msg
            else:
                self._finalize(traj, outcome, reason, it.msg)
            gid = traj.group_id
            group = self.groups.get(gid)
            if group is None:
                group = self.groups[gid] = _Group(gid, int(task["group_size"]), source=str(task.get("source", "")))
            if it.tid in self.held and all(m.trajectory_id != it.tid for m in group.members):
                group.members.append(traj)
            # Complete once all G came back and every valid member is here (after a store restart the
            # valid members arrive again by redelivery; the quarantined ones were final already).
            if received >= group.expected and len(group.members) >= valid:
                del self.groups[gid]
                await self._complete(group)

    async def _complete(self, group: _Group) -> None:
        rewards = [t.reward for t in group.members]
        reason = ""
        if len(group.members) < 2:
            reason = "group_too_small"
        elif self.cfg.store.drop_zero_variance_groups and max(rewards) == min(rewards):
            reason = "zero_variance"
        n_valid = len(group.members)
        first_time = bool(await self.redis.sadd(self.keys.groups_done, group.group_id))
        if first_time:  # a group rebuilt after a store restart was counted already
            self._note_group_health(group, rewards)
            TASKS_DONE.labels(source=group.source, outcome="filtered" if reason else "accepted",
                              reason=reason or "none").inc()
        if reason:
            GROUPS_FILTERED.labels(reason=reason).inc()
            log.info("group %s filtered: %s (rewards %s)", group.group_id, reason, rewards)
            for t in group.members:
                self._finalize(t, "filtered", reason, self.held.pop(t.trajectory_id, None))
            self.pending_group_cleanup.append(group.group_id)
            if first_time:
                await self.gate.finish(group.expected, accepted=False)
        else:
            for t in group.members:
                self._archive(t, "accepted", "")
            if first_time:
                await self.gate.finish(n_valid, accepted=True)
                if group.expected > n_valid:
                    await self.gate.finish(group.expected - n_valid, accepted=False)
            group.ready_at = time.time()
            self.ready_groups.append(group)
            GROUPS_READY.set(len(self.ready_groups))
            self.ready_changed.set()
        self.capacity_changed.set()

    def _finalize(self, traj: Trajectory, outcome: str, reason: str, msg: Any, *, mark: bool = True,
                  learner_version: int = -1) -> None:
        """Archive a final outcome; the message is acked (and the id marked final, for dedupe) at
        the next commit, after the archive rows are on disk."""
        self._archive(traj, outcome, reason, learner_version)
        self.pending_final.append((traj.trajectory_id if mark else "", msg))

    async def _commit_final(self) -> None:
        """Flush the archive, then mark ids final and ack their messages (in that order: a crash in
        between re-delivers a message whose row exists; the reader keeps the last row)."""
        self.archive.flush()
        pending, self.pending_final = self.pending_final, []
        ids = [tid for tid, _ in pending if tid]
        if ids:
            await self.redis.sadd(self.keys.final_trajectories, *ids)
        for _, msg in pending:
            if msg is not None:
                await msg.ack()
        groups, self.pending_group_cleanup = self.pending_group_cleanup, []
        for gid in groups:
            await self.redis.delete(self.keys.group_received(gid), self.keys.group_valid(gid))

    async def heartbeat_loop(self) -> None:
        """Keeps held messages from being redelivered while this store lives (in-progress acks)."""
        while True:
            await asyncio.sleep(self.cfg.store.intake_ack_wait_s / 3)
            for msg in list(self.held.values()) + list(self.handed_out.values()):
                if msg is not None:
                    await msg.in_progress()

    def _note_group_health(self, group: _Group, rewards: list[float]) -> None:
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
        for consumer state, so this one loop polls; KEDA and the consumer-lag alert read it."""
        while True:
            for stream, durable in QUEUES:
                try:
                    p = await self.bus.pending(stream, durable)
                    QUEUE_PENDING.labels(stream=stream).set(p.num_pending)
                    QUEUE_ACK_PENDING.labels(stream=stream).set(p.num_ack_pending)
                except nats.js.errors.NotFoundError:
                    pass  # the consumer's service has not started yet: its backlog stays 0
                QUEUE_AGE.labels(stream=stream).set(await self._oldest_age(stream))
            READY_AGE.set(time.time() - self.ready_groups[0].ready_at if self.ready_groups else 0.0)
            await asyncio.sleep(every_s)

    async def _oldest_age(self, stream: str) -> float:
        """Seconds since the first message still stored in `stream` was published (0 when empty)."""
        info = await self.bus.stream_info(stream)
        if not info.state.messages:
            return 0.0
        try:
            msg = await self.bus.js.get_msg(self.bus.layout.stream(stream), seq=info.state.first_seq)
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
    def _archive(self, traj: Trajectory, outcome: str, reason: str, learner_version: int = -1) -> None:
        OUTCOMES.labels(outcome=outcome, reason=reason or "none").inc()
        pb = traj.pb
        mask_T = traj.loss_mask_T
        self.archive.append(
            trajectory_id=pb.trajectory_id, task_id=pb.task_id, group_id=pb.group_id,
            task_source=pb.task_source, manifest_id=pb.manifest_id, outcome=outcome, reason=reason,
            reward=pb.reward, terminal_reason=trajectory_pb2.TerminalReason.Name(pb.terminal_reason)
            if pb.terminal_reason in trajectory_pb2.TerminalReason.values() else str(pb.terminal_reason),
            learner_version=learner_version, num_tokens=len(pb.token_ids), num_action_tokens=int(mask_T.sum()),
            token_ids=traj.token_ids_T, loss_mask=np.minimum(mask_T, 255),
            behavior_versions=traj.behavior_versions_T, behavior_logprobs=traj.behavior_logprobs_T,
        )

    def _quarantine_bytes(self, data: bytes, reason: str, detail: str) -> None:
        OUTCOMES.labels(outcome="quarantined", reason=reason).inc()
        log.warning("quarantined %d bytes: %s", len(data), detail)
        self.archive.append(outcome="quarantined", reason=reason, payload_sha256=hashlib.sha256(data).hexdigest())

    # ------------------------------------------------------------------ serving the learner
    async def next_batch(self, learner_version: int, max_trajectories: int, timeout_s: float) -> list[Trajectory]:
        """Whole groups, oldest first, up to `max_trajectories`; waits up to `timeout_s` for a full batch."""
        await self._note_version(learner_version)
        want_groups = self.cfg.learner.batch_groups
        deadline = asyncio.get_running_loop().time() + timeout_s
        while len(self.ready_groups) < want_groups:
            remaining = deadline - asyncio.get_running_loop().time()
            if remaining <= 0:
                return []
            self.ready_changed.clear()
            try:
                await asyncio.wait_for(self.ready_changed.wait(), timeout=remaining)
            except TimeoutError:
                return []
        out: list[Trajectory] = []
        while self.ready_groups and len(out) + len(self.ready_groups[0].members) <= max_trajectories and want_groups > 0:
            out.extend(self.ready_groups.popleft().members)
            want_groups -= 1
        self.archive.flush()  # the intake rows (tokens, versions) are on disk before anything trains
        for t in out:
            self.handed_out[t.trajectory_id] = self.held.pop(t.trajectory_id, None)
            self.handed_group[t.trajectory_id] = t.group_id
            self.handed_traj[t.trajectory_id] = t
        GROUPS_READY.set(len(self.ready_groups))
        self.ready_changed.set()
        return out

    async def report(self, req: services_pb2.ReportRequest) -> None:
        """The learner's verdict on a batch: final outcomes, committed before the reply.

        Idempotent: a learner replaying batches after its own restart reports ids again (skipped),
        and a store restarted since NextBatch may hold the ids again from redelivery (dropped from
        its groups and acked)."""
        outcomes = [(tid, "trained", "") for tid in req.trained_ids]
        outcomes += [(tid, "quarantined", r) for tid, r in zip(req.quarantined_ids, req.quarantine_reasons, strict=True)]
        finals = await self.redis.smismember(self.keys.final_trajectories, [t for t, _, _ in outcomes]) \
            if outcomes else []
        groups: set[str] = set()
        for (tid, outcome, reason), done in zip(outcomes, finals, strict=True):
            msg = self.handed_out.pop(tid, None) or self.held.pop(tid, None)
            self._drop_from_buffers(tid)
            if done:
                if msg is not None:
                    self.pending_final.append(("", msg))
                continue
            self.archive.append(trajectory_id=tid, outcome=outcome, reason=reason,
                                learner_version=req.learner_version)
            OUTCOMES.labels(outcome=outcome, reason=reason or "none").inc()
            self.pending_final.append((tid, msg))
        for tid, _, _ in outcomes:
            self.handed_traj.pop(tid, None)
            gid = self.handed_group.pop(tid, None)
            if gid is not None:
                groups.add(gid)
        self.pending_group_cleanup.extend(groups)
        await self._commit_final()
        await self._note_version(req.learner_version)

    def recycle_handed_out(self) -> None:
        """A new learner process: what the previous one took and never reported (it died before it
        saved the batch) goes back to the front of the queue, whole groups in order."""
        if not self.handed_out:
            return
        by_group: dict[str, list[Trajectory]] = {}
        for traj in self.handed_traj.values():
            by_group.setdefault(traj.group_id, []).append(traj)
        for gid, members in reversed(list(by_group.items())):
            group = _Group(gid, len(members), received=len(members), members=members, ready_at=time.time())
            self.ready_groups.appendleft(group)
            for t in members:
                self.held[t.trajectory_id] = self.handed_out.pop(t.trajectory_id)
                self.handed_group.pop(t.trajectory_id, None)
        self.handed_traj.clear()
        log.warning("recycled %d unreported groups of a previous learner process", len(by_group))
        GROUPS_READY.set(len(self.ready_groups))
        self.ready_changed.set()

    def _drop_from_buffers(self, tid: str) -> None:
        for group in list(self.ready_groups) + list(self.groups.values()):
            group.members = [t for t in group.members if t.trajectory_id != tid]
        self.ready_groups = deque(g for g in self.ready_groups if g.members)

    async def _note_version(self, version: int) -> None:
        LEARNER_VERSION.set(version)
        self.capacity_changed.set()


class _StoreServicer(services_pb2_grpc.TrajectoryStoreServicer):
    def __init__(self, store: TrajectoryStore) -> None:
        self.store = store

    async def NextBatch(self, request: Any, context: Any) -> services_pb2.NextBatchResponse:  # noqa: N802
        if request.learner_restarted:
            self.store.recycle_handed_out()
        trajs = await self.store.next_batch(
            request.learner_version, request.max_trajectories or 1 << 30, request.timeout_seconds or 5.0
        )
        return services_pb2.NextBatchResponse(trajectories=[t.pb for t in trajs])

    async def Report(self, request: Any, context: Any) -> services_pb2.ReportResponse:  # noqa: N802
        await self.store.report(request)
        return services_pb2.ReportResponse()
