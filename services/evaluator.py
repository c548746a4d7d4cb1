"""Evaluator service: weight announcements → held-out evaluation on the run's engine → EVAL records.

::

    WEIGHTS KV ──▶ weights_loop (the rollout's) ── load into this process's own engine, only a
                        │ version due for evaluation (others wait as `pending`, the newest only)
                        │ holds eval_lock: no weights load while an evaluation runs
                        ▼
    eval_loop ── due? version 0 (before), ≥ every_versions after the last one (during), the last
       ▲            │ (run_finished in Redis, set by the learner when it stops for good, and the
       │            │  newest announced version loaded: after)
       │            ▼
       │     per source and pass (greedy, sampled, noise seeds; source_figures, learner/evaluate.py):
       │     each held-out task a Task with `evaluation` set ── run_episode (the rollout's own loop):
       │        environment service Reset/Step over gRPC (tools and sandbox run in its pod) and
       │        the engine through TurnSampler ──▶ Trajectory
       │     ── GradeRequest (NATS request/reply trajmesh.grade.eval) ──▶ grader service
       │        (services/grader.py grade_evaluation: its graders, its sandbox) ──▶ graded Trajectory
       │     ── pass_figures: accuracy and pass@k over the graded episodes; INFRA_FAILURE ones
       │        (environment or engine error, sandbox setup failure, grader crash or silence)
       │        counted apart as `*_infra_failures`, never scored as wrong answers
       │            ▼
       └── one record per evaluated version ──▶ EVAL (NATS; the learner's tracker reads it)
                                             ──▶ RUN_DIR/metrics.jsonl {"kind": "eval", ...}
                                             ──▶ gauges trajmesh_evaluator_heldout_*{source}

The evaluator is the rollout's machinery (`RolloutService`: the same weight watch, engine factory,
turn sampler, `EpisodeFormat` and episode loop `run_episode`) without its task loop: it never pulls
TASKS, never publishes to TRAJ_RAW, never touches the gate or the store, so eval traffic never
enters the store's accounting and never trains. What is its own: which versions to evaluate, greedy
vs sampled passes, their seeds, and the record. The held-out split of each source is drawn as
`trajmesh train` draws it (`heldout_tasks`: `trajmesh.tasks.load_split`, disjoint from training).

Every held-out episode is played by `run_episode`, as the rollout plays a training sample: through
the environment service, or by the source plug-in's own runner (`rollout_episodes`: external agents
and verifiers harnesses, which the environment service runs with its RunAgent against the agent
endpoint this process serves, `rollout_setup`) where the rollout uses one too. Its sessions sample at the evaluation's temperature, top-p and budget, whatever
the agent asks (`AgentSession.forced`). Every episode is graded by the grader service.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import time
from pathlib import Path
from typing import Any

import nats.errors
from prometheus_client import Counter, Gauge, Histogram

from trajmesh import bus as busmod
from trajmesh import security
from trajmesh.contract import Trajectory
from trajmesh.learner.evaluate import (
    INFRA_FAILURE,
    HeldoutTracker,
    Outcome,
    PassRunner,
    eval_budgets,
    heldout_result,
    heldout_tasks,
    pass_figures,
    source_figures,
)
from trajmesh.rollout.engines.generation import TurnSampler
from trajmesh.service import supervise
from trajmesh.services.rollout import RolloutService
from trajmesh.services.store.record import RunRecord
from trajmesh.v1 import trajectory_pb2
from trajmesh.weights import announce

log = logging.getLogger("trajmesh.evaluator")

HELDOUT_ACCURACY = Gauge("trajmesh_evaluator_heldout_accuracy_ratio",
                         "Held-out accuracy of the last evaluated version, per task source", ["source", "mode"])
HELDOUT_SCORE = Gauge("trajmesh_evaluator_heldout_score_ratio",
                      "Held-out selection score (eval.selection_metric, mean over sources) of the last evaluation")
SCORE_BELOW_BEST = Gauge("trajmesh_evaluator_heldout_score_below_best_ratio",
                         "Best held-out score so far minus the last one (0 at a new best): the regression")
EVALUATED_VERSION = Gauge("trajmesh_evaluator_evaluated_version", "Policy version of the last evaluation")
EVALUATIONS = Counter("trajmesh_evaluator_versions_evaluated_total", "Evaluations published, by phase", ["phase"])
EVAL_SECONDS = Histogram("trajmesh_evaluator_evaluation_seconds", "Wall time of one evaluation (every source)",
                         buckets=(5, 10, 30, 60, 120, 300, 600, 1200, 3600))
EPISODES = Counter("trajmesh_evaluator_heldout_trajectories_total",
                   "Held-out episodes played through the environment and grader services, by result "
                   "(graded; infra_failure: excluded from accuracy)", ["result"])
GRADE_FAILURES = Counter("trajmesh_evaluator_grade_request_failures_total",
                         "Grading requests no grader answered within GRADE_RETRY_S (the episode is an infra failure)")
for _phase in ("before", "during", "after"):
    EVALUATIONS.labels(phase=_phase)
for _result in ("graded", "infra_failure"):
    EPISODES.labels(result=_result)

EPISODES_IN_FLIGHT = 64
"""Held-out episodes played at once (each holds an environment session and its engine requests;
the engine batches their turns as it batches the rollout's)."""
GRADE_TIMEOUT_S = 120.0
"""How long one grading request waits for its reply (a sandboxed grader runs code)."""
GRADE_RETRY_S = 60.0
"""How long a grading request is retried while no grader answers (one restarting) before the
episode counts as an infra failure."""

FINISH_POLL_S = 2.0
"""How often the eval loop reads `run_finished` while no new version arrives (Redis has no event
for the key; the read is one EXISTS)."""


class EvaluatorService(RolloutService):
    name = "evaluator"
    engine_log_prefix = "evaluator-engine"

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.held = heldout_tasks(self.cfg)
        """The held-out split of every source, by source name."""
        self.eval_lock = asyncio.Lock()
        """Held by an evaluation and by a weights load: no version changes under an evaluation."""
        self.last_evaluated: int | None = None
        """The version of the last evaluation (None: none yet in this process)."""
        self.final_done = False
        """The last version's ("after") record is out: nothing more to evaluate."""
        self.tracker = HeldoutTracker(self.cfg.eval.stop_regression_margin, self.cfg.eval.stop_confirmations)
        """The best score so far (for the below-best gauge; the learner runs its own over EVAL)."""
        self.pending: trajectory_pb2.WeightsAnnouncement | None = None
        """The newest announcement not loaded because no evaluation of it was due."""
        self.redis: Any = None
        self.record: RunRecord | None = None
        """The store's record over `redis`: whether the learner has ended the run."""

    async def setup(self) -> None:
        """The rollout's engine, sampler, weight watch and environment stubs, without its task consumer."""
        from trajmesh.rollout.agents.episode import EpisodeFormat
        from trajmesh.rollout.engines.generation import PauseClock

        cfg = self.cfg
        assert cfg.infra.nats_url and cfg.infra.redis_url and cfg.model.path
        if cfg.eval.evaluator_nice > 0:  # before the engine starts: its child process inherits it
            os.nice(cfg.eval.evaluator_nice)
        self.bus = await security.connect_bus(cfg, "evaluator", name=self.worker_id)
        self.redis = security.redis_client(cfg)
        self.record = RunRecord(self.redis, cfg.infra.namespace)
        self.format = EpisodeFormat.load(cfg.model.path)
        self.tokenizer, self.chat, self.stop_ids = self.format.tokenizer, self.format.chat, self.format.stop_ids
        self.version = 0
        engine = await self.start_engine()
        self.pause = PauseClock()
        context_len = await engine.context_length()
        self.sampler = TurnSampler(engine, cfg.rollout.engine, stop_ids=self.stop_ids, pause=self.pause,
                                   context_len=context_len, loaded_version=lambda: self.version)
        self.version_changed = asyncio.Condition()
        self._connect_environments()  # as the rollout reaches them: held-out episodes are played there
        await self._source_setups()  # the sources' own runners (the agent endpoint), as the rollout's
        if await announce.latest_version(self.bus) > 0 \
                and (await self.bus.stream_info(busmod.STREAM_EVAL)).state.messages > 0:
            self.last_evaluated = -1  # a run under way, evaluated before: its base model is done
        # Otherwise (a fresh run, even one whose learner announced versions before this process was
        # up) the engine holds the base model, version 0: "before" is evaluated first.

    async def run(self) -> None:
        await supervise(self.weights_loop(), self.eval_loop(), stopping=self.stopping)

    async def stop(self) -> None:
        await super().stop()
        if self.redis is not None:
            await self.redis.aclose()

    async def _load_weights(self, ann: trajectory_pb2.WeightsAnnouncement) -> None:
        """The rollout's load, never while an evaluation runs (the watch keeps only the newest
        announcement meanwhile), and only of a version that is due (`_worth_loading`): any other
        stays `pending` (the newest such) until a later one replaces it or it becomes due (the
        base model evaluated, or the run finished with it: `eval_loop` loads it then)."""
        async with self.eval_lock:
            if not await self._worth_loading(int(ann.version)):
                self.pending = ann
                return
            self.pending = None
            await super()._load_weights(ann)

    async def _worth_loading(self, version: int) -> bool:
        """An evaluation of `version` would be due once it is loaded (`_due`'s rule without the
        load): one ≥ every_versions after the last evaluated, or the run's last one; nothing before
        the base model's "before" evaluation (the engine starts on it)."""
        if self.final_done or self.last_evaluated is None:  # None: the base model's "before" comes first
            return False
        if version - self.last_evaluated >= self.cfg.eval.every_versions:
            return True
        return await self._finished_at(version)

    # ------------------------------------------------------------------ what to evaluate
    async def eval_loop(self) -> None:
        """Evaluates each due version. Waits for a weights load (`version_changed`) or, every
        FINISH_POLL_S, for the run's end (`run_finished`); returns never (the service stops it)."""
        while True:
            async with self.eval_lock:
                pending = self.pending
                if pending is not None and await self._worth_loading(int(pending.version)):
                    self.pending = None  # due now: after "before", or the run's last version
                    await super()._load_weights(pending)  # eval_lock is held
                phase = await self._due(self.version)
                if phase is not None:
                    await self.evaluate(self.version, phase)
            await self._wait_for_change(self.version)

    async def _wait_for_change(self, seen: int) -> None:
        """Until a version other than `seen` is loaded, at most FINISH_POLL_S."""
        async with self.version_changed:
            try:
                async with asyncio.timeout(FINISH_POLL_S):  # not wait_for: on 3.11 it can swallow a cancel
                    await self.version_changed.wait_for(lambda: self.version != seen)
            except asyncio.TimeoutError:
                pass

    async def _due(self, version: int) -> str | None:
        """The phase of an evaluation of the loaded `version` now, None if none is due."""
        if self.final_done:
            return None
        if await self._finished_at(version):
            return "after"
        if self.last_evaluated is None:
            return "before" if version == 0 else "during"
        if version - self.last_evaluated >= self.cfg.eval.every_versions:
            return "during"
        return None

    async def _finished_at(self, version: int) -> bool:
        """The learner has finished (run_finished) and `version` is the newest it announced."""
        assert self.record is not None, "_finished_at() before setup()"
        if not await self.record.finished():
            return False
        latest = await announce.latest(self._live_bus())
        return latest is None or latest.version == version

    # ------------------------------------------------------------------ one evaluation
    async def evaluate(self, version: int, phase: str) -> dict[str, Any]:
        """Every source's held-out split on the loaded weights; publishes and records the result."""
        cfg = self.cfg
        full = phase in ("before", "after")  # the summary's figures: full samples and seed noise
        samples = cfg.eval.samples if full else cfg.eval.samples_during
        noise = cfg.eval.noise_seeds if full else 0
        loop = asyncio.get_running_loop()
        start = time.monotonic()
        log.info("evaluating v%d (%s): %d sources", version, phase, len(self.held))

        per = {}
        for name, tasks in self.held.items():
            run = self._mesh_pass(version, name, tasks, loop)
            per[name] = await asyncio.to_thread(source_figures, run, cfg, samples, noise)
        result = heldout_result(per, cfg.eval.selection_metric, noise)
        seconds = time.monotonic() - start
        record = {"kind": "eval", "phase": phase, "version": version, "rl_seconds": self._rl_seconds(version),
                  "source": "evaluator", "evaluator": self.worker_id, "eval_seconds": seconds, "time": time.time(),
                  **result}
        await self._publish(version, phase, record)
        self._append_metrics(record)
        self._export(record)
        EVAL_SECONDS.observe(seconds)
        self.last_evaluated = version
        self.final_done = phase == "after"
        log.info("v%d (%s): score %s in %.0fs (infra failures: %d greedy, %d sampled)", version, phase,
                 result.get("score", "-"), seconds, result["greedy_infra_failures"], result["sampled_infra_failures"])
        return record

    # ------------------------------------------------------------------ episodes through the services
    def _mesh_pass(self, version: int, source: str, tasks: list[dict[str, Any]],
                   loop: asyncio.AbstractEventLoop) -> PassRunner:
        """`source_figures`' pass runner (called in its worker thread): `play_pass` on this loop."""
        def run(temperature: float, samples: int, seed: int) -> dict[str, Any]:
            coro = self.play_pass(version, source, tasks, temperature, samples, seed)
            return asyncio.run_coroutine_threadsafe(coro, loop).result()

        return run

    async def play_pass(self, version: int, source: str, tasks: list[dict[str, Any]], temperature: float,
                        samples: int, seed: int) -> dict[str, Any]:
        """One pass over `tasks` through the services: `samples` episodes per task (sample k resets
        with `seed + k`, as the rollout's sample k of a task), each played by `run_episode` and
        graded by the grader service; at most EPISODES_IN_FLIGHT at once. Its `pass_figures`."""
        max_new_tokens, max_turns = eval_budgets(self.cfg)
        sampling = trajectory_pb2.SamplingParams(temperature=temperature, top_p=self.cfg.eval.top_p,
                                                 max_new_tokens=max_new_tokens, max_turns=max_turns)
        prefix = f"eval-v{version}-{source}-s{seed}-n{samples}-t{temperature:g}"
        slots = asyncio.Semaphore(EPISODES_IN_FLIGHT)

        async def one(task: trajectory_pb2.Task, held_id: str, index: int) -> Outcome:
            async with slots:
                return await self.episode_outcome(task, held_id, index)

        protos = [(self._eval_task(t, f"{prefix}-{t['task_id']}", version, samples, seed, sampling), t["task_id"])
                  for t in tasks]
        outcomes = await asyncio.gather(*(one(pb, held_id, k) for pb, held_id in protos for k in range(samples)))
        return pass_figures(list(outcomes), [t["task_id"] for t in tasks], samples)

    @staticmethod
    def _eval_task(t: dict[str, Any], task_id: str, version: int, samples: int, seed: int,
                   sampling: trajectory_pb2.SamplingParams) -> trajectory_pb2.Task:
        """A held-out task as the rollout receives a training one, with `evaluation` set (never
        admitted: no store record, no gate; the environment service and grader see the flag)."""
        return trajectory_pb2.Task(
            task_id=task_id, group_id=task_id, source=str(t.get("source") or ""), seed=seed, group_size=samples,
            sampling=sampling, environment=str(t.get("environment") or "single_answer"), prompt=t["prompt"],
            answer=t["answer"], metadata_json=json.dumps(t.get("metadata") or {}, default=str),
            admitted_at_version=version, evaluation=True)

    async def episode_outcome(self, task: trajectory_pb2.Task, held_id: str, index: int) -> Outcome:
        """Sample `index` of `task` played through the environment service (`run_episode`) and
        graded by the grader service; an episode either of them could not serve is an infra failure."""
        traj = await self.run_episode(task, index)
        if traj.terminal_reason != trajectory_pb2.INFRA_FAILURE:
            traj = await self._graded(task, traj)
        reason = trajectory_pb2.TerminalReason.Name(traj.terminal_reason)
        reward = float(traj.pb.reward) if reason != INFRA_FAILURE and traj.pb.graded else None
        EPISODES.labels(result="graded" if reward is not None else "infra_failure").inc()
        return Outcome(held_id, reward, int(traj.loss_mask_T.sum()), reason if reward is not None else INFRA_FAILURE)

    async def _graded(self, task: trajectory_pb2.Task, traj: Trajectory) -> Trajectory:
        """The grader service's grade of `traj` (NATS request/reply; services/grader.py
        `grade_evaluation`), retried while no grader answers for GRADE_RETRY_S; past it `traj`
        ends INFRA_FAILURE."""
        request = trajectory_pb2.GradeRequest(task=task, trajectory=traj.to_bytes()).SerializeToString()
        deadline = time.monotonic() + GRADE_RETRY_S
        delay = 0.5
        while True:
            try:
                reply = await self._live_bus().request(busmod.SUBJECT_EVAL_GRADE, request, GRADE_TIMEOUT_S)
                return Trajectory.from_bytes(reply)
            except (nats.errors.Error, asyncio.TimeoutError) as exc:
                if time.monotonic() + delay > deadline:
                    GRADE_FAILURES.inc()
                    log.warning("no grader graded %s for %.0fs (%r): an infra failure", traj.trajectory_id,
                                GRADE_RETRY_S, exc)
                    traj.fail_infra(trajectory_pb2.INFRA_GRADER, f"no grader answered for {GRADE_RETRY_S:.0f}s")
                    return traj
                await asyncio.sleep(delay)  # backoff while no grader answers (one restarting)
                delay = min(delay * 2, 5.0)

    def _rl_seconds(self, version: int) -> float:
        """RL seconds at the newest learner step up to `version` (the learner's metrics.jsonl
        records; 0 for the base model, or when this process cannot see the run dir's file)."""
        path = Path(self.cfg.run_dir) / "metrics.jsonl"
        best = 0.0
        try:
            lines = path.read_text().splitlines()
        except OSError:
            return best
        for line in lines:
            try:
                r = json.loads(line)
            except json.JSONDecodeError:
                continue  # a line being written right now
            if r.get("kind") == "learner_step" and int(r.get("version", -1)) <= version:
                best = max(best, float(r.get("rl_seconds", 0.0)))
        return best

    async def _publish(self, version: int, phase: str, record: dict[str, Any]) -> None:
        """The record on EVAL, retried while NATS restarts (msg id per version and phase)."""
        await self._live_bus().publish(busmod.SUBJECT_EVAL, json.dumps(record).encode(),
                                       msg_id=f"eval-v{version}-{phase}", retry_s=busmod.PUBLISH_RETRY_S,
                                       headers={busmod.WEIGHTS_VERSION_HEADER: str(version)})

    def _append_metrics(self, record: dict[str, Any]) -> None:
        """One line appended to RUN_DIR/metrics.jsonl with one write on an O_APPEND descriptor, so
        it never interleaves with the learner's lines."""
        path = Path(self.cfg.run_dir) / "metrics.jsonl"
        path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            os.write(fd, (json.dumps(record) + "\n").encode())
        finally:
            os.close(fd)

    def _export(self, record: dict[str, Any]) -> None:
        for name, r in record["heldout"].items():
            for mode in ("greedy", "sampled"):  # None: every episode of the pass an infra failure
                if r[f"{mode}_accuracy"] is not None:
                    HELDOUT_ACCURACY.labels(source=name, mode=mode).set(r[f"{mode}_accuracy"])
        EVALUATED_VERSION.set(int(record["version"]))
        EVALUATIONS.labels(phase=record["phase"]).inc()
        if "score" not in record:
            return
        score = float(record["score"])
        self.tracker.observe(int(record["version"]), score)
        HELDOUT_SCORE.set(score)
        SCORE_BELOW_BEST.set(max(0.0, float((self.tracker.best or {}).get("score", score)) - score))
