"""Grader service: TRAJ_RAW → verify → TRAJ_GRADED (docs/DESIGN.md §1.4).

::

    TRAJ_RAW ──▶ grade_loop ── decode sampled tokens ── task record (Redis) ── grader ──▶ TRAJ_GRADED
                    │ undecodable bytes / unknown task: forwarded ungraded; the store quarantines them

A scorer that raises on the model's answer scores it 0 with a ``parse_error`` component; one that
raises on the task's gold answer too is broken: INFRA_FAILURE (graders/base.py `grade_sample`).

Each message is published to TRAJ_GRADED (msg_id = trajectory id, so a redelivery is stored
once) before it is acked on TRAJ_RAW: a crash between the two only causes a deduplicated resend.
"""

from __future__ import annotations

import json
import logging
import time
from collections import OrderedDict
from typing import Any

from prometheus_client import Counter, Histogram
from redis.asyncio import Redis

from trajmesh import bus as busmod
from trajmesh import plugins, sandbox, security, tasks
from trajmesh.contract import ContractError, Trajectory
from trajmesh.graders import PARSE_ERROR, Grader, Sample, grade_sample, grader_kind, make_grader
from trajmesh.service import Service
from trajmesh.services.store.record import RunRecord
from trajmesh.tokenizer import load_tokenizer
from trajmesh.v1 import trajectory_pb2

log = logging.getLogger("trajmesh.grader")

GRADED = Counter("trajmesh_grader_trajectories_total", "Trajectories handled by the grader", ["result"])
VERIFY_SECONDS = Histogram("trajmesh_grader_verify_seconds", "Verifier latency per trajectory")
RAW_COMPONENT = Counter("trajmesh_grader_raw_reward_component_total",
                        "Sum of each raw reward component by grader", ["grader", "component"])
VERIFIER_SECONDS = Histogram("trajmesh_grader_verifier_seconds", "Verifier latency by grader", ["grader"])
VERIFIER_ERRORS = Counter("trajmesh_grader_verifier_errors_total", "Verifier crashes (INFRA_FAILURE)",
                          ["grader", "error"])
AUDITS = Counter("trajmesh_grader_metamorphic_audits_total", "Metamorphic audits (never reward)",
                 ["audit", "result"])
TERMINAL = Counter("trajmesh_grader_terminal_reasons_total", "Trajectories graded by terminal reason", ["reason"])


def label_series() -> dict[str, list[tuple[str, ...]]]:
    """The label values of every per-grader series, from the plug-in registry: each grader's
    verifier errors and its raw reward components (`components`)."""
    graders = plugins.graders()
    return {"verifier_errors": [(kind, "exception") for kind in graders],
            "raw_component": [(kind, comp) for kind, cls in graders.items()
                              for comp in (*getattr(cls, "components", ()), PARSE_ERROR)]}


def init_series() -> None:
    """Initial zeros for every known series (at import, and again at service start for sources
    registered since)."""
    for values in label_series()["verifier_errors"]:
        VERIFIER_ERRORS.labels(*values)
    for values in label_series()["raw_component"]:
        RAW_COMPONENT.labels(*values)


init_series()
for _audit in ("math_rename_invariant", "search_rename_invariant"):
    for _result in ("agree", "disagree"):
        AUDITS.labels(_audit, _result)
for _reason in trajectory_pb2.TerminalReason.keys():
    TERMINAL.labels(_reason)


def sandboxed_graders() -> frozenset[str]:
    """Grader kinds that run model-written code in trajmesh.sandbox (`uses_sandbox` on the class,
    from the plug-in registry; graders/code.py)."""
    return frozenset(kind for kind, cls in plugins.graders().items() if getattr(cls, "uses_sandbox", False))


def sandboxed_sources(cfg: Any) -> list[str]:
    """Names of the configured task sources whose tasks a sandboxed grader grades. A task's grader is
    its metadata (`grader_kind`), so one task of each source is drawn to read it (milliseconds)."""
    out = []
    sandboxed = sandboxed_graders()
    for src in cfg.tasks.sources:
        train, heldout = tasks.load_split(src, 1, 1)
        if any(grader_kind({"metadata": t.metadata}) in sandboxed for t in train + heldout):
            out.append(src.name)
    return out


class GraderService(Service):
    name = "grader"

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.redis: Redis | None = None
        self.record: RunRecord | None = None
        """The store's record over `redis`: the task records the grader reads references from."""
        self.bus: busmod.Bus | None = None
        self.consumer: busmod.Consumer | None = None
        self.tokenizer: Any = None
        """The policy's tokenizer (decodes responses for the verifiers); None until setup()."""
        self.graders: dict[str, Grader] = {}
        self.task_cache: OrderedDict[str, dict[str, Any]] = OrderedDict()

    async def setup(self) -> None:
        cfg = self.cfg
        assert cfg.infra.nats_url and cfg.infra.redis_url and cfg.model.path
        init_series()
        sandboxed = sandboxed_sources(cfg)
        if sandboxed:  # refuse to start (SandboxUnavailable) rather than grade model code under weaker limits
            log.info("%s (for %s)", sandbox.preflight(cfg.sandbox.allow_without_cgroup), ", ".join(sandboxed))
        self.redis = security.redis_client(cfg)
        self.record = RunRecord(self.redis, cfg.infra.namespace)
        self.bus = await security.connect_bus(cfg, "grader", name=self.worker_id)
        self.consumer = await self.bus.pull_subscribe(busmod.STREAM_TRAJ_RAW, "grader", ack_wait_s=busmod.GRADER_ACK_WAIT_S)
        self.tokenizer = load_tokenizer(cfg.model.path)

    async def run(self) -> None:
        await self.grade_loop()

    async def stop(self) -> None:
        if self.bus is not None:
            await self.bus.close()
        if self.redis is not None:
            await self.redis.aclose()

    async def grade_loop(self) -> None:
        """Consumes TRAJ_RAW (pull, shared durable `grader`); waits for messages; never drops one.
        Publishes each on its store partition's TRAJ_GRADED subject (what is not a trajectory: partition 0's)."""
        bus, consumer = self.bus, self.consumer
        assert bus is not None and consumer is not None, "grade_loop() before setup()"
        partitions = self.cfg.store.replicas  # each graded trajectory goes to its group's store
        while True:
            for msg in await consumer.fetch(batch=16, timeout=1.0):
                data = await consumer.resolve(msg)
                out, msg_id, group_id = await self._grade(data)
                await bus.publish(busmod.graded_subject(busmod.partition_of(group_id, partitions), partitions),
                                  out, msg_id=msg_id,
                                  retry_s=busmod.PUBLISH_RETRY_S if msg_id else 0.0)
                await msg.ack()

    async def _grade(self, data: bytes) -> tuple[bytes, str | None, str]:
        """(What to publish on TRAJ_GRADED, its message id, its group id: "" when not a trajectory)."""
        try:
            traj = Trajectory.from_bytes(data)
        except ContractError:
            GRADED.labels(result="not_a_trajectory").inc()
            return data, None, ""
        task = await self._task(traj.task_id) if traj.task_id else None
        if task is None or traj.terminal_reason == trajectory_pb2.INFRA_FAILURE:
            GRADED.labels(result="forwarded_ungraded").inc()
            return data, f"graded-{traj.trajectory_id}", traj.group_id
        start = time.perf_counter()
        kind = grader_kind(task)
        try:
            grader = self.graders.get(kind) or self.graders.setdefault(kind, make_grader(kind))
            grade = grade_sample(grader, self._sample(traj), task)  # the scorer raising on the answer: parse_error
        except Exception as exc:  # a verifier crash (it raises on the gold answer too) is infrastructure
            log.warning("verifier failed on %s: %s", traj.trajectory_id, exc)
            GRADED.labels(result="verifier_error").inc()
            VERIFIER_ERRORS.labels(kind, type(exc).__name__).inc()
            traj.finish(trajectory_pb2.INFRA_FAILURE, truncated=traj.truncated)
            traj.pb.verifier_output = f"verifier error: {exc}"
            return traj.to_bytes(), f"graded-{traj.trajectory_id}", traj.group_id
        elapsed = time.perf_counter() - start
        VERIFY_SECONDS.observe(elapsed)
        traj.set_reward(grade.reward, components=grade.components, grader_revision=grade.revision,
                        verifier_output=grade.verifier_output)
        traj.pb.timing.grading_seconds = elapsed
        VERIFIER_SECONDS.labels(kind).observe(elapsed)
        TERMINAL.labels(trajectory_pb2.TerminalReason.Name(traj.terminal_reason)).inc()
        for name, value in grade.components.items():
            RAW_COMPONENT.labels(kind, name).inc(value)
        for name, value in grade.audit.items():
            AUDITS.labels(name, "agree" if value >= 1.0 else "disagree").inc()
        if grade.audit:
            traj.pb.verifier_output += " audit=" + json.dumps(grade.audit, sort_keys=True)
        GRADED.labels(result=PARSE_ERROR if PARSE_ERROR in grade.components else "graded").inc()
        return traj.to_bytes(), f"graded-{traj.trajectory_id}", traj.group_id

    async def _task(self, task_id: str, cache_size: int = 4096) -> dict[str, Any] | None:
        """The store's task record. A record never changes once written, and the G samples of a
        task arrive close together, so recent ones are kept here (one Redis read per task, not per
        trajectory). Unknown ids are not cached: the store may write the record later."""
        task = self.task_cache.get(task_id)
        if task is not None:
            self.task_cache.move_to_end(task_id)
            return task
        assert self.record is not None, "_task() before setup()"
        found = await self.record.task(task_id)
        if found is None:
            return None
        task = self.task_cache[task_id] = found
        while len(self.task_cache) > cache_size:
            self.task_cache.popitem(last=False)
        return task

    def _sample(self, traj: Trajectory) -> Sample:
        """The sampled tokens decoded, whole and per turn (spans with mask 1, grouped by turn)."""
        ids_T = traj.token_ids_T
        turns: dict[int, list[int]] = {}
        for span in traj.spans:
            if span.action_type in (trajectory_pb2.TEXT, trajectory_pb2.TOOL_CALL, trajectory_pb2.CODE):
                turns.setdefault(int(span.turn_index), []).extend(ids_T[span.token_start:span.token_end].tolist())
        keys = sorted(turns)
        per_turn = [self.tokenizer.decode(turns[k]) for k in keys]
        if len(keys) == 1:  # one turn (most tasks): the whole response is that turn, decoded once
            ids, whole = turns[keys[0]], per_turn[0]
        else:
            ids = [t for k in keys for t in turns[k]]
            whole = self.tokenizer.decode(ids)
        ended_with_eos = bool(ids) and ids[-1] == self.tokenizer.eos_token_id
        return Sample(whole, per_turn, ended_with_eos, list(traj.pb.state_hashes),
                      trajectory_pb2.TerminalReason.Name(traj.terminal_reason),
                      traj.pb.final_answer if traj.pb.HasField("final_answer") else None)
