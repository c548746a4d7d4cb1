"""The environment service's session lifecycle over real gRPC (in-process server, real channel)."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import grpc
import pytest

from trajmesh.config import load_config
from trajmesh.envs.workplace import make_tasks as workplace_tasks
from trajmesh.services.environment import EnvironmentService
from trajmesh.v1 import services_pb2, services_pb2_grpc, trajectory_pb2


def _task(env: str, prompt: str = "2+3=", answer: str = "5", metadata: dict | None = None) -> trajectory_pb2.Task:
    return trajectory_pb2.Task(task_id="t1", environment=env, prompt=prompt, answer=answer,
                               metadata_json=json.dumps(metadata or {}))


async def _with_service(tmp_path: Path, body) -> None:  # type: ignore[no-untyped-def]
    cfg = load_config(None, {"run_dir": str(tmp_path / "run")})
    svc = EnvironmentService(cfg)
    await svc.setup()
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{svc.grpc_port}") as ch:
            await body(svc, services_pb2_grpc.EnvironmentStub(ch))
    finally:
        await svc.stop()


def test_a_finished_episode_closes_its_session(tmp_path: Path) -> None:
    async def body(svc: EnvironmentService, env: services_pb2_grpc.EnvironmentStub) -> None:
        reset = await env.Reset(services_pb2.ResetRequest(session_id="s1", task=_task("single_answer"), seed=3))
        assert reset.observation == "2+3=" and reset.state_hash
        assert "s1" in svc.sessions
        step = await env.Step(services_pb2.StepRequest(session_id="s1", action="5"))
        assert step.done and step.state_hash != reset.state_hash
        assert "s1" not in svc.sessions and "s1" not in svc.kinds  # no Close needed
        await env.Close(services_pb2.CloseRequest(session_id="s1"))  # idempotent
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await env.Step(services_pb2.StepRequest(session_id="s1", action="5"))
        assert err.value.code() == grpc.StatusCode.NOT_FOUND

    asyncio.run(_with_service(tmp_path, body))


def test_a_multi_turn_session_stays_open_until_done_or_closed(tmp_path: Path) -> None:
    task = workplace_tasks(0, 1)[0]

    async def body(svc: EnvironmentService, env: services_pb2_grpc.EnvironmentStub) -> None:
        pb = _task("workplace", task["prompt"], task["answer"], task["metadata"])
        await env.Reset(services_pb2.ResetRequest(session_id="w1", task=pb, seed=0))
        step = await env.Step(services_pb2.StepRequest(session_id="w1", action="<tool>{not json</tool>"))
        assert not step.done and "w1" in svc.sessions
        await env.Close(services_pb2.CloseRequest(session_id="w1"))
        assert "w1" not in svc.sessions

    asyncio.run(_with_service(tmp_path, body))


def test_unknown_environment_is_invalid_argument(tmp_path: Path) -> None:
    async def body(svc: EnvironmentService, env: services_pb2_grpc.EnvironmentStub) -> None:
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await env.Reset(services_pb2.ResetRequest(session_id="x", task=_task("no_such_env"), seed=0))
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "no_such_env" in (err.value.details() or "")
        assert not svc.sessions

    asyncio.run(_with_service(tmp_path, body))


def test_stop_after_run_is_cancelled_ends_cleanly(tmp_path: Path) -> None:
    """A stop cancels run() first (trajmesh/service.py), then calls stop(). grpc.aio's
    wait_for_termination, cancelled, cancels the future its server's shutdown waits on: stop() raised
    CancelledError, a traceback and a non-zero exit at every environment stop."""
    async def go() -> None:
        cfg = load_config(None, {"run_dir": str(tmp_path / "run")})
        svc = EnvironmentService(cfg)
        await svc.setup()
        run = asyncio.ensure_future(svc.run())
        await asyncio.sleep(0)  # one turn of the loop: run() now waits on the server
        run.cancel()
        with pytest.raises(asyncio.CancelledError):
            await run
        await svc.stop()  # raised CancelledError before

    asyncio.run(go())
