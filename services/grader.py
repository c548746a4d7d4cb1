"""Grader service: TRAJ_RAW → verify → TRAJ_GRADED (docs/DESIGN.md §1.4).

::

    TRAJ_RAW ──▶ grade_loop ── decode sampled tokens ── task record (Redis) ── grader ──▶ TRAJ_GRADED
                    │ undecodable bytes / unknown task: forwarded ungraded; the store quarantines them
    evaluator ── GradeRequest (NATS request/reply, trajmesh.grade.eval, queue `grader`) ──▶ grade_evaluation
       ▲            the task travels in the request (no Redis record), same grading code ──┐
       └──────────────────────── graded Trajectory (reply; never stored) ◀─────────────────┘

A scorer that raises on the model's answer scores it 0 with a ``parse_error`` component; one that
raises on the task's gold answer too is broken: INFRA_FAILURE (graders/base.py `grade_sample`).

Each message is published to TRAJ_GRADED (msg_id = trajectory id, so a redelivery is stored
once) before it is acked on TRAJ_RAW: a crash between the two only causes a deduplicated resend.

A source named in ``judge.sources`` is scored by the judge (graders/judge.py) instead of its grader:
a judge engine asked over HTTP; a fetch's messages are graded concurrently so the requests overlap.
No verdict (a timeout, a failed request, an unreadable answer) ends the trajectory INFRA_FAILURE
(``judge_error: <reason>``), never reward 0. Pairwise (``judge.mode``), a member is parked in Redis
and acked without a publish until its group is whole; the grader whose member completes it judges
the group and publishes every member, then acks (graders/judge_groups.py: what a crash mid-group does).
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections import OrderedDict
from typing import Any

import numpy as np
from prometheus_client import Counter, Histogram
from redis.asyncio import Redis

from trajmesh import bus as busmod
from trajmesh import plugins, sandbox, security, tasks
from trajmesh.contract import ContractError, Trajectory
from trajmesh.graders import PARSE_ERROR, Grade, Grader, Sample, grade_sample, grader_kind, make_grader
from trajmesh.graders.judge import JUDGE_ERRORS, JudgeError, JudgeGrader
from trajmesh.graders.judge_groups import ALREADY_PUBLISHED, LATE, WAIT, JudgeGroups
from trajmesh.service import Service
from trajmesh.services.store.record import RunRecord
from trajmesh.tokenizer import load_tokenizer
from trajmesh.v1 import trajectory_pb2

log = logging.getLogger("trajmesh.grader")

GRADED = Counter("trajmesh_grader_trajectories_total", "Trajectories handled by the grader", ["result"])
VERIFY_SECONDS = Histogram("trajmesh_grader_verify_seconds", "Verifier latency per trajectory")
RAW_COMPONENT = Counter("trajmesh_grader_raw_reward_component_total",
                        "Sum of each raw reward component's non-negative values by grader", ["grader", "component"])
RAW_COMPONENT_NEGATIVE = Counter(
    "trajmesh_grader_raw_reward_component_negative_total",
    "Sum of the magnitudes of each raw reward component's negative values by grader (a game's loss: -1)",
    ["grader", "component"])
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
        RAW_COMPONENT_NEGATIVE.labels(*values)


def count_component(grader: str, name: str, value: float) -> None:
    """Add a graded raw component to its series: a counter only grows, so a negative value (an
    environment's penalty, a lost game's -1) goes to ``_negative_total`` as its magnitude; the
    component's sum is the difference of the two."""
    if value < 0:
        RAW_COMPONENT_NEGATIVE.labels(grader, name).inc(-value)
    else:
        RAW_COMPONENT.labels(grader, name).inc(value)


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
        """Task id → the store's record of it, the most recently used last (`_task`)."""
        self.task_reads: dict[str, asyncio.Future[dict[str, Any] | None]] = {}
        """Task ids missing from the cache in this turn of the event loop, each with its waiters'
        future: read together at the end of the turn (`_start_task_read`)."""
        self.task_reading: set[asyncio.Future[None]] = set()
        """Reads of task records under way (held so that they are not collected)."""
        self.judge: JudgeGrader | None = None
        """The judge grader of `judge.sources` (graders/judge.py); None without a judge."""
        self.judge_groups: JudgeGroups | None = None
        """Pairwise judging's parked group members (graders/judge_groups.py); None unless pairwise."""

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
        await self.bus.serve(busmod.SUBJECT_EVAL_GRADE, "grader", self.grade_evaluation)
        if cfg.judge.sources:
            self.judge = JudgeGrader(cfg.judge)
            if cfg.judge.mode == "pairwise":
                self.judge_groups = JudgeGroups(self.redis, cfg.infra.namespace)

    async def run(self) -> None:
        await self.grade_loop()

    async def stop(self) -> None:
        if self.judge is not None:
            await self.judge.close()
        if self.bus is not None:
            await self.bus.close()
        if self.redis is not None:
            await self.redis.aclose()

    async def grade_loop(self) -> None:
        """Consumes TRAJ_RAW (pull, shared durable `grader`); waits for messages; never drops one.
        Publishes each on its store partition's TRAJ_GRADED subject (what is not a trajectory: partition 0's).
        A pairwise-judged member waits parked in Redis (acked, nothing published) until its group is
        whole; the member that completes it publishes the whole group."""
        bus, consumer = self.bus, self.consumer
        assert bus is not None and consumer is not None, "grade_loop() before setup()"
        partitions = self.cfg.store.replicas  # each graded trajectory goes to its group's store

        async def handle(msg: Any) -> None:
            data = await consumer.resolve(msg)
            outs, judged = (await self._judge_group_member(data) if self.judge_groups is not None
                            else ([await self._grade(data)], []))
            for out, msg_id, group_id in outs:
                await bus.publish(busmod.graded_subject(busmod.partition_of(group_id, partitions), partitions),
                                  out, msg_id=msg_id, retry_s=busmod.PUBLISH_RETRY_S if msg_id else 0.0)
            if judged:  # a whole pairwise group published: its parked members go (after, never before)
                assert self.judge_groups is not None
                await self.judge_groups.finish(outs[0][2], judged)
            await msg.ack()

        # Until `stopping`: nats-py's fetch can swallow the loop's cancellation (Python < 3.12
        # `asyncio.wait_for`), and the loop must not fetch on then. A fetch's messages are graded
        # concurrently: a judge's requests overlap.
        while not self.stopping.is_set():
            async with asyncio.TaskGroup() as tg:
                for msg in await consumer.fetch(batch=16, timeout=1.0):
                    tg.create_task(handle(msg))

    async def grade_evaluation(self, data: bytes) -> bytes:
        """Answers one of the evaluator's grading requests (a held-out episode played through the
        environment service) with the graded trajectory: `_grade` with the request's task in place
        of a store record, so held-out episodes are graded by this process's graders and sandbox.
        Never published, never stored. A request that cannot be graded at all is answered with its
        trajectory ended INFRA_FAILURE."""
        req = trajectory_pb2.GradeRequest.FromString(data)
        task = {"task_id": req.task.task_id, "source": req.task.source, "prompt": req.task.prompt,
                "answer": req.task.answer, "metadata": json.loads(req.task.metadata_json or "{}")}
        try:
            out, _, _ = await self._grade(req.trajectory, task)
            return out
        except Exception as exc:  # noqa: BLE001 - answered as an infra failure, counted
            log.warning("evaluation grading of %s failed: %r", req.task.task_id, exc)
            GRADED.labels(result="evaluation_error").inc()
            traj = Trajectory.from_bytes(req.trajectory)
            traj.fail_infra(trajectory_pb2.INFRA_GRADER, f"evaluation grading failed: {exc!r}")
            return traj.to_bytes()

    async def _grade(self, data: bytes, task: dict[str, Any] | None = None,
                     traj: Trajectory | None = None) -> tuple[bytes, str | None, str]:
        """(What to publish on TRAJ_GRADED, its message id, its group id: "" when not a trajectory).
        `task`: the task record (an evaluation request's); None: the store's, read from Redis.
        `traj`: `data` parsed already (pairwise judging parses every message first).

        The verdict is set on the parsed message and the message serialized again. Its per-token
        arrays are one opaque bytes field (the token block), so parsing and serializing copy them
        as one memcpy each and never touch a token: the block published is byte for byte the one
        received. Appending the verdict's fields to `data` instead would save those two copies but
        not be idempotent: on a redelivery of a message graded before (or a re-grade), map entries
        of `raw_reward_components` from the first verdict would survive beside the second's, and
        the audit suffix of `verifier_output` would be appended twice. `set_reward` replaces them
        all, so grading twice gives the message grading once gives (tests/unit/services/test_grader_block.py)."""
        if traj is None:
            try:
                traj = Trajectory.from_bytes(data)
            except ContractError:
                GRADED.labels(result="not_a_trajectory").inc()
                return data, None, ""
        if task is None:
            task = await self._task(traj.task_id) if traj.task_id else None
        if task is None or traj.terminal_reason == trajectory_pb2.INFRA_FAILURE:
            GRADED.labels(result="forwarded_ungraded").inc()
            return data, f"graded-{traj.trajectory_id}", traj.group_id
        if traj.past_deadline(time.time()):  # the sample's one deadline covers grading too
            return self._past_deadline(traj, "before grading")
        start = time.perf_counter()
        kind = grader_kind(task)
        try:
            if self.judge is not None and self.judge.judges(str(task.get("source", traj.pb.task_source))):
                kind = "judge"
                grade: Grade = await self.judge.grade(self._sample(traj), task)
            else:
                grader = self.graders.get(kind) or self.graders.setdefault(kind, make_grader(kind))
                grade = grade_sample(grader, self._sample(traj), task)  # the scorer raising on the answer: parse_error
        except JudgeError as exc:  # no verdict (timeout, engine down, unreadable): infrastructure, never reward 0
            return self._judge_failed(traj, exc)
        except Exception as exc:  # a verifier crash (it raises on the gold answer too) is infrastructure
            log.warning("verifier failed on %s: %s", traj.trajectory_id, exc)
            GRADED.labels(result="verifier_error").inc()
            VERIFIER_ERRORS.labels(kind, type(exc).__name__).inc()
            traj.fail_infra(trajectory_pb2.INFRA_GRADER)
            traj.pb.verifier_output = f"verifier error: {exc}"
            return traj.to_bytes(), f"graded-{traj.trajectory_id}", traj.group_id
        elapsed = time.perf_counter() - start
        VERIFY_SECONDS.observe(elapsed)
        if traj.past_deadline(time.time()):
            return self._past_deadline(traj, "while grading")
        traj.set_reward(grade.reward, components=grade.components, grader_revision=grade.revision,
                        verifier_output=grade.verifier_output)
        traj.pb.timing.grading_seconds = elapsed
        VERIFIER_SECONDS.labels(kind).observe(elapsed)
        TERMINAL.labels(trajectory_pb2.TerminalReason.Name(traj.terminal_reason)).inc()
        for name, value in grade.components.items():
            count_component(kind, name, value)
        for name, value in grade.audit.items():
            AUDITS.labels(name, "agree" if value >= 1.0 else "disagree").inc()
        if grade.audit:
            traj.pb.verifier_output += " audit=" + json.dumps(grade.audit, sort_keys=True)
        GRADED.labels(result=PARSE_ERROR if PARSE_ERROR in grade.components else "graded").inc()
        return traj.to_bytes(), f"graded-{traj.trajectory_id}", traj.group_id

    @staticmethod
    def _judge_failed(traj: Trajectory, exc: JudgeError) -> tuple[bytes, str | None, str]:
        """A trajectory the judge could not score: INFRA_FAILURE (cause INFRA_GRADER), a
        ``judge_error: <reason>`` verifier output, counted by reason; never a reward."""
        log.warning("judge could not score %s: %s", traj.trajectory_id, exc)
        GRADED.labels(result="judge_error").inc()
        JUDGE_ERRORS.labels(exc.reason).inc()
        traj.fail_infra(trajectory_pb2.INFRA_GRADER, exc.verifier_output())
        return traj.to_bytes(), f"graded-{traj.trajectory_id}", traj.group_id

    async def _judge_group_member(self, data: bytes) -> tuple[list[tuple[bytes, str | None, str]], list[str]]:
        """Pairwise judging (graders/judge_groups.py): (what to publish, the member ids to mark done
        after). `data` not a member of a judged source's group: graded alone by `_grade`, parsed
        once. A member: nothing while the group is incomplete or this member was published already;
        every member once this one completes the group (or held its claim before a crash)."""
        assert self.judge is not None and self.judge_groups is not None
        try:
            traj = Trajectory.from_bytes(data)
        except ContractError:
            return [await self._grade(data)], []
        task = await self._task(traj.task_id) if traj.task_id else None
        if task is None or not self.judge.judges(str(task.get("source", traj.pb.task_source))):
            return [await self._grade(data, task, traj)], []
        state = await self.judge_groups.add(traj.group_id, traj.trajectory_id, data, int(task["group_size"]))
        if state in (WAIT, ALREADY_PUBLISHED):
            return [], []
        if state == LATE:  # a refill of a group judged before it came: no partners left
            return [self._judge_failed(traj, JudgeError("no_pair", "its group was judged before it came"))], []
        members = await self.judge_groups.members(traj.group_id)
        return await self._judge_group(members, task), sorted(members)

    async def _judge_group(self, members: dict[str, bytes], task: dict[str, Any]) -> list[tuple[bytes, str | None, str]]:
        """Every member of a whole group, the gradable ones judged pairwise in the order of their
        ids (the same order on a redelivery); infra failures forwarded as they came."""
        trajs = [Trajectory.from_bytes(members[tid]) for tid in sorted(members)]
        judged = [t for t in trajs if t.terminal_reason != trajectory_pb2.INFRA_FAILURE]
        start = time.perf_counter()
        try:
            grades = await self.judge.grade_group([self._sample(t) for t in judged], task) if self.judge else []
        except JudgeError as exc:  # one comparison failed: the group's rewards are relative, so all fail
            failed = {t.trajectory_id: self._judge_failed(t, exc) for t in judged}
            return [failed.get(t.trajectory_id) or (t.to_bytes(), f"graded-{t.trajectory_id}", t.group_id)
                    for t in trajs]
        elapsed = time.perf_counter() - start
        VERIFIER_SECONDS.labels("judge").observe(elapsed)
        for t, grade in zip(judged, grades, strict=True):
            t.set_reward(grade.reward, components=grade.components, grader_revision=grade.revision,
                         verifier_output=grade.verifier_output)
            t.pb.timing.grading_seconds = elapsed
            TERMINAL.labels(trajectory_pb2.TerminalReason.Name(t.terminal_reason)).inc()
            for name, value in grade.components.items():
                count_component("judge", name, value)
            GRADED.labels(result="graded").inc()
        return [(t.to_bytes(), f"graded-{t.trajectory_id}", t.group_id) for t in trajs]

    @staticmethod
    def _past_deadline(traj: Trajectory, when: str) -> tuple[bytes, str | None, str]:
        """A sample whose deadline (`rollout.sample_deadline_s`) passed `when`: INFRA_FAILURE with
        cause INFRA_DEADLINE, forwarded ungraded (the store refills its group)."""
        log.warning("sample %s past its deadline %s: INFRA_FAILURE", traj.trajectory_id, when)
        GRADED.labels(result="past_deadline").inc()
        traj.fail_infra(trajectory_pb2.INFRA_DEADLINE, f"sample deadline passed {when}")
        return traj.to_bytes(), f"graded-{traj.trajectory_id}", traj.group_id

    async def _task(self, task_id: str) -> dict[str, Any] | None:
        """The store's task record. A record never changes once written (the store's admission
        script writes it once per task id; only its settled group's cleanup deletes it), and the
        G samples of a task arrive close together, so recent ones are kept here. A fetch's
        messages are graded concurrently: the ids missing from the cache in one turn of the event
        loop are read together, one Redis round trip (`_read_tasks`), each id once, however many
        samples ask for it. Unknown ids are not cached: the store may write the record later."""
        task = self.task_cache.get(task_id)
        if task is not None:
            self.task_cache.move_to_end(task_id)
            return task
        loop = asyncio.get_running_loop()
        reading = self.task_reads.get(task_id)
        if reading is None:
            reading = self.task_reads[task_id] = loop.create_future()
            if len(self.task_reads) == 1:  # the first miss of this turn: read after the others join
                loop.call_soon(self._start_task_read)
        return await asyncio.shield(reading)  # a cancelled sample leaves the read to the others

    def _start_task_read(self) -> None:
        batch, self.task_reads = self.task_reads, {}
        read = asyncio.ensure_future(self._read_tasks(batch))
        self.task_reading.add(read)
        read.add_done_callback(self.task_reading.discard)

    async def _read_tasks(self, batch: dict[str, asyncio.Future[dict[str, Any] | None]],
                          cache_size: int = 4096) -> None:
        """Reads the records of `batch`'s ids in one round trip and answers each id's waiters
        (an error reaches every one of them, as their own read's would)."""
        assert self.record is not None, "_task() before setup()"
        try:
            found = await self.record.tasks(list(batch))
        except asyncio.CancelledError:
            for waiting in batch.values():
                waiting.cancel()
            raise
        except Exception as exc:
            for waiting in batch.values():
                if not waiting.done():
                    waiting.set_exception(exc)
                    waiting.exception()  # retrieved: a waiter cancelled meanwhile has nobody to raise it to
            return
        for task_id, task in zip(batch, found, strict=True):
            if task is not None:
                self.task_cache[task_id] = task
            if not batch[task_id].done():
                batch[task_id].set_result(task)
        while len(self.task_cache) > cache_size:
            self.task_cache.popitem(last=False)

    def _sample(self, traj: Trajectory) -> Sample:
        """The sampled tokens decoded, whole and per turn (spans with mask 1, grouped by turn)."""
        ids_T = traj.token_ids_T
        spans: dict[int, list[np.ndarray]] = {}
        for span in traj.spans:
            if span.action_type in (trajectory_pb2.TEXT, trajectory_pb2.TOOL_CALL, trajectory_pb2.CODE):
                spans.setdefault(int(span.turn_index), []).append(ids_T[span.token_start:span.token_end])
        turns = [s[0] if len(s) == 1 else np.concatenate(s) for _, s in sorted(spans.items())]
        per_turn = [self.tokenizer.decode(t) for t in turns]  # arrays, as the byte table reads them
        if len(turns) == 1:  # one turn (most tasks): the whole response is that turn, decoded once
            ids, whole = turns[0], per_turn[0]
        else:
            ids = np.concatenate(turns) if turns else np.zeros(0, np.int64)
            whole = self.tokenizer.decode(ids)
        ended_with_eos = bool(ids.size) and int(ids[-1]) == self.tokenizer.eos_token_id
        return Sample(whole, per_turn, ended_with_eos, list(traj.pb.state_hashes),
                      trajectory_pb2.TerminalReason.Name(traj.terminal_reason),
                      traj.pb.final_answer if traj.pb.HasField("final_answer") else None)
