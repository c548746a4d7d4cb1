"""Environment service: gRPC Reset/Step/Close with sticky sessions (docs/DESIGN.md §1.3).

::

    rollout ── Reset(session, task, seed) ──▶ session table ── make_environment(task.environment)
    rollout ── Step(session, action) ───────▶ env.step → observation, done, state hash
    rollout ── Close(session) ──────────────▶ forget
    rollout ── RunAgent(task, endpoint session) ▶ the source's agent or harness (`environment_agents`:
               a user's external agent, a verifiers harness) runs here, in this pod, every model
               call going to the rollout's endpoint session ─▶ EOS / WALL_TIMEOUT / INFRA_FAILURE

Sessions idle longer than `SESSION_TTL_S` are dropped (a rollout that died never closes).
A stateless environment (its class sets `stateless`: one turn, reset and step pure functions of
task, seed and action, e.g. single_answer for chain_sum) has no session worth a round trip: the
rollout plays it in its own process (`InProcessSession`, the same task fields and replies as
here; `rollout.stateless_environments_in_process`), so this service sees no Reset or Close for it.
The evaluator plays its held-out episodes here too (tasks with `evaluation` set), so a sandboxed
tool runs in this pod's sandbox whether the episode trains or evaluates.
Steps run in a worker thread (a sandboxed code run blocks for up to its deadline), so one slow
or abusive session never stalls the others.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import logging
import math
import random
import time
from typing import Any

import grpc
from prometheus_client import Counter, Gauge, Histogram

from trajmesh import plugins, sandbox, security
from trajmesh.envs.base import Environment, StepResult, make_environment
from trajmesh.service import Service
from trajmesh.v1 import services_pb2, services_pb2_grpc, trajectory_pb2

log = logging.getLogger("trajmesh.environment")

SESSION_TTL_S = 600.0
SESSIONS = Gauge("trajmesh_environment_sessions", "Open environment sessions")
CALLS = Counter("trajmesh_environment_calls_total", "Environment RPCs", ["method", "status"])
STEP_SECONDS = Histogram("trajmesh_environment_step_seconds", "Step latency (tool/sandbox time included)", ["environment"])
TOOL_CALLS = Counter("trajmesh_environment_tool_calls_total", "Tool calls by outcome", ["environment", "tool", "status"])
INVALID_ACTIONS = Counter("trajmesh_environment_invalid_actions_total", "Invalid actions (schema, budget)",
                          ["environment", "reason"])
PARSER_ERRORS = Counter("trajmesh_environment_parser_errors_total", "Unparseable tool calls", ["environment"])
TOOL_TIMEOUTS = Counter("trajmesh_environment_tool_timeouts_total", "Tool calls past their deadline", ["environment"])
AGENT_RUN_SECONDS = Histogram("trajmesh_environment_agent_run_seconds", "RunAgent: one agent or harness run",
                              ["environment"], buckets=(1, 5, 15, 30, 60, 120, 300, 600, 1800))
SANDBOX_VIOLATIONS = Counter("trajmesh_environment_sandbox_violations_total", "Sandbox errors by subclass",
                             ["environment", "subclass"])


def label_series() -> dict[str, list[tuple[str, ...]]]:
    """The label values of every known series, by metric, from the plug-in registry: each
    environment's parser errors and timeouts, its invalid-action reasons (`invalid_actions`), and
    the sandbox subclasses of environments that run code (`uses_sandbox`)."""
    envs = plugins.environments()
    return {
        "parser_errors": [(e,) for e in envs],
        "tool_timeouts": [(e,) for e in envs],
        "invalid_actions": [(e, r) for e, cls in envs.items() for r in getattr(cls, "invalid_actions", ())],
        "sandbox_violations": [(e, s) for e, cls in envs.items() if getattr(cls, "uses_sandbox", False)
                               for s in sandbox.SUBCLASSES],
    }


def init_series() -> None:
    """Initial zeros so dashboards see every known series (at import, and again at service start
    for sources registered since)."""
    metrics = {"parser_errors": PARSER_ERRORS, "tool_timeouts": TOOL_TIMEOUTS, "invalid_actions": INVALID_ACTIONS,
               "sandbox_violations": SANDBOX_VIOLATIONS}
    for name, labels in label_series().items():
        for values in labels:
            metrics[name].labels(*values)


init_series()


def record_step(kind: str, res: StepResult) -> None:
    """Counts the step's tool call, invalid action, parser error, timeout or sandbox violation."""
    info = res.info or {}
    call = info.get("tool_call")
    if call:
        TOOL_CALLS.labels(kind, call.get("name", ""), call.get("status", "")).inc()
        if call.get("status") == "timeout":
            TOOL_TIMEOUTS.labels(kind).inc()
        if call.get("sandbox_error"):
            SANDBOX_VIOLATIONS.labels(kind, call["sandbox_error"]).inc()
    if info.get("invalid_action"):
        INVALID_ACTIONS.labels(kind, info["invalid_action"]).inc()
    if info.get("parser_error"):
        PARSER_ERRORS.labels(kind).inc()


class EnvironmentService(Service):
    name = "environment"

    def __init__(self, *args: Any, grpc_port: int = 0, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.grpc_port = grpc_port
        self.sessions: dict[str, tuple[Environment, float]] = {}
        self.kinds: dict[str, str] = {}
        self.evaluation: set[str] = set()
        """Sessions of held-out evaluation episodes (the task's `evaluation` flag)."""
        self._last_expire = 0.0
        self.server: grpc.aio.Server | None = None
        self.agent_hooks: dict[str, str] = plugins.environment_agents()
        """Environment key -> "module:function" that runs a sample's agent (``RunAgent``)."""
        self.agent_resources = contextlib.AsyncExitStack()
        """What the agent hooks keep serving between runs (verifiers' environments), closed at stop."""
        self.agent_cache: dict[str, Any] = {}

    async def setup(self) -> None:
        init_series()
        sandboxed = [s.type for s in self.cfg.tasks.sources
                     if any(getattr(cls, "uses_sandbox", False) for cls in plugins.source(s.type).environments.values())]
        if sandboxed:  # refuse to start (SandboxUnavailable) rather than run model code under weaker limits
            log.info("%s (for %s)", sandbox.preflight(self.cfg.sandbox.allow_without_cgroup), ", ".join(sandboxed))
        self.server = security.grpc_server()
        services_pb2_grpc.add_EnvironmentServicer_to_server(_EnvServicer(self), self.server)
        self.grpc_port = security.add_grpc_port(self.server, f"0.0.0.0:{self.grpc_port}", self.cfg.infra.security.grpc_tls)
        await self.server.start()
        log.info("environment gRPC on :%d", self.grpc_port)

    async def run(self) -> None:
        assert self.server is not None, "run() before setup()"
        # Shielded: cancelling grpc.aio's wait_for_termination cancels the future its server's
        # shutdown waits on, and stop()'s `server.stop` then raised CancelledError (a traceback and a
        # non-zero exit at every stop; tests/unit/services/test_environment_service.py).
        await asyncio.shield(self.server.wait_for_termination())

    async def stop(self) -> None:
        if self.server is not None:
            await self.server.stop(grace=1.0)
        await self.agent_resources.aclose()

    def close_session(self, session_id: str) -> None:
        """Forgets a session (idempotent)."""
        self.sessions.pop(session_id, None)
        self.kinds.pop(session_id, None)
        self.evaluation.discard(session_id)
        SESSIONS.set(len(self.sessions))

    def expire(self, every_s: float = 1.0) -> None:
        """Drops sessions idle for SESSION_TTL_S (a rollout that died mid-episode); scans at most
        once every `every_s` (it runs on every Reset)."""
        now = time.monotonic()
        if now - self._last_expire < every_s:
            return
        self._last_expire = now
        for sid in [s for s, (_, t) in self.sessions.items() if now - t > SESSION_TTL_S]:
            self.close_session(sid)


def environment_kind(task: Any) -> str:
    """The environment key of a `Task` (single_answer when it names none)."""
    return str(task.environment) or "single_answer"


def episode_task(task: Any) -> dict[str, Any]:
    """What an environment's `reset` gets of a `Task`."""
    return {"prompt": task.prompt, "answer": task.answer, "metadata": json.loads(task.metadata_json or "{}")}


def step_reply(res: StepResult) -> services_pb2.StepResponse:
    return services_pb2.StepResponse(observation=res.observation, done=res.done, state_hash=res.state_hash,
                                     reward=res.reward, info_json=json.dumps(res.info or {}))


def stateless(kind: str) -> bool:
    """Whether environment `kind` declares itself stateless (False for an unknown key: the service
    answers that one INVALID_ARGUMENT, as before)."""
    try:
        return bool(getattr(plugins.environment_class(kind), "stateless", False))
    except ValueError:
        return False


class InProcessSession:
    """One episode of a stateless environment played in the caller's process, with the stub's
    Reset/Step/Close calls (a `timeout` is accepted and unused): the same `episode_task`, the same
    replies as `_EnvServicer` gives, and no round trip."""

    def __init__(self, kind: str) -> None:
        self.env = make_environment(kind)

    async def Reset(self, request: Any, timeout: float | None = None) -> services_pb2.ResetResponse:  # noqa: N802
        obs, h = self.env.reset(episode_task(request.task), int(request.seed))
        return services_pb2.ResetResponse(observation=obs, state_hash=h, environment_revision=self.env.revision)

    async def Step(self, request: Any, timeout: float | None = None) -> services_pb2.StepResponse:  # noqa: N802
        return step_reply(self.env.step(request.action))

    async def Close(self, request: Any, timeout: float | None = None) -> services_pb2.CloseResponse:  # noqa: N802
        return services_pb2.CloseResponse()


def injected_failure(session_id: str, rate: float) -> bool:
    """Whether `environment.inject_reset_failure_rate` (tests) fails this session's Reset: a
    fraction `rate` of sessions, chosen by a hash of the id (the same one on every replica)."""
    if rate <= 0:
        return False
    return int(hashlib.sha256(session_id.encode()).hexdigest()[:8], 16) < rate * 0x1_0000_0000


async def _call(env: Environment, fn: Any, *args: Any) -> Any:
    """`fn(*args)` on the event loop for `inline` environments (quick pure Python), else in a
    worker thread so a slow tool call never blocks other sessions."""
    if getattr(env, "inline", False):
        return fn(*args)
    return await asyncio.to_thread(fn, *args)


class _EnvServicer(services_pb2_grpc.EnvironmentServicer):
    def __init__(self, svc: EnvironmentService) -> None:
        self.svc = svc

    async def Reset(self, request: Any, context: Any) -> services_pb2.ResetResponse:  # noqa: N802
        self.svc.expire()
        task = episode_task(request.task)
        kind = environment_kind(request.task)
        if injected_failure(request.session_id, self.svc.cfg.environment.inject_reset_failure_rate):
            CALLS.labels("reset", "injected_failure").inc()
            await context.abort(grpc.StatusCode.UNAVAILABLE, "environment.inject_reset_failure_rate")
        try:
            env = make_environment(kind)
        except ValueError as exc:
            CALLS.labels("reset", "invalid").inc()
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        obs, h = await _call(env, env.reset, task, int(request.seed))
        self.svc.sessions[request.session_id] = (env, time.monotonic())
        self.svc.kinds[request.session_id] = kind
        if request.task.evaluation:
            self.svc.evaluation.add(request.session_id)
        SESSIONS.set(len(self.svc.sessions))
        CALLS.labels("reset", "ok").inc()
        return services_pb2.ResetResponse(observation=obs, state_hash=h, environment_revision=env.revision)

    async def Step(self, request: Any, context: Any) -> services_pb2.StepResponse:  # noqa: N802
        entry = self.svc.sessions.get(request.session_id)
        if entry is None:
            CALLS.labels("step", "unknown_session").inc()
            await context.abort(grpc.StatusCode.NOT_FOUND, f"unknown session {request.session_id}")
        assert entry is not None  # abort raises
        env, _ = entry
        self.svc.sessions[request.session_id] = (env, time.monotonic())
        kind = self.svc.kinds.get(request.session_id, "single_answer")
        start = time.perf_counter()
        lat = self.svc.cfg.environment.simulated_step_latency
        if lat.median_s > 0:  # a long-tailed slow environment, seeded by session (deterministic)
            rng = random.Random(request.session_id)
            await asyncio.sleep(lat.median_s * math.exp(lat.sigma * rng.gauss(0.0, 1.0)))
        with self._injected_faults(request.session_id):
            res = await _call(env, env.step, request.action)
        if res.done:  # the episode is over: the session closes itself (Close stays idempotent)
            self.svc.close_session(request.session_id)
        STEP_SECONDS.labels(kind).observe(time.perf_counter() - start)
        record_step(kind, res)
        CALLS.labels("step", "ok").inc()
        return step_reply(res)

    def _injected_faults(self, session_id: str) -> contextlib.AbstractContextManager[None]:
        """`environment.inject_sandbox_failure` (tests): an evaluation session's tool runs fail
        their sandbox setup."""
        if self.svc.cfg.environment.inject_sandbox_failure == "evaluation" and session_id in self.svc.evaluation:
            return sandbox.injected_setup_failure("environment.inject_sandbox_failure: evaluation")
        return contextlib.nullcontext()

    async def Close(self, request: Any, context: Any) -> services_pb2.CloseResponse:  # noqa: N802
        self.svc.close_session(request.session_id)
        CALLS.labels("close", "ok").inc()
        return services_pb2.CloseResponse()

    async def RunAgent(self, request: Any, context: Any) -> services_pb2.RunAgentResponse:  # noqa: N802
        """One sample's agent or harness, run here by its source's hook; answers when the run ends
        (the hook ends it at `budget_s`). A hook that raises is the agent's infrastructure failure,
        never this service's crash."""
        from trajmesh.rollout.agents.agent_runner import AgentCall, AgentOutcome

        kind = environment_kind(request.task)
        hook = self.svc.agent_hooks.get(kind)
        if hook is None:
            CALLS.labels("run_agent", "invalid").inc()
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"environment {kind!r} runs no agent; "
                                f"those that do: {sorted(self.svc.agent_hooks)}")
        assert hook is not None  # abort raises
        call = AgentCall(task=request.task, base_url=request.base_url, api_key=request.api_key, model=request.model,
                         budget_s=float(request.budget_s), resources=self.svc.agent_resources,
                         cache=self.svc.agent_cache)
        start = time.perf_counter()
        try:
            outcome: AgentOutcome = await plugins.load(hook)(call)
        except Exception as exc:  # noqa: BLE001 - the user's agent or harness: its failure, one sample's
            log.exception("agent run %s (%s) raised", request.session_id, kind)
            outcome = AgentOutcome(trajectory_pb2.INFRA_FAILURE, "", f"{type(exc).__name__}: {exc}")
        AGENT_RUN_SECONDS.labels(kind).observe(time.perf_counter() - start)
        CALLS.labels("run_agent", trajectory_pb2.TerminalReason.Name(outcome.terminal_reason).lower()).inc()
        return services_pb2.RunAgentResponse(terminal_reason=outcome.terminal_reason, answer=outcome.answer,
                                             detail=outcome.detail[-2000:],
                                             environment_revision=str(plugins.environment_class(kind).revision))
