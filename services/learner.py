"""Learner service: batches from the store → decoupled PPO step → weights v+1 (docs/DESIGN.md §1.5, §3–5).

::

    store ── gRPC NextBatch(v) ──▶ split_stale (per token: v − u ≤ η, else quarantine `stale`)
                                      │
                                      ▼
         proximal log-probs (no grad, pre-update weights) ─ advantages ─ decoupled loss ─ step
                                      │
       weights/v{v+1} (safetensors, atomic rename) ── gate.set_version ── KV + WEIGHTS announcement
                                      │
    store ◀── gRPC Report(trained, quarantined) ;  metrics.jsonl ; checkpoint every N steps and on stop

The learner owns the version: it increases by exactly one per step. It stops after
`learner.max_steps` steps or `learner.max_seconds` of RL, writing a final checkpoint, or earlier on
a stop rule or a confirmed held-out regression: the evaluator's records on EVAL
(services/evaluator.py) feed a `HeldoutTracker` here, which also snapshots the best version's
weights as RUN_DIR/best.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
import nats.errors
import nats.js.errors
import torch
from prometheus_client import Counter, Gauge, Histogram

from trajmesh import security
from trajmesh.contract import Trajectory
from trajmesh.gate import AsyncStalenessGate
from trajmesh.learner import consistency
from trajmesh.learner.checkpoint_compat import add_policy_prefix
from trajmesh.learner.evaluate import HeldoutTracker, keep_best
from trajmesh.learner.heap import release_free_heap
from trajmesh.learner.logprobs import PolicyLogprobs, policy_of
from trajmesh.learner.metrics import (
    DISTILL_METRIC_NAMES,
    ENTROPY_BY_ACTION_TYPE_NAMES,
    PRIME_METRIC_NAMES,
    REFERENCE_METRIC_NAMES,
)
from trajmesh.learner.microbatch import bind_local_cuda_device, worker_executor
from trajmesh.learner.objective import ObjectiveConfig
from trajmesh.learner.prm import ImplicitPRM
from trajmesh.learner.recipe import prepare
from trajmesh.learner.reference import ReferencePolicy
from trajmesh.learner.shaping import MagicEntropyController
from trajmesh.learner.simulated import simulated_train_batch
from trajmesh.learner.step import StepPlan, train_batch
from trajmesh.learner.train_engine import (
    DeepSpeedTrainEngine,
    TrainEngine,
    build_train_engine,
    shutdown_distributed,
    wants_deterministic,
)
from trajmesh.learner.weights import TOKENIZER_FILES, export_policy
from trajmesh.rollout.engines.hf_model import load_causal_lm
from trajmesh.service import FIRST_STEP_ALLOWANCE_S, STOP_NOTICE, STOP_WORK_S, Service
from trajmesh.services.store.client import StoreClient
from trajmesh.services.store.record import RunRecord
from trajmesh.stoprules import (
    RULES,
    TRUNCATED_RATIO,
    VERIFIER_DISAGREEMENT_RATIO,
    check_stop_rules,
    stop_record,
    write_stop_reason,
)
from trajmesh.v1 import services_pb2
from trajmesh.weights import announce
from trajmesh.weights.delta import DeltaWriter, WeightSyncError, is_delta_dir, prunable, reconstruct
from trajmesh.weights.layout import (
    CHECKSUM_NAME,
    checksum,
    temp_dir_name,
    version_dir_name,
    version_dirs,
    weights_root,
)

log = logging.getLogger("trajmesh.learner")

STEPS = Counter("trajmesh_learner_steps_total", "Optimizer steps taken")
VERSION = Gauge("trajmesh_learner_policy_version", "Current policy version")
TRAINED = Counter("trajmesh_learner_trajectories_trained_total", "Trajectories trained on")
QUARANTINED = Counter("trajmesh_learner_trajectories_quarantined_total", "Trajectories refused at consume time",
                      ["reason"])
LAG = Histogram("trajmesh_learner_policy_lag_versions", "Per-token policy lag v − u of trained tokens",
                buckets=(0, 1, 2, 3, 4, 6, 8, 16))
STEP_SECONDS = Histogram("trajmesh_learner_step_seconds", "Compute time of one learner step")
WAIT_SECONDS = Counter("trajmesh_learner_idle_seconds_total", "Seconds waiting for a batch")
BUSY_SECONDS = Counter("trajmesh_learner_busy_seconds_total", "Seconds computing steps")
ANCHOR_REQUESTS = Counter("trajmesh_learner_weight_anchor_requests_total",
                          "Rollout requests for a full anchor honoured (weights.sync delta: the next version is one)")
WEIGHT_SYNC_SECONDS = Histogram("trajmesh_learner_weight_publish_seconds", "Save + announce time")
REFERENCE_RESETS = Counter("trajmesh_learner_reference_reset_steps_total",
                           "Learner steps that reset the reference (and the optimizer): learner.reference.reset_every")
TOKENS_TRAINED = Counter("trajmesh_learner_tokens_trained_total", "Loss-masked (action) tokens trained on")
TRAJECTORY_AGE = Histogram("trajmesh_learner_trajectory_age_seconds",
                           "Seconds from a trajectory's creation (rollout start) to the step that trains it",
                           buckets=(1, 2, 5, 10, 20, 30, 60, 120, 300, 600, 1800))
RULE_BREACHES = Counter("trajmesh_learner_stop_rule_breaches_total", "Stop-rule breaches (each stops the run)",
                        ["rule"])
for _rule in RULES:
    RULE_BREACHES.labels(rule=_rule.name)
QUARANTINED.labels(reason="stale")  # exported at 0: the stale-rate panel and alert read it
STEP_GAUGES: dict[str, Gauge] = {}
WEIGHTS_GRACE_S = 120.0


async def honour_anchor_request(bus: Any, delta: DeltaWriter, seen: int) -> int:
    """A rollout asked for a full anchor since revision `seen` (`announce.request_anchor`): the next
    version `delta` writes is one. Returns the revision now seen. A NATS error leaves it for the
    next version (the request stays in the KV)."""
    try:
        revision = await announce.anchor_request_revision(bus)
    except (nats.errors.Error, nats.js.errors.Error, asyncio.TimeoutError) as exc:
        log.warning("could not read anchor requests (%r); checked again at the next version", exc)
        return seen
    if revision > seen:
        delta.anchor_next()
        ANCHOR_REQUESTS.inc()
        log.info("a rollout asked for a full anchor (request %d): the next version is one", revision)
    return max(revision, seen)


def _gauge(name: str) -> Gauge:
    if name not in STEP_GAUGES:
        STEP_GAUGES[name] = Gauge(name, f"Value at the last learner step: {name}")
    return STEP_GAUGES[name]


# Exported from the start (0 until the first step measures them): dashboards and stop rules read them,
# and every action type has its entropy series even before a batch holds that type.
RESPONSE_LENGTH_NAMES = tuple(f"trajmesh_learner_response_length_{q}_tokens"
                              for q in ("mean", "p50", "p90", "max", "correct_mean", "incorrect_mean"))
"""learner/step.py response_length_metrics (the overview's response-length panels)."""
for _name in (*consistency.NAMES, TRUNCATED_RATIO, VERIFIER_DISAGREEMENT_RATIO,
              *ENTROPY_BY_ACTION_TYPE_NAMES.values(), *REFERENCE_METRIC_NAMES, *DISTILL_METRIC_NAMES,
              *RESPONSE_LENGTH_NAMES, *PRIME_METRIC_NAMES):
    _gauge(_name)


@dataclass
class StepOutcome:
    """What one learner step returns: its telemetry apart from the ids the store must be told."""

    metrics: dict[str, Any]
    """The step's metrics (metrics.jsonl, Prometheus, stop rules)."""
    trained_ids: list[str] = field(default_factory=list)
    """Trajectories trained on (a segmented trajectory once, however many rows it has)."""
    stale_ids: list[str] = field(default_factory=list)
    """Trajectories quarantined as stale at consume time (lag above η)."""


class LearnerService(Service):
    """One learner rank. With ``learner.world_size`` > 1 (RANK/WORLD_SIZE from the launcher or
    torchrun) rank 0 is the leader: it alone talks to the store, Redis and NATS, saves and replays
    batches, publishes weights and writes metrics.jsonl. It drives the others with commands
    broadcast over torch.distributed (:meth:`_command`): ``step`` (the batch's bytes and the
    entropy coefficient), ``idle`` (no batch yet: the heartbeat that keeps the followers' collective
    from timing out), ``checkpoint`` and ``stop``. Every rank runs every collective in that order."""

    name = "learner"
    graceful_stop_s = 120.0  # finish the step in progress: train, publish, report, then checkpoint;
    # a stop during a step extends it to the step's measured length (`stop_allowance_s`)
    stop_work_s = STOP_WORK_S["learner"]  # stop()'s final checkpoint (a large model's), beyond service.stop_timeout_s

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.rank = int(os.environ.get("RANK", "0")) if self.cfg.learner.world_size > 1 else 0
        """This process's rank (0: the leader)."""
        self.world_size = self.cfg.learner.world_size
        self.run_dir = Path(self.cfg.run_dir)
        self.ckpt_dir = self.run_dir / "checkpoints"
        self.metrics_path = self.run_dir / "metrics.jsonl"
        self.version = 0
        self.steps_done = 0
        self.rl_seconds = 0.0
        self.trajectories_trained = 0
        self.checkpointed_version = -1
        """The version the last checkpoint holds (-1: none written by this process)."""
        self.announced_floor = -1
        """On resume: the newest version announced before the crash. Replayed versions below it are
        bitwise the ones already announced, so they are not announced again (a rollout would step
        back to older weights and sample tasks admitted at the newer version with them)."""
        self.stopped_group = False
        """Leader: the followers were told to stop (sent once)."""
        # What setup() opens, None until then (the leader's connections; followers open none).
        self.redis: Any = None
        self.record: RunRecord | None = None
        """The store's run-level record (the run's end, the data cursor), over `redis` (the leader's)."""
        self.gate: AsyncStalenessGate | None = None
        self.bus: Any = None
        self.store: StoreClient | None = None
        """Leader: the store replicas (services/store/client.py)."""
        self.engine: TrainEngine | None = None
        self.reference: ReferencePolicy | None = None
        """The frozen reference policy (`learner.reference.enabled`; None: off)."""
        self.prm: ImplicitPRM | None = None
        """PRIME's implicit PRM (`learner.advantage.type` prime; None: off)."""
        self.tracker = HeldoutTracker(self.cfg.eval.stop_regression_margin, self.cfg.eval.stop_confirmations)
        """Leader: the best held-out score and the regression count, from the EVAL records."""
        self.delta = DeltaWriter(self.cfg.weights.anchor_every) if self.cfg.weights.sync == "delta" else None
        """Leader, ``weights.sync: delta``: the last published version's bytes, the next delta's base."""
        self.anchor_request_seen = 0
        """Leader: the KV revision of the last anchor request honoured (a restarted learner's first
        version is an anchor anyway: its delta writer has no base)."""
        self.regression: dict[str, Any] | None = None
        """Leader: the stop record of a confirmed held-out regression (None: none); the step loop
        stops on it."""
        self.step_started: float | None = None
        """Leader: time.monotonic() when the step in progress began (None between steps)."""
        self.longest_step_s = 0.0
        """Leader: the longest step so far (train + publish + report), what a stop waits for."""

    @property
    def leader(self) -> bool:
        return self.rank == 0

    def _engine(self) -> TrainEngine:
        assert self.engine is not None, "used before setup()"
        return self.engine

    def _record(self) -> RunRecord:
        assert self.record is not None, "used before setup()"
        return self.record

    def _gate(self) -> AsyncStalenessGate:
        assert self.gate is not None, "used before setup()"
        return self.gate

    def request_stop(self, sig: int) -> None:
        """A follower notes the signal but keeps following: the leader decides when the group stops
        (``stop`` command), so no rank leaves a collective the others are in. The leader lets the
        step in progress finish (`stop_allowance_s`) and tells the launcher how long that may take
        (`STOP_NOTICE` in the run directory)."""
        if not self.leader:
            self.stop_signal = sig
            return
        if self.stop_deadline is None:
            self.graceful_stop_s = self.stop_allowance_s()
            notice = {"pid": os.getpid(), "signal": sig, "in_step": self.step_started is not None,
                      "deadline_unix": time.time() + self.graceful_stop_s + self.stop_timeout_s}
            try:
                (self.run_dir / STOP_NOTICE).write_text(json.dumps(notice) + "\n")
            except OSError as exc:
                log.warning("could not write %s: %s", STOP_NOTICE, exc)
            if self.step_started is not None:
                log.info("stop asked during step %d (%.0fs in): finishing it within %.0fs, then checkpointing",
                         self.steps_done, time.monotonic() - self.step_started, self.graceful_stop_s)
        super().request_stop(sig)

    def stop_allowance_s(self) -> float:
        """How long a stop waits for `run()` (the step in progress; `learner.stop_step_allowance_s`):
        the configured figure, else twice the longest step so far and at least `graceful_stop_s`'s
        class default, else (no step finished yet) `FIRST_STEP_ALLOWANCE_S`; counted from the stop.
        Between steps the class default (nothing long to finish)."""
        configured = self.cfg.learner.stop_step_allowance_s
        if configured is not None:
            return configured
        if self.step_started is None:
            return type(self).graceful_stop_s
        expected = 2 * self.longest_step_s if self.longest_step_s > 0 else FIRST_STEP_ALLOWANCE_S
        return max(type(self).graceful_stop_s, expected)

    async def setup(self) -> None:
        cfg = self.cfg
        assert cfg.infra.nats_url and cfg.infra.redis_url and cfg.model.path
        torch.manual_seed(cfg.learner.seed)
        # Training and broadcasts run in asyncio.to_thread workers; CUDA's current device is per
        # thread (0 in a new one), so this thread and every worker bind cuda:LOCAL_RANK first.
        bind_local_cuda_device()
        asyncio.get_running_loop().set_default_executor(worker_executor())
        if self.leader:
            self.redis = security.redis_client(cfg)
            self.record = RunRecord(self.redis, cfg.infra.namespace)
            self.gate = AsyncStalenessGate.from_config(self.redis, cfg)
            self.bus = await security.connect_bus(cfg, "learner", name=self.worker_id)
            self.store = StoreClient(cfg, self._rpc)

        resumed = (self.ckpt_dir / "latest").exists()
        if resumed and self.leader:  # before the followers can load it: they wait in the group's start below
            for path in add_policy_prefix(self.ckpt_dir / "latest"):
                log.warning("checkpoint %s: model keys renamed to the policy.* form", path)
        # Every rank: the process group (DeepSpeed engine) and the model; a resumed group loads the
        # same checkpoint on every rank (DeepSpeed reads each rank's shards and rank 0's client state).
        self._build_trainer()
        self._check_world()
        if resumed:
            state = await asyncio.to_thread(self._load_checkpoint)
            log.info("rank %d resumed from checkpoint at version %d", self.rank, self.version)
        if not self.leader:
            if resumed:
                await asyncio.to_thread(self._export_weights, self.version)  # the leader's publish (ZeRO-3 gathers)
            return
        if resumed:
            # The data cursor lives in Redis; a wiped Redis must not replay already-drawn tasks.
            await self._record().restore_sampler_cursor(int(state.get("sampler_cursor", 0)))
            # No gate rebase: the counters live in Redis (AOF, fsync always) and the store finalizes
            # idempotently, so they stay true across a learner restart; the batches trained since
            # the checkpoint are replayed from disk (run()), bringing the version back to where
            # it was. (StalenessGate.rebase_after_recovery is for a Redis that lost its data.)
            self.announced_floor = await announce.latest_version(self.bus)
            await self._publish_weights()
        elif await announce.latest(self.bus) is None:
            await self._announce(self.version, cfg.model.path)
        await self._gate().set_version(self.version)
        await self._record().reopen()  # a resumed run with a larger budget admits again
        VERSION.set(self.version)

    def _load_checkpoint(self) -> dict[str, Any]:
        """Engine, counters, entropy controller and reference from RUN_DIR/checkpoints/latest
        (every rank); returns the checkpoint's client state."""
        state = self._engine().load_checkpoint(str(self.ckpt_dir / "latest"))
        self.version = int(state["version"])
        self.steps_done = int(state["steps_done"])
        self.rl_seconds = float(state["rl_seconds"])
        self.trajectories_trained = int(state["trajectories_trained"])
        self.checkpointed_version = self.version
        if self.entropy_ctl is not None and state.get("entropy_controller"):
            self.entropy_ctl.load_state_dict(state["entropy_controller"])
        if self.reference is not None:
            self.reference.load(self.ckpt_dir / "latest")
        if self.prm is not None:
            self.prm.load(self.ckpt_dir / "latest")
        return state

    def _build_trainer(self) -> None:
        """Model, train engine, objective and entropy controller from config (no network: the
        offline replay in the tests builds the same learner)."""
        cfg = self.cfg
        assert cfg.model.path
        lc = cfg.learner
        cuda = torch.cuda.is_available()
        precision = lc.precision if lc.precision != "auto" else ("bf16" if cuda else "fp32")
        attention = lc.attention if lc.attention != "auto" else ("sdpa" if cuda else "eager")
        # Loaded in fp32 on every precision: the bf16 engines keep fp32 master weights.
        model = load_causal_lm(cfg.model.path, dtype=torch.float32, attn_implementation=attention)
        if lc.gradient_checkpointing:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        self.pad_id = int(model.config.pad_token_id if model.config.pad_token_id is not None else 0)
        policy = PolicyLogprobs(model, lc.logprob_chunk_tokens)
        # The reference: a copy of the initial policy taken before DeepSpeed partitions the policy;
        # under ZeRO-3, built after the engine from its partitions instead (never whole on a rank).
        zero3 = lc.engine.type == "deepspeed" and lc.engine.zero_stage == 3
        self.reference = (ReferencePolicy(policy, lc.engine.type, zero_stage=lc.engine.zero_stage,
                                          precision=precision) if lc.reference.enabled and not zero3 else None)
        if lc.advantage.type == "prime":  # before the policy's engine: a copy of the start, reseeded by it
            shared = self.reference if self.reference is not None and lc.reference.reset_every == 0 else None
            self.prm = ImplicitPRM(policy, lc.prime, engine_type=lc.engine.type, zero_stage=lc.engine.zero_stage,
                                   precision=precision, seed=lc.seed, deterministic=wants_deterministic(
                                       lc.deterministic, cuda=cuda), micro_batch_tokens=lc.micro_batch_tokens,
                                   reference=shared)
        self.engine = build_train_engine(
            policy, type=lc.engine.type, lr=lc.lr,
            warmup_steps=lc.warmup_steps, weight_decay=lc.weight_decay, grad_clip=lc.grad_clip,
            zero_stage=lc.engine.zero_stage, seed=lc.seed, precision=precision,
            deterministic=wants_deterministic(lc.deterministic, cuda=cuda),
            schedule=lc.lr_schedule, decay_steps=lc.optimizer_updates,
            min_lr_ratio=lc.min_lr_ratio,
        )
        if lc.reference.enabled and zero3:
            assert isinstance(self.engine, DeepSpeedTrainEngine)
            self.reference = ReferencePolicy.after_zero3_engine(self.engine, precision=precision)
        self.precision = precision
        self.plan = StepPlan(micro_batch_tokens=lc.micro_batch_tokens, minibatches=lc.ppo.minibatches,
                             epochs=lc.ppo.epochs)
        self.objective: ObjectiveConfig = lc.objective  # the config's type, used by the loss as is
        # The step itself: the real one, or a benchmark's modelled GPU step (learner/simulated.py).
        self.train_batch = simulated_train_batch(lc.simulated_step) if lc.simulated_step.enabled else train_batch
        ec = lc.entropy
        self.entropy_ctl = (MagicEntropyController(target_entropy=ec.target_entropy, delta=ec.delta,
                                                   max_coef=ec.max_coef) if ec.type == "magic" else None)

    async def run(self) -> None:
        """Steps until the step or time budget is spent. Waits on NextBatch (the store blocks until
        a batch is ready); what unblocks it is rollout + grading of admitted groups. A follower
        rank runs the leader's commands instead (:meth:`_follow`)."""
        if not self.leader:
            await self._follow()
            return
        evals = asyncio.ensure_future(self._watch_evals())
        evals.add_done_callback(self._evals_done)
        try:
            await self._steps()
        finally:
            evals.cancel()

    async def _steps(self) -> None:
        lc = self.cfg.learner
        eta = self.cfg.effective_eta
        temperature = self.cfg.tasks.sampling.temperature or 1.0
        loop_start = time.monotonic() - self.rl_seconds
        replay = self._batches_to_replay()
        assert self.store is not None
        while (self.steps_done < lc.max_steps and time.monotonic() - loop_start < lc.max_seconds
               and not self.stopping.is_set()):
            if self.regression is not None:
                await self._stop_on_regression()
                return
            wait_start = time.perf_counter()
            if replay:  # batches trained after the last checkpoint, before a crash: same data order
                resp = replay.pop(0)
                log.info("replaying step %d's batch from %s", self.steps_done, self.batches_dir)
            else:
                resp = await self.store.next_batch(self.version)
            waited = time.perf_counter() - wait_start
            WAIT_SECONDS.inc(waited)
            if not resp.trajectories:
                await self._command("idle")
                continue
            self._save_batch(resp)
            trajs = [Trajectory(pb) for pb in resp.trajectories]
            alpha = self.entropy_ctl.coef if self.entropy_ctl is not None else 0.0
            await self._command("step", resp.SerializeToString(), alpha)
            self.step_started = time.monotonic()
            log.info("step %d: training on %d trajectories", self.steps_done, len(trajs))
            start = time.perf_counter()
            outcome = await asyncio.to_thread(self._train_step, trajs, eta, temperature, alpha)
            metrics = outcome.metrics
            step_s = time.perf_counter() - start
            BUSY_SECONDS.inc(step_s)
            STEP_SECONDS.observe(step_s)
            pub_start = time.perf_counter()
            await self._publish_weights()
            WEIGHT_SYNC_SECONDS.observe(time.perf_counter() - pub_start)
            await self.store.report(services_pb2.ReportRequest(
                learner_version=self.version - 1,  # the version the batch was trained at
                trained_ids=outcome.trained_ids,
                quarantined_ids=outcome.stale_ids,
                quarantine_reasons=["stale"] * len(outcome.stale_ids)),
                {t.trajectory_id: t.group_id for t in trajs})
            self.longest_step_s = max(self.longest_step_s, time.monotonic() - self.step_started)
            self.step_started = None
            self.rl_seconds = time.monotonic() - loop_start
            metrics.update(step=self.steps_done, version=self.version, rl_seconds=self.rl_seconds,
                           wait_seconds=waited, step_seconds=step_s, time=time.time())
            if self.world_size > 1:
                metrics["learner_ranks"] = self.world_size
            with open(self.metrics_path, "a") as fh:
                fh.write(json.dumps({"kind": "learner_step", **metrics}) + "\n")
            if self.steps_done % lc.checkpoint_every == 0:
                await self._checkpoint_async()
            if await self._stop_rules_broken(metrics):
                await self._record().mark_finished("stop_rule")
                return
        if not self.stopping.is_set():  # budget spent: the run is over, the store stops admitting
            await self._record().mark_finished("budget")
        log.info("learner done: %d steps, version %d", self.steps_done, self.version)

    # ------------------------------------------------------------------ held-out evaluation
    async def _watch_evals(self) -> None:
        """Consumes the EVAL records (all of them, oldest first: a restarted learner rebuilds the
        same tracker), the first per version: a new best snapshots that version's weights as
        RUN_DIR/best; a confirmed regression (`eval.stop_regression_margin`,
        `eval.stop_confirmations`) sets `self.regression`, which the step loop stops on."""
        seen: set[int] = set()
        metric = self.cfg.eval.selection_metric
        async for raw in self.bus.eval_records():
            record = json.loads(raw)
            if "score" not in record:  # every held-out episode an infra failure: nothing to compare
                continue
            version, score = int(record["version"]), float(record["score"])
            if version in seen:
                continue
            seen.add(version)
            improved, stop = self.tracker.observe(version, score)
            if improved:
                self._keep_best(version)
            if stop and self.regression is None:
                msg = self.tracker.regression_message(metric, score)
                log.error("held-out regression: %s", msg)
                self.regression = {"reason": "heldout_regression", "rules": ["heldout_regression"],
                                   "messages": [msg], "evaluated_version": version, "best": self.tracker.best}

    def _evals_done(self, task: asyncio.Task[None]) -> None:
        """The EVAL watch never ends by itself: an error stops the learner (exit non-zero)."""
        if not task.cancelled() and task.exception() is not None:
            self.fail(task.exception())  # type: ignore[arg-type]

    def _keep_best(self, version: int) -> None:
        """RUN_DIR/best := the weights of `version` (the base model stays where it is)."""
        assert self.tracker.best is not None
        if version == 0:
            self.tracker.best["path"] = self.cfg.model.path
            return
        dirs = version_dirs(weights_root(self.run_dir), version)
        try:
            if not dirs:
                raise FileNotFoundError(f"no weights dir of v{version}")
            if is_delta_dir(dirs[-1]):  # weights.sync delta: the full checkpoint, rebuilt
                reconstruct(dirs[-1], self.run_dir / "best")
                self.tracker.best["path"] = str(self.run_dir / "best")
            else:
                self.tracker.best["path"] = str(keep_best(self.run_dir, dirs[-1]))
        except (OSError, WeightSyncError) as exc:  # pruned before its evaluation arrived
            log.warning("best held-out version v%d not kept as %s/best: %s", version, self.run_dir, exc)

    async def _stop_on_regression(self) -> None:
        """stop_reason.json (+ a stop record in metrics.jsonl), a checkpoint, and the run marked
        finished in Redis, as a stop rule does; run() then returns (exit 0)."""
        assert self.regression is not None
        write_stop_reason(self.run_dir, {**self.regression, "step": self.steps_done, "version": self.version,
                                         "time": time.time()})
        if self.steps_done > 0:
            await self._checkpoint_async()
        await self._record().mark_finished("heldout_regression")

    # ------------------------------------------------------------------ ranks
    def _broadcast(self, command: list[Any]) -> list[Any]:
        """The leader's command (rank 0's `command`; the others pass a placeholder) on every rank."""
        import torch.distributed as dist

        box = [command]
        dist.broadcast_object_list(box, src=0)
        return list(box[0])

    async def _command(self, op: str, *args: Any) -> None:
        """Leader: send a command to the followers (nothing with one rank). They run it in the same
        order as the leader, so every collective it involves meets its peers."""
        if self.world_size == 1:
            return
        assert self.leader
        if op == "stop":
            if self.stopped_group:
                return
            self.stopped_group = True
        await asyncio.to_thread(self._broadcast, [op, *args])

    async def _follow(self) -> None:
        """A follower rank: run the leader's commands until it says ``stop``. A dead leader makes
        the broadcast fail (the process exits non-zero and the launcher restarts the group)."""
        eta = self.cfg.effective_eta
        temperature = self.cfg.tasks.sampling.temperature or 1.0
        while True:
            op, *args = await asyncio.to_thread(self._broadcast, [None])
            if op == "idle":
                continue
            if op == "step":
                resp = services_pb2.NextBatchResponse.FromString(args[0])
                trajs = [Trajectory(pb) for pb in resp.trajectories]
                await asyncio.to_thread(self._train_step, trajs, eta, temperature, float(args[1]))
                await asyncio.to_thread(self._export_weights, self.version)
            elif op == "checkpoint":
                await asyncio.to_thread(self._checkpoint)
            elif op == "stop":
                log.info("rank %d: the leader stopped the group at version %d", self.rank, self.version)
                return
            else:
                raise RuntimeError(f"rank {self.rank}: unknown command {op!r} from the leader")

    def _check_world(self) -> None:
        """The process group the engine joined is the configured one (a learner started by hand
        without RANK/WORLD_SIZE would otherwise train alone while the config says otherwise)."""
        if self.world_size == 1:
            return
        import torch.distributed as dist

        got = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
        if got != (self.rank, self.world_size):
            raise RuntimeError(f"learner.world_size is {self.world_size} and RANK {self.rank}, but this process "
                               f"joined rank {got[0]} of {got[1]}: start the learner ranks with RANK, WORLD_SIZE, "
                               "MASTER_ADDR and MASTER_PORT (trajmesh train or torchrun do)")

    def _barrier(self) -> None:
        if self.world_size > 1:
            import torch.distributed as dist

            dist.barrier()

    async def _rpc(self, call: Any, request: Any) -> Any:
        """A store call that rides out a store restart (UNAVAILABLE) until this learner stops."""
        delay = 0.2
        while True:
            try:
                return await call(request, timeout=60.0)
            except grpc.aio.AioRpcError as exc:
                if exc.code() not in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED) \
                        or self.stopping.is_set():
                    raise
                log.warning("store unavailable (%s); retrying in %.1fs", exc.code().name, delay)
                await asyncio.sleep(delay)
                delay = min(delay * 2, 5.0)

    # ------------------------------------------------------------------ batches since the checkpoint
    @property
    def batches_dir(self) -> Path:
        return self.run_dir / "learner_batches"

    def _save_batch(self, resp: Any) -> None:
        """Each step's batch goes to disk before it is trained (atomic rename). After a crash, the
        batches since the last checkpoint are replayed in order, so the resumed learner reaches the
        same weights as an uninterrupted run; a checkpoint deletes the older ones."""
        self.batches_dir.mkdir(parents=True, exist_ok=True)
        path = self.batches_dir / f"step-{self.steps_done:08d}.pb"
        if path.exists():
            return
        tmp = path.with_suffix(".tmp")
        tmp.write_bytes(resp.SerializeToString())
        os.replace(tmp, path)

    def _batches_to_replay(self) -> list[Any]:
        if not self.batches_dir.exists():
            return []
        out = []
        for path in sorted(self.batches_dir.glob("step-*.pb")):
            if int(path.stem.split("-")[1]) >= self.steps_done:
                out.append(services_pb2.NextBatchResponse.FromString(path.read_bytes()))
        return out

    async def _stop_rules_broken(self, metrics: dict[str, Any]) -> bool:
        """Survey §11.4: on a breach, write the reason, checkpoint, and end run() (exit 0)."""
        breaches = check_stop_rules(metrics, self.cfg.learner.stop_rules, self.steps_done)
        if not breaches:
            return False
        for b in breaches:
            RULE_BREACHES.labels(rule=b.rule).inc()
            log.error("stop rule breached at step %d: %s", self.steps_done, b.message)
        write_stop_reason(self.run_dir, stop_record(breaches, step=self.steps_done, version=self.version))
        await self._checkpoint_async()
        return True

    def _train_step(self, trajs: list[Trajectory], eta: int, temperature: float,
                    entropy_coef: float | None = None) -> StepOutcome:
        """One step on every rank (each passes the whole batch; train_batch takes this rank's
        share). `entropy_coef`: the leader's α (None: this process's controller)."""
        lc = self.cfg.learner
        leader = self.leader
        reset = self._reset_reference()
        recipe = prepare(trajs, self.cfg, version=self.version, eta=eta, pad_id=self.pad_id,
                         process_rewards=self.prm.step if self.prm is not None else None)
        keep, stale = recipe.keep, recipe.stale
        for _ in stale if leader else []:
            QUARANTINED.labels(reason="stale").inc()
        outcome = StepOutcome({"trajectories_in_batch": len(trajs), "trajectories_stale": len(stale)},
                              stale_ids=[t.trajectory_id for t in stale])
        metrics = outcome.metrics
        if self.reference is not None:
            metrics.update(reference_reset=reset, trajmesh_learner_reference_version=self.reference.version)
        metrics.update(recipe.metrics)
        if recipe.batch is not None:
            assert recipe.adv_BT is not None
            batch, adv_BT = recipe.batch, recipe.adv_BT
            engine = self._engine()
            model = engine.module
            model.train()
            if entropy_coef is not None:
                alpha = entropy_coef
            else:
                alpha = self.entropy_ctl.coef if self.entropy_ctl is not None else 0.0
            if lc.consistency_probe_trajectories > 0:  # pre-update weights = version self.version
                metrics.update(consistency.probe(model, keep, version=self.version, pad_id=self.pad_id,
                                                 temperature=temperature,
                                                 max_trajectories=lc.consistency_probe_trajectories))
            policy_start = time.perf_counter()
            step_metrics = self.train_batch(engine, batch, adv_BT, self.objective, self.plan,
                                            temperature=temperature, version=self.version,
                                            max_lag=max(eta, 1) + 1, entropy_coef=alpha,
                                            reference=self.reference, kl=lc.reference)
            if self.prm is not None:  # PRIME accounts its two updates apart (the PRM's: the recipe's metrics)
                step_metrics["trajmesh_learner_policy_update_seconds"] = time.perf_counter() - policy_start
            if self.entropy_ctl is not None and not lc.simulated_step.enabled:
                self.entropy_ctl.update(step_metrics["trajmesh_learner_entropy_nats"])
                step_metrics["trajmesh_learner_entropy_coef"] = alpha
            mask = batch.mask_BT > 0
            lags = (self.version - batch.versions_BT[mask]).tolist()
            for lag in lags if leader else []:
                LAG.observe(lag)
            metrics.update(step_metrics)
            metrics.update(
                reward_mean=float(batch.trajectory_rewards().mean()), max_token_lag=int(max(lags)) if lags else 0,
                tokens_trained=int(mask.sum()), trajectories_trained=len(keep),
            )
            outcome.trained_ids = batch.unique_trajectory_ids()  # a segmented trajectory has several rows
            self.trajectories_trained += len(keep)
            if leader:  # the service's counters count each step once, on rank 0
                TRAINED.inc(len(keep))
                TOKENS_TRAINED.inc(int(mask.sum()))
                now = time.time()
                for t in keep:
                    if t.pb.timing.created_unix_seconds > 0:
                        TRAJECTORY_AGE.observe(max(0.0, now - t.pb.timing.created_unix_seconds))
        # The version advances by exactly one per step, even if every trajectory was stale.
        self.version += 1
        self.steps_done += 1
        release_free_heap()  # the step's activations, freed but resident until trimmed (learner/heap.py)
        if not leader:
            return outcome
        STEPS.inc()
        VERSION.set(self.version)
        for k, v in metrics.items():
            if k.startswith("trajmesh_") and isinstance(v, (int, float)):
                _gauge(k).set(v)
        return outcome

    def _reset_reference(self) -> bool:
        """ProRL: at a positive multiple of `learner.reference.reset_every`, before training from
        that version, the reference becomes the current policy and (``reset_optimizer``) the
        optimizer's state is cleared; True if this step reset. The rule depends on the version
        only, and the reference's version is checkpointed, so a resumed or replayed learner resets
        where an uninterrupted one did."""
        rc = self.cfg.learner.reference
        ref = self.reference
        if ref is None or rc.reset_every <= 0 or self.version <= 0 or self.version % rc.reset_every:
            return False
        if ref.version == self.version:
            return False
        ref.reset_from(self._engine(), self.version)
        if rc.reset_optimizer:
            self._engine().reset_optimizer_state()
        if self.leader:
            REFERENCE_RESETS.inc()
            log.info("reference reset to version %d%s", self.version,
                     " (optimizer state cleared)" if rc.reset_optimizer else "")
        return True

    # ------------------------------------------------------------------ weights and checkpoints
    async def _publish_weights(self) -> None:
        if self.delta is not None:
            self.anchor_request_seen = await honour_anchor_request(self.bus, self.delta, self.anchor_request_seen)
        path = await asyncio.to_thread(self._save_weights, self.version)
        # The gate first: the store judges a trajectory's behaviour versions against the gate's
        # version, so no rollout may sample with a version the gate has not reached. A learner
        # killed between the two then leaves the gate ahead of the announcement (its restart
        # replays towards it), never work sampled with weights the store calls from the future.
        await self._gate().set_version(self.version)
        await self._announce(self.version, str(path))

    def _export_weights(self, version: int) -> None:
        """A follower's part in the leader's weights export: under ZeRO-3 the per-module gathers
        are collective, so it gathers without writing; otherwise nothing."""
        if self.cfg.learner.engine.zero_stage == 3:
            export_policy(policy_of(self._engine().model), weights_root(self.run_dir) / temp_dir_name(version, 0),
                          zero3=True, write=False, dtype=torch.bfloat16 if self.precision == "bf16" else torch.float32)

    def _save_weights(self, version: int) -> Path:
        """HF safetensors dir for `version`, written to a temp dir and renamed (atomic); the file's
        sha256 (computed while writing) beside it for the announcement."""
        root = weights_root(self.run_dir)
        root.mkdir(parents=True, exist_ok=True)
        # A fresh name per save: a learner replaying after a crash never rewrites a directory a
        # rollout engine may be reading.
        final = root / version_dir_name(version)
        tmp = root / temp_dir_name(version)
        shutil.rmtree(tmp, ignore_errors=True)
        # Streamed in the training dtype, hashed while written, ZeRO-3 gathered module by module.
        # weights.sync delta: only what changed since the last version (self.delta keeps its bytes).
        sha = export_policy(policy_of(self._engine().model), tmp, zero3=self.cfg.learner.engine.zero_stage == 3,
                            dtype=torch.bfloat16 if self.precision == "bf16" else torch.float32,
                            delta=self.delta, version=version)
        assert sha is not None
        try:
            (tmp / CHECKSUM_NAME).write_text(sha + "\n")
            base = Path(self.cfg.model.path)  # type: ignore[arg-type]
            for name in TOKENIZER_FILES:
                if (base / name).exists():
                    shutil.copy(base / name, tmp / name)
            os.replace(tmp, final)
        except BaseException:
            if self.delta is not None:
                self.delta.abort()  # not in place: the next version is an anchor
            raise
        if self.delta is not None:
            self.delta.commit(final.name)
        # Rollout may still be loading recent versions: keep the newest few with the anchor and
        # deltas each is rebuilt from, and anything younger than a grace period (a late joiner may
        # be loading the announced one on a busy machine).
        for old in prunable(root, keep=2 * (self.cfg.effective_eta + 2), grace_s=WEIGHTS_GRACE_S):
            shutil.rmtree(old, ignore_errors=True)
        return final

    async def _announce(self, version: int, path: str) -> None:
        if version < self.announced_floor:
            log.info("replayed version %d not announced: v%d was announced before the restart",
                     version, self.announced_floor)
            return
        sha = await asyncio.to_thread(checksum, path)  # recorded by _save_weights while streaming the file
        await announce.publish(self.bus, announce.announcement(version, path, sha))

    def _checkpoint(self, gate: dict[str, int] | None = None, cursor: int = 0) -> None:
        """Model, optimizer, scheduler and RNG (engine), plus version, entropy controller, gate
        counters and data cursor (client state); written to a temp dir, then renamed. Every rank
        writes its part (DeepSpeed: ZeRO shards per rank, the client state from rank 0) into the
        same directory; the leader prepares it and renames it once all have written."""
        tmp = self.ckpt_dir / f".tmp-{self.version}"
        if self.leader:
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir(parents=True)
        self._barrier()
        self._engine().save_checkpoint(str(tmp), client_state={
            "version": self.version, "steps_done": self.steps_done, "rl_seconds": self.rl_seconds,
            "trajectories_trained": self.trajectories_trained, "objective": self.objective.model_dump(),
            "entropy_controller": self.entropy_ctl.state_dict() if self.entropy_ctl is not None else None,
            "gate_counters": gate or {}, "sampler_cursor": cursor, "world_size": self.world_size})
        if self.reference is not None:  # after a reset: reference.pt (ZeRO-3: one per rank)
            self.reference.save(tmp)
        if self.prm is not None:  # PRIME's PRM: weights and optimizer (prm/)
            self.prm.save(tmp)
        release_free_heap()  # DeepSpeed's copies of the model and optimizer state (learner/heap.py)
        self._barrier()
        if self.leader:
            latest = self.ckpt_dir / "latest"
            old = self.ckpt_dir / ".old"
            shutil.rmtree(old, ignore_errors=True)
            if latest.exists():
                os.replace(latest, old)
            os.replace(tmp, latest)
            shutil.rmtree(old, ignore_errors=True)
            for path in self.batches_dir.glob("step-*.pb") if self.batches_dir.exists() else []:
                if int(path.stem.split("-")[1]) < self.steps_done and not self.cfg.learner.keep_batches:
                    path.unlink()
            log.info("checkpoint at version %d", self.version)
        self._barrier()
        self.checkpointed_version = self.version

    async def _checkpoint_async(self) -> None:
        """Leader: every rank checkpoints (``checkpoint`` command), with the gate's counters and the
        data cursor from Redis in the client state."""
        await self._command("checkpoint")
        c = await self._gate().counters()
        cursor = await self._record().sampler_cursor()
        gate = {"version": c.version, "accepted": c.accepted, "running": c.running}
        await asyncio.to_thread(self._checkpoint, gate, cursor)

    async def stop(self) -> None:
        if self.leader and self.engine is not None:
            try:
                if self.steps_done > 0 and self.checkpointed_version != self.version:  # a stop rule saved it
                    await self._checkpoint_async()
            finally:
                await self._command("stop")  # the followers leave their loop (once)
        if self.store is not None:
            await self.store.close()
        if self.bus is not None:
            await self.bus.close()
        if self.redis is not None:
            await self.redis.aclose()
        if self.world_size > 1 and self.engine is not None:
            # Every rank leaves the process group itself: a rank that exited with it still up once
            # died in C++ teardown ("terminate called without an active exception", SIGABRT) after
            # the leader's stop command (tests/e2e/test_e2e_learner_ranks.py, in a clean-clone CI run).
            await asyncio.to_thread(shutdown_distributed)
