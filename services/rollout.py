"""Rollout service: TASKS → agent loop on an inference engine → TRAJ_RAW (docs/DESIGN.md §1.2, §5).

::

    WEIGHTS KV ──▶ weights_loop ── [delta: rebuild on local disk] ── pause engine ── /update_weights_from_disk ── continue
                                        │ in-flight requests return partial output (abort)
                                        ▼                       and are resubmitted after the load
    TASKS ──▶ task_loop ──▶ run_task (G samples) ──▶ run_episode ── env Reset/Step (gRPC, sticky;
                                                                    in process for a stateless one)
                 ▲ bounded by concurrent_tasks          │ engine /generate (input_ids, log-probs)
                 │                                      ▼
               ack after all G published ◀── TRAJ_RAW (msg_id = trajectory id)

The engine is SGLang's HTTP server on GPUs or the built-in torch engine (started here as a child
process when `rollout.engine.url` is unset); one client speaks the shared subset of SGLang's API.
Every sampled token records its behavior log-prob and the version of the weights that produced it;
a trajectory interrupted by a weight update continues under the new version (per-token versions).
Trajectory ids are derived from the task id, so a redelivered task re-creates the same ids and the
store deduplicates them. Each sample runs under one deadline (`run_sample`, `rollout.sample_deadline_s`);
a refill the store asks for (an infra-failed member's replacement) is a task of one sample whose
index starts at `Task.first_sample` (G + k).
"""

from __future__ import annotations

import asyncio
import json
import logging
import shutil
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

import grpc
import nats.errors
import nats.js.errors
from prometheus_client import Counter, Gauge, Histogram

from trajmesh import bus as busmod
from trajmesh import plugins, security
from trajmesh.contract import Trajectory
from trajmesh.rollout.agents.environment_replicas import sticky_call
from trajmesh.rollout.agents.episode import EpisodeFormat
from trajmesh.rollout.engines import spawn_torch_server
from trajmesh.rollout.engines.base import EngineContext, StartedEngine, wait_healthy
from trajmesh.rollout.engines.engine_client import CoalescingEngine, EngineError
from trajmesh.rollout.engines.generation import (
    ENGINE_FAILURES,
    EngineFailed,
    NewestOnly,
    PauseClock,
    TurnSampler,
    sampling_seed,
)
from trajmesh.rollout.engines.synthetic_engine import SyntheticEngine
from trajmesh.rollout.engines.teacher import Teacher, scorable
from trajmesh.rollout.engines.vllm_engine import stop_server
from trajmesh.service import Service, supervise
from trajmesh.services import environment
from trajmesh.v1 import services_pb2, services_pb2_grpc, trajectory_pb2
from trajmesh.weights import announce
from trajmesh.weights.delta import LocalWeights, WeightSyncError, WeightSyncTimeout, is_delta_dir

log = logging.getLogger("trajmesh.rollout")

TRAJECTORIES = Counter("trajmesh_rollout_trajectories_total", "Trajectories published", ["terminal_reason"])
WEIGHT_UPDATES = Counter("trajmesh_rollout_weight_updates_total", "Weight versions loaded")
WEIGHT_UPDATE_FAILURES = Counter("trajmesh_rollout_weight_update_failures_total", "Weight versions that failed to load")
WEIGHT_WATCH_MISSES = Counter("trajmesh_rollout_weight_watch_missed_versions_total",
                              "Announced versions the weights watch had not delivered when a task waited for them "
                              "(loaded from a read of the announcement instead)")
ANCHOR_REQUESTS_SENT = Counter("trajmesh_rollout_weight_anchor_requests_total",
                               "Full anchors asked of the learner after a version could not be rebuilt")
WEIGHT_SYNC_SECONDS = Histogram("trajmesh_rollout_weight_sync_seconds",
                                "Rebuild (weights.sync delta) + pause + load + continue time")
POLICY_VERSION = Gauge("trajmesh_rollout_policy_version", "Weights version loaded in the engine")
BUSY_SECONDS = Counter("trajmesh_rollout_busy_seconds_total", "Seconds with at least one task in flight")
IDLE_SECONDS = Counter("trajmesh_rollout_idle_seconds_total", "Seconds with no task in flight")
INFLIGHT = Gauge("trajmesh_rollout_tasks_in_flight", "Tasks being rolled out")
EPISODE_SECONDS = Histogram("trajmesh_rollout_episode_seconds", "Wall time of one trajectory")
ENV_FAILURES = Counter("trajmesh_rollout_environment_failures_total",
                       "Environment RPC failures (trajectory excluded as INFRA_FAILURE)", ["code"])
ENV_WAIT_SECONDS = Counter("trajmesh_rollout_environment_wait_seconds_total",
                           "Seconds episodes waited at Reset for an environment replica to answer")
BUS_FAILURES = Counter("trajmesh_rollout_bus_failures_total",
                       "NATS operations of a task that failed or timed out (publishes are retried), by operation",
                       ["operation"])
SAMPLE_DEADLINES = Counter("trajmesh_rollout_sample_deadline_failures_total",
                           "Samples cut at their deadline (rollout.sample_deadline_s): INFRA_FAILURE, cause deadline")
TASKS_GIVEN_UP = Counter("trajmesh_rollout_tasks_given_up_total",
                         "Tasks left unacked for redelivery because their trajectories could not be published")
PUBLISH_RETRY_S = 60.0
"""How long a task's trajectory publish is retried (NATS restarting, or this process paused past
the JetStream API timeout with the PubAck unread) before the task is given up unacked: JetStream
then redelivers it after task_ack_wait_s and the store deduplicates what was published."""
TEACHER_STARTUP_S = 600.0
"""How long rollout waits for a teacher engine's /health at start (a large teacher loads for minutes)."""
ENV_STEP_TIMEOUT_S = 120.0
"""gRPC deadline of one Reset/Step (a sandboxed tool call is bounded well below it)."""
_ACTION_TYPES = {"TEXT": trajectory_pb2.TEXT, "CODE": trajectory_pb2.CODE, "TOOL_CALL": trajectory_pb2.TOOL_CALL}
_TOOL_STATUS = {"ok": trajectory_pb2.TOOL_OK, "error": trajectory_pb2.TOOL_ERROR, "timeout": trajectory_pb2.TOOL_TIMEOUT,
                "sandbox_violation": trajectory_pb2.TOOL_SANDBOX_VIOLATION, "invalid": trajectory_pb2.TOOL_INVALID}


def _record_tool_call(traj: Trajectory, span_id: str, info: dict[str, Any]) -> None:
    """Records the tool call the environment reports in the Step's info_json (if any)."""
    call = info.get("tool_call")
    if not call:
        return
    traj.add_tool_call(str(call.get("name", "")), str(call.get("request", "")), str(call.get("response", "")),
                       status=_TOOL_STATUS.get(str(call.get("status")), trajectory_pb2.TOOL_ERROR),
                       latency_seconds=float(call.get("latency_s", 0.0)), span_id=span_id)
for _reason in trajectory_pb2.TerminalReason.keys():  # exported at 0 so rates exist before the first one
    TRAJECTORIES.labels(terminal_reason=_reason)


class RolloutService(Service):
    name = "rollout"
    engine_log_prefix = "engine"
    """The torch engine's log: RUN_DIR/logs/<prefix>-<replica>.log."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.slots = asyncio.Semaphore(self.cfg.rollout.concurrent_tasks)
        """One permit per task this process works on at once (rollout.concurrent_tasks)."""
        self.inflight: set[asyncio.Task[None]] = set()
        # What setup() opens, None (empty) until then, so stop() after a failed setup closes only what exists.
        self.bus: busmod.Bus | None = None
        self.engine: CoalescingEngine | SyntheticEngine | None = None
        self.engine_proc: subprocess.Popen[bytes] | None = None
        """The built-in torch engine this process started (None: an external or synthetic engine)."""
        self.teachers: dict[str, Teacher] = {}
        """Task source -> its distillation teacher (`distill.teachers`; empty: none)."""
        self.teacher_procs: list[subprocess.Popen[bytes]] = []
        """Torch engine children serving teachers."""
        self.channels: list[grpc.aio.Channel] = []
        self.agent_server: Any = None
        """The agent endpoint's uvicorn server, started by a source's ``rollout_setup`` hook (None: none)."""
        self.agent_serve_task: asyncio.Task[None] | None = None
        self.agents: Any = None
        """Runs external agents through the agent endpoint (set by the hook that serves it; None: none)."""
        self.episode_runners: dict[str, str] = plugins.rollout_episodes()
        """Environment key -> "module:function" that runs its episodes instead of the environment
        loop (`SourcePlugin.rollout_episodes`, over every registered source)."""
        local = self.cfg.weights.local_dir or Path(tempfile.gettempdir()) / "trajmesh-weights"
        self.local_weights = LocalWeights(Path(local) / self.worker_id)
        """``weights.sync: delta``: the checkpoints rebuilt on this process's disk (deleted at stop)."""
        self.newest_weights = NewestOnly()
        """The newest announcement not loaded yet: the weights watch offers, `weights_loop` loads."""
        self.watched_version = -1
        """The newest version the weights watch has delivered (-1: none yet)."""

    def _live_bus(self) -> busmod.Bus:
        assert self.bus is not None, "used before setup()"
        return self.bus

    def _live_engine(self) -> CoalescingEngine | SyntheticEngine:
        assert self.engine is not None, "used before setup()"
        return self.engine

    async def setup(self) -> None:
        cfg = self.cfg
        assert cfg.infra.nats_url and cfg.model.path
        bus = self.bus = await security.connect_bus(cfg, "rollout", name=self.worker_id)
        # The episode token layout (rollout/agents/episode.py, shared with held-out evaluation): the model's
        # own chat format when it has a template (else BOS + raw observation text), and every id
        # that ends a turn (EOS ids of the tokenizer and generation config, end of turn).
        self.format = EpisodeFormat.load(cfg.model.path)
        self.tokenizer, self.chat, self.stop_ids = self.format.tokenizer, self.format.chat, self.format.stop_ids
        # The engine starts from the base model (always present) as version 0; a late joiner then
        # loads the newest announced weights in weights_loop before it samples any task admitted
        # at that version (_wait_for_version).
        self.version = 0
        engine = await self.start_engine()
        # Pauses for weight loads: a request the pause aborts waits and resubmits; the time paused
        # does not count against request_timeout_s.
        self.pause = PauseClock()
        context_len = await engine.context_length()
        self.sampler = TurnSampler(engine, cfg.rollout.engine, stop_ids=self.stop_ids,
                                   pause=self.pause, context_len=context_len, loaded_version=lambda: self.version)
        self.version_changed = asyncio.Condition()
        self._connect_environments()
        self.consumer = await bus.pull_subscribe(busmod.STREAM_TASKS, "rollout", ack_wait_s=cfg.rollout.task_ack_wait_s)
        POLICY_VERSION.set(self.version)
        await self._start_teachers()
        await self._source_setups()

    def _connect_environments(self) -> None:
        """gRPC channels and stubs to the environment service's replicas (episodes are played there)."""
        cfg = self.cfg
        self.channels = [security.grpc_channel(a, cfg.infra.security.grpc_tls) for a in cfg.infra.environment_addresses]
        self.envs = [services_pb2_grpc.EnvironmentStub(c) for c in self.channels]

    async def start_engine(self) -> CoalescingEngine | SyntheticEngine:
        """The engine by `rollout.engine.type` (`trajmesh.plugins.ENGINES`, factories in
        rollout/engines/__init__.py), healthy, at the version this process holds; the server it
        started is kept in `engine_proc` (stop() ends it)."""
        ctx = EngineContext(self.cfg, self.replica, self.worker_id, self.tokenizer.vocab_size,
                            self.tokenizer.eos_token_id, version=self.version, log_prefix=self.engine_log_prefix)
        started: StartedEngine = await plugins.load(plugins.engine(self.cfg.rollout.engine.type).start)(ctx)
        self.engine, self.engine_proc = started.engine, started.proc
        return self.engine

    async def _source_setups(self) -> None:
        """Runs each configured source type's ``rollout_setup`` hook once, given that type's
        `tasks.sources` entries (`trajmesh.plugins.SourcePlugin`; e.g. one serves the agent endpoint)."""
        by_type: dict[str, list[Any]] = {}
        for src in self.cfg.tasks.sources:
            by_type.setdefault(src.type, []).append(src)
        for type_, srcs in by_type.items():
            hook = plugins.source(type_).rollout_setup
            if hook is not None:
                await plugins.load(hook)(self, srcs)

    async def _start_teachers(self) -> None:
        """One `Teacher` per `distill.teachers` entry (rollout/engines/teacher.py): a torch engine child
        from its model_path, or the SGLang / vLLM server at its url; waits until each is healthy."""
        from trajmesh.rollout.engines.engine_client import EngineClient
        from trajmesh.rollout.engines.vllm_engine import VLLMEngine

        for t in self.cfg.distill.teachers:
            url, proc = t.url, None
            log_path = Path(self.cfg.run_dir) / "logs" / f"teacher-{t.source}-{self.replica}.log"
            if url is None:
                assert t.model_path is not None
                url, proc = spawn_torch_server(self.cfg, self.replica, t.model_path, 0, log_path)
                self.teacher_procs.append(proc)
            engine = VLLMEngine(url) if t.type == "vllm" else EngineClient(url)
            await wait_healthy(engine, TEACHER_STARTUP_S, proc=proc, what=f"teacher engine for {t.source} at {url}",
                               log_path=log_path if proc is not None else None)
            teacher = Teacher(t, engine, self.cfg.distill)
            await teacher.start()
            self.teachers[t.source] = teacher

    async def _score_with_teachers(self, trajs: list[Trajectory]) -> None:
        """Each trajectory of a source with a teacher gets its teacher's scores (or ends INFRA_FAILURE)."""
        await asyncio.gather(*(self.teachers[t.pb.task_source].score_trajectory(t) for t in trajs
                               if t.pb.task_source in self.teachers and scorable(t)))

    async def run(self) -> None:
        await supervise(self.weights_loop(), self.task_loop(), self.utilization_loop(), stopping=self.stopping)

    async def stop(self) -> None:
        for t in list(self.inflight):
            t.cancel()
        if self.agent_server is not None and self.agent_serve_task is not None:
            self.agent_server.should_exit = True
            await self.agent_serve_task
        if self.engine is not None:
            await self.engine.close()
        for teacher in self.teachers.values():
            await teacher.close()
        for c in self.channels:
            await c.close()
        if self.bus is not None:
            await self.bus.close()
        for proc in [p for p in (self.engine_proc, *self.teacher_procs) if p is not None]:
            stop_server(proc, timeout_s=10.0)  # its process tree, and a vLLM server's sockets directory
        shutil.rmtree(self.local_weights.local_dir, ignore_errors=True)

    # ------------------------------------------------------------------ weights
    async def weights_loop(self) -> None:
        """Keeps only the newest weight announcement (KV watch) and loads it whenever the engine is
        free: versions announced while a load runs are skipped, never loaded in order."""
        newest = self.newest_weights

        async def watch() -> None:
            """Consumes the KV watch; replaces the pending announcement; unblocks load()."""
            async for ann in announce.watch(self._live_bus(), include_current=True):
                self.watched_version = max(self.watched_version, int(ann.version))
                newest.offer(ann)

        async def load() -> None:
            """Waits for an announcement; loads the newest one pending."""
            while True:
                ann = await newest.take()
                if ann.version != self.version:  # lower: a learner resumed from a checkpoint; follow it
                    await self._load_weights(ann)

        await supervise(watch(), load())

    async def _load_weights(self, ann: trajectory_pb2.WeightsAnnouncement) -> None:
        """Rebuild a delta version on local disk (generation goes on meanwhile), then pause
        (in-flight generations return partial output and wait on `pause.ready`), load, continue;
        they resubmit prompt + partial output under the new version."""
        start = time.perf_counter()
        try:
            path = await self._checkpoint_dir(ann)
        except WeightSyncError as exc:
            # Its anchor path failed too (or ran past the deadline): the engine keeps its weights;
            # the next version is tried from scratch (a new anchor heals a broken delta chain).
            WEIGHT_UPDATE_FAILURES.inc()
            log.error("could not rebuild weights v%d: %s; asking for a full anchor", ann.version, exc)
            try:  # the learner's next version is then a full file, not a delta on the broken chain
                await announce.request_anchor(self._live_bus(), self.worker_id, int(ann.version))
                ANCHOR_REQUESTS_SENT.inc()
            except (nats.errors.Error, asyncio.TimeoutError) as req_exc:
                log.warning("anchor request failed (%r); the next periodic anchor heals it", req_exc)
            return
        self.pause.pause()
        engine = self._live_engine()
        await engine.pause()
        try:
            await engine.update_weights_from_disk(path, int(ann.version))
        except EngineError as exc:
            # E.g. the learner pruned that version before we got to it: a newer announcement
            # follows; the per-token lag check bounds what the old weights sample meanwhile.
            WEIGHT_UPDATE_FAILURES.inc()
            log.warning("could not load weights v%d (%s); waiting for the next version", ann.version, exc)
            await engine.resume()
            self.pause.resume()
            return
        self.local_weights.loaded(path)
        self.version = int(ann.version)
        async with self.version_changed:
            self.version_changed.notify_all()
        await engine.resume()
        self.pause.resume()
        WEIGHT_UPDATES.inc()
        WEIGHT_SYNC_SECONDS.observe(time.perf_counter() - start)
        POLICY_VERSION.set(self.version)
        log.info("loaded weights v%d from %s", self.version, path)

    async def _checkpoint_dir(self, ann: trajectory_pb2.WeightsAnnouncement) -> str:
        """The directory the engine loads for `ann`: the announced one, or, for a delta version
        (``weights.sync: delta``), its checked rebuild on local disk (trajmesh/weights/delta.py).
        Raises `WeightSyncTimeout`, naming what it waited for, after ``weights.sync_timeout_s``."""
        if not is_delta_dir(ann.path):
            return ann.path
        timeout_s = self.cfg.weights.sync_timeout_s
        work = asyncio.ensure_future(asyncio.to_thread(self.local_weights.prepare, ann.path, ann.sha256))
        try:
            return str(await asyncio.wait_for(asyncio.shield(work), timeout_s))
        except asyncio.TimeoutError:
            raise WeightSyncTimeout(f"weights v{ann.version} not rebuilt after {timeout_s:.0f}s: waiting on "
                                    f"{self.local_weights.waiting_on()}") from None

    # ------------------------------------------------------------------ tasks
    async def task_loop(self) -> None:
        """Pulls tasks from TASKS (shared durable `rollout`) while a slot is free; waits on slots.
        Returns once `stopping` is set (its cancellation can be swallowed by a fetch that completed
        at the same moment, Python < 3.12 `asyncio.wait_for`: the loop must not run on then)."""
        while not self.stopping.is_set():
            await self.slots.acquire()
            msgs = await self.consumer.fetch(batch=1, timeout=1.0)
            if not msgs:
                self.slots.release()
                continue
            task = asyncio.ensure_future(self._handle(msgs[0]))
            self.inflight.add(task)
            task.add_done_callback(self._task_done)

    def _task_done(self, task: asyncio.Task[None]) -> None:
        self.inflight.discard(task)
        self.slots.release()
        error = None if task.cancelled() else task.exception()
        if error is not None:
            log.error("rollout task crashed: %r", error)
            self.fail(error)  # exit non-zero naming the error; the launcher restarts, the task is redelivered

    async def _handle(self, msg: Any) -> None:
        INFLIGHT.inc()
        try:
            data = await self.consumer.resolve(msg)
            task = trajectory_pb2.Task.FromString(data)
            heartbeat = asyncio.ensure_future(self._heartbeat(msg))
            try:
                await self._wait_for_version(int(task.admitted_at_version))
                first = int(task.first_sample)  # 0, or G + k for a refill (one sample)
                trajs = await asyncio.gather(*(self.run_sample(task, first + i) for i in range(task.group_size)))
                if self.teachers:
                    await self._score_with_teachers(trajs)
                published = await self._publish_all(task, trajs)
            finally:
                heartbeat.cancel()
            if published:
                await self._ack(msg)
        finally:
            INFLIGHT.dec()

    async def _publish_all(self, task: trajectory_pb2.Task, trajs: list[Trajectory]) -> bool:
        """Publishes a task's trajectories to TRAJ_RAW (msg_id = trajectory id: one published again
        is stored once). A publish that fails or times out is retried with backoff for up to
        PUBLISH_RETRY_S; past it the task is given up (False: left unacked, JetStream redelivers it)."""
        deadline = time.monotonic() + PUBLISH_RETRY_S
        for traj in trajs:
            delay = 0.2
            while True:
                try:
                    await self._live_bus().publish(busmod.SUBJECT_TRAJ_RAW, traj.to_bytes(),
                                                   msg_id=traj.trajectory_id)
                    break
                except (nats.errors.Error, asyncio.TimeoutError) as exc:
                    BUS_FAILURES.labels("publish").inc()
                    if time.monotonic() + delay > deadline:
                        TASKS_GIVEN_UP.inc()
                        log.warning("task %s given up for redelivery: publishing %s failed for %.0fs (%r)",
                                    task.task_id, traj.trajectory_id, PUBLISH_RETRY_S, exc)
                        return False
                    log.warning("publishing %s failed (%r); retrying in %.1fs", traj.trajectory_id, exc, delay)
                    await asyncio.sleep(delay)
                    delay = min(delay * 2, 5.0)
            TRAJECTORIES.labels(trajectory_pb2.TerminalReason.Name(traj.terminal_reason)).inc()
        return True

    async def _ack(self, msg: Any) -> None:
        """Acks a task whose trajectories are published. An ack NATS does not take (it is
        restarting) leaves the task to be redelivered after task_ack_wait_s; the store
        deduplicates its trajectories, so that is counted, not a crash."""
        try:
            await msg.ack()
        except (nats.errors.Error, asyncio.TimeoutError) as exc:
            BUS_FAILURES.labels("ack").inc()
            log.warning("ack of a task failed (%r); it will be redelivered", exc)

    async def _heartbeat(self, msg: Any) -> None:
        """Tells JetStream the task is still being worked on (a dead rollout stops doing so, and
        its task is redelivered after task_ack_wait_s). A beat NATS does not take is counted and
        the next one tried."""
        while True:
            await asyncio.sleep(self.cfg.rollout.task_ack_wait_s / 3)
            try:
                await msg.in_progress()
            except (nats.errors.Error, asyncio.TimeoutError) as exc:
                BUS_FAILURES.labels("heartbeat").inc()
                log.warning("task heartbeat failed (%r)", exc)

    async def _wait_for_version(self, version: int, timeout_s: float = 30.0) -> None:
        """A task admitted at learner version v is not sampled with weights older than v (the
        announcement may reach this process after the task does). After `timeout_s` it reads the
        announcement itself: one the watch has not delivered is handed to `weights_loop` (counted
        in `trajmesh_rollout_weight_watch_missed_versions_total`) and waited for once more. Then it gives up:
        the learner's per-token check still bounds the lag."""
        if await self._version_within(version, timeout_s):
            return
        try:
            latest = await announce.latest(self._live_bus())
        except (nats.errors.Error, nats.js.errors.Error, asyncio.TimeoutError) as exc:
            log.warning("weights v%d not loaded after %.0fs and the announcement unreadable (%r)", version,
                        timeout_s, exc)
            latest = None
        if latest is not None and latest.version >= version:
            if latest.version > self.watched_version:
                # A CI run's rollout once got no announcement from its watch (neither the watch nor
                # its poll delivered v1, v2): it sampled with v0 for minutes, and the store cut it all.
                WEIGHT_WATCH_MISSES.inc()
                log.error("weights v%d are announced but the watch has not delivered them in %.0fs; loading "
                          "them", latest.version, timeout_s)
                self.newest_weights.offer(latest)
            if await self._version_within(version, timeout_s):  # the load (under way, or just handed over)
                return
        log.warning("weights v%d not loaded after %.0fs; sampling with v%d", version, timeout_s, self.version)

    async def _version_within(self, version: int, timeout_s: float) -> bool:
        """Whether this process holds weights `version` or newer within `timeout_s`."""
        if self.version >= version:  # every task that needs no newer weights: no lock, no timer
            return True
        async with self.version_changed:
            try:
                async with asyncio.timeout(timeout_s):  # not wait_for: on 3.11 it can swallow a cancel
                    await self.version_changed.wait_for(lambda: self.version >= version)
            except TimeoutError:
                return False
        return True

    async def utilization_loop(self) -> None:
        """Exports busy/idle seconds once a second (the async-overlap evidence)."""
        while True:
            await asyncio.sleep(1.0)
            (BUSY_SECONDS if self.inflight else IDLE_SECONDS).inc(1.0)

    # ------------------------------------------------------------------ the agent loop
    async def run_sample(self, task: trajectory_pb2.Task, index: int) -> Trajectory:
        """One sample under its one deadline (`rollout.sample_deadline_s`, stamped on it for the
        grader, which ends it the same way past it): an episode still running then is cut and the
        sample ends INFRA_FAILURE with cause INFRA_DEADLINE (no tokens kept; the store refills its
        group). A refill (`task.refill_of`) names the member it replaces in its retry_lineage."""
        budget_s = self.cfg.rollout.sample_deadline_s
        deadline = time.time() + budget_s if budget_s > 0 else 0.0
        clock = asyncio.timeout(budget_s if budget_s > 0 else None)
        try:
            async with clock:
                traj = await self.run_episode(task, index)
        except TimeoutError:
            if not clock.expired():
                raise  # not the deadline's
            SAMPLE_DEADLINES.inc()
            log.warning("sample %s-%d past its %.0fs deadline: INFRA_FAILURE", task.task_id, index, budget_s)
            traj = Trajectory.new(task, trajectory_id=f"{task.task_id}-{index}", rollout_worker=self.worker_id,
                                  created_unix_seconds=deadline - budget_s)
            traj.fail_infra(trajectory_pb2.INFRA_DEADLINE, f"sample deadline {budget_s:.0f}s passed in the rollout")
        traj.pb.timing.deadline_unix_seconds = deadline
        if task.refill_of:
            traj.pb.retry_lineage.append(task.refill_of)
        return traj

    async def run_episode(self, task: trajectory_pb2.Task, index: int) -> Trajectory:
        runner = self.episode_runners.get(task.environment)
        if runner is not None:  # the source runs this environment's episodes itself
            result: Trajectory = await plugins.load(runner)(self, task, index)
            return result
        start = time.perf_counter()
        tid = f"{task.task_id}-{index}"
        traj = Trajectory.new(task, trajectory_id=tid, rollout_worker=self.worker_id,
                              created_unix_seconds=time.time())
        sp = task.sampling
        if self._in_process(task):  # a stateless environment: no session on the service to keep
            local = environment.InProcessSession(environment.environment_kind(task))
            started: tuple[Any, Any] | None = local, await local.Reset(
                services_pb2.ResetRequest(session_id=tid, task=task, seed=task.seed + index))
        else:
            started = await self._reset(task, tid, task.seed + index)
        if started is None:  # every environment replica failed: excluded as INFRA_FAILURE
            traj.fail_infra(trajectory_pb2.INFRA_ENVIRONMENT, "no environment replica answered a Reset")
            return traj
        env, reset = started
        traj.pb.initial_state_hash = reset.state_hash
        traj.pb.environment_revision = reset.environment_revision  # the serving environment's own
        traj.pb.state_hashes.append(reset.state_hash)
        seed = sampling_seed(self.cfg.seed, task.task_id, index)
        context = self._prompt_ids(reset.observation, json.loads(task.metadata_json or "{}").get("tools"))
        traj.append_prompt(context, turn_index=0)
        reason = trajectory_pb2.MAX_TURNS
        cause = trajectory_pb2.INFRA_CAUSE_UNSPECIFIED  # what failed, when it ends INFRA_FAILURE
        env_seconds = 0.0
        closed = False  # a Step that ends the episode closes the session on the environment's side
        try:
            for turn in range(max(1, sp.max_turns)):
                if turn and self._too_stale(traj):  # the learner could only quarantine it: stop here
                    log.info("cut %s short at turn %d: sampled since v%d, weights now v%d", tid, turn,
                             int(traj.behavior_versions_T[traj.loss_mask_T == 1].min()), self.version)
                    reason = trajectory_pb2.STALE
                    break
                ids, logps, versions, finish = await self._generate(context, sp, seed)
                context = context + ids
                if finish == "length":
                    if ids:
                        traj.append_sampled(ids, logps, versions, turn_index=turn)
                    reason = trajectory_pb2.MAX_TOKENS
                    break
                t0 = time.perf_counter()
                step = await env.Step(services_pb2.StepRequest(session_id=tid, action=self.tokenizer.decode(ids)),
                                      timeout=ENV_STEP_TIMEOUT_S)
                env_seconds += time.perf_counter() - t0
                info = json.loads(step.info_json or "{}")
                kind = _ACTION_TYPES.get(str(info.get("action_type", "TEXT")), trajectory_pb2.TEXT)
                if ids:  # the span is typed by what the environment saw (TEXT, CODE, TOOL_CALL)
                    span = traj.append_sampled(ids, logps, versions, action_type=kind, turn_index=turn)
                    _record_tool_call(traj, span.span_id, info)
                traj.pb.state_hashes.append(step.state_hash)
                traj.pb.step_rewards.append(step.reward)
                if step.done:
                    closed = True
                    reason = trajectory_pb2.TerminalReason.Value(self.format.end_reason(ids, info))
                    break
                obs = self._observation_ids(step.observation, kind, ids)
                traj.append_observation(obs, turn_index=turn)
                context = context + obs
        except grpc.aio.AioRpcError as exc:  # environment pod gone, deadline: excluded, never rewarded
            ENV_FAILURES.labels(exc.code().name.lower()).inc()
            log.warning("environment failure on %s: %s", tid, exc.code().name)
            reason, cause = trajectory_pb2.INFRA_FAILURE, trajectory_pb2.INFRA_ENVIRONMENT
        except EngineFailed as exc:  # one sample the engine could not serve: this trajectory only
            ENGINE_FAILURES.labels(exc.reason).inc()
            log.warning("engine failure on %s: %s", tid, exc)
            reason, cause = trajectory_pb2.INFRA_FAILURE, trajectory_pb2.INFRA_ENGINE
        finally:
            try:
                if not closed:
                    await env.Close(services_pb2.CloseRequest(session_id=tid), timeout=5.0)
            except grpc.aio.AioRpcError:
                ENV_FAILURES.labels("close").inc()
        traj.finish(reason, truncated=True if reason == trajectory_pb2.STALE else None)
        if cause != trajectory_pb2.INFRA_CAUSE_UNSPECIFIED:
            traj.fail_infra(cause)
        traj.pb.timing.rollout_seconds = time.perf_counter() - start
        traj.pb.timing.environment_seconds = env_seconds
        EPISODE_SECONDS.observe(time.perf_counter() - start)
        return traj

    def _too_stale(self, traj: Trajectory) -> bool:
        """Whether a trajectory's oldest sampled token lags the loaded weights by more than η: the
        learner (at this version or later) could only quarantine it as stale, so generating more
        of it is wasted (issue 16: such stragglers are cut short, ending STALE; the store records
        them as `filtered:stale_cut_short`)."""
        v_T = traj.behavior_versions_T[traj.loss_mask_T == 1]
        return bool(v_T.size) and self.version - int(v_T.min()) > self.cfg.effective_eta

    def _prompt_ids(self, observation: str, tools: list[dict[str, Any]] | None = None) -> list[int]:
        """The first context (`EpisodeFormat.prompt_ids`)."""
        return self.format.prompt_ids(observation, tools)

    def _observation_ids(self, text: str, kind: int, ids: list[int]) -> list[int]:
        """An observation's tokens after the turn `ids` the environment saw as action `kind`
        (`EpisodeFormat.observation_ids`)."""
        return self.format.observation_ids(text, trajectory_pb2.ActionType.Name(kind), ids)

    def _in_process(self, task: trajectory_pb2.Task) -> bool:
        """Whether this episode is played in this process (`rollout.stateless_environments_in_process`):
        a training episode whose environment is stateless, with no simulated latency or injected
        Reset failure asking for the service. A held-out episode (`task.evaluation`, the evaluator's)
        always goes to the environment service: every held-out score comes from an episode played
        there, and evaluation is too little traffic for the round trips to matter."""
        env_cfg = self.cfg.environment
        return (not task.evaluation and self.cfg.rollout.stateless_environments_in_process
                and env_cfg.simulated_step_latency.median_s == 0
                and env_cfg.inject_reset_failure_rate == 0 and environment.stateless(environment.environment_kind(task)))

    async def _reset(
        self, task: trajectory_pb2.Task, tid: str, seed: int
    ) -> tuple[Any, Any] | None:
        """Reset on the session's sticky replica; on an infrastructure error try the next replicas,
        and while none answers keep trying with backoff for `rollout.environment_wait_s` (the
        task's heartbeat keeps it meanwhile). None: still no replica by then."""
        req = services_pb2.ResetRequest(session_id=tid, task=task, seed=seed)

        def failed(exc: grpc.aio.AioRpcError) -> bool:
            ENV_FAILURES.labels(exc.code().name.lower()).inc()
            return True

        got = await sticky_call(self.envs, tid, lambda env: env.Reset(req, timeout=ENV_STEP_TIMEOUT_S),
                                wait_s=self.cfg.rollout.environment_wait_s, failed=failed, waited=ENV_WAIT_SECONDS.inc)
        if got is None:
            log.warning("no environment replica answered a Reset of %s for %.0fs", tid,
                        self.cfg.rollout.environment_wait_s)
        return got

    async def _generate(
        self, context: list[int], sp: trajectory_pb2.SamplingParams, seed: int
    ) -> tuple[list[int], list[float], list[int], str]:
        """One turn of sampling; resumes across weight updates (interruptible generation)."""
        turn = await self.sampler.sample(context, sp, seed)
        return turn.ids, turn.logps, turn.versions, turn.finish
