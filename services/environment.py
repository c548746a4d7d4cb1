"""Environment service: gRPC Reset/Step/Close with sticky sessions (DESIGN.md §1.3).

::

    rollout ── Reset(session, task, seed) ──▶ session table ── make_environment(task.environment)
    rollout ── Step(session, action) ───────▶ env.step → observation, done, state hash
    rollout ── Close(session) ──────────────▶ forget

Sessions idle longer than `SESSION_TTL_S` are dropped (a rollout that died never closes).
"""

from __future__ import annotations

import json
import logging
import time
from typing import Any

import grpc
from prometheus_client import Counter, Gauge
from trajmesh.envs.base import Environment, make_environment

from trajmesh.service import Service
from trajmesh.v1 import services_pb2, services_pb2_grpc

log = logging.getLogger("trajmesh.environment")

SESSION_TTL_S = 600.0
SESSIONS = Gauge("trajmesh_environment_sessions", "Open environment sessions")
CALLS = Counter("trajmesh_environment_calls_total", "Environment RPCs", ["method", "status"])


class EnvironmentService(Service):
    name = "environment"

    def __init__(self, *args: Any, grpc_port: int = 0, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.grpc_port = grpc_port
        self.sessions: dict[str, tuple[Environment, float]] = {}

    async def setup(self) -> None:
        self.server = grpc.aio.server()
        services_pb2_grpc.add_EnvironmentServicer_to_server(_EnvServicer(self), self.server)
        self.grpc_port = self.server.add_insecure_port(f"0.0.0.0:{self.grpc_port}")
        await self.server.start()
        log.info("environment gRPC on :%d", self.grpc_port)

    async def run(self) -> None:
        await self.server.wait_for_termination()

    async def stop(self) -> None:
        if hasattr(self, "server"):
            await self.server.stop(grace=1.0)

    def expire(self) -> None:
        now = time.monotonic()
        for sid in [s for s, (_, t) in self.sessions.items() if now - t > SESSION_TTL_S]:
            del self.sessions[sid]
        SESSIONS.set(len(self.sessions))


class _EnvServicer(services_pb2_grpc.EnvironmentServicer):
    def __init__(self, svc: EnvironmentService) -> None:
        self.svc = svc

    async def Reset(self, request: Any, context: Any) -> services_pb2.ResetResponse:  # noqa: N802
        self.svc.expire()
        task = {"prompt": request.task.prompt, "answer": request.task.answer,
                "metadata": json.loads(request.task.metadata_json or "{}")}
        try:
            env = make_environment(request.task.environment or "single_answer")
        except ValueError as exc:
            CALLS.labels("reset", "invalid").inc()
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        obs, h = env.reset(task, int(request.seed))
        self.svc.sessions[request.session_id] = (env, time.monotonic())
        SESSIONS.set(len(self.svc.sessions))
        CALLS.labels("reset", "ok").inc()
        return services_pb2.ResetResponse(observation=obs, state_hash=h)

    async def Step(self, request: Any, context: Any) -> services_pb2.StepResponse:  # noqa: N802
        entry = self.svc.sessions.get(request.session_id)
        if entry is None:
            CALLS.labels("step", "unknown_session").inc()
            await context.abort(grpc.StatusCode.NOT_FOUND, f"unknown session {request.session_id}")
        env, _ = entry
        self.svc.sessions[request.session_id] = (env, time.monotonic())
        res = env.step(request.action)
        CALLS.labels("step", "ok").inc()
        return services_pb2.StepResponse(observation=res.observation, done=res.done, state_hash=res.state_hash,
                                         reward=res.reward, info_json=json.dumps(res.info or {}))

    async def Close(self, request: Any, context: Any) -> services_pb2.CloseResponse:  # noqa: N802
        self.svc.sessions.pop(request.session_id, None)
        SESSIONS.set(len(self.svc.sessions))
        CALLS.labels("close", "ok").inc()
        return services_pb2.CloseResponse()
