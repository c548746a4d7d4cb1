"""An episode's Reset waits (bounded) for an environment that is away, instead of failing at once.

With every environment replica gone (a pod restarting), failing each new episode at once ends its
task INFRA_FAILURE and the store admits the next as fast as they fail: one all-faults run burned
1,348 trajectories in 31 s while the environment restarted. The rollout's real `_reset` runs here
against a real gRPC channel to a port where no environment listens yet; the environment service
(in process, real gRPC) starts on that port only once the rollout has seen a failed round, and
the Reset must then succeed. With nothing ever listening, it gives up after
`rollout.environment_wait_s`.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import grpc
import pytest

pytest.importorskip("torch")

from trajmesh.config import load_config  # noqa: E402
from trajmesh.infra import free_port  # noqa: E402
from trajmesh.services import rollout as rollout_mod  # noqa: E402
from trajmesh.services.environment import EnvironmentService  # noqa: E402
from trajmesh.services.rollout import RolloutService  # noqa: E402
from trajmesh.v1 import services_pb2_grpc, trajectory_pb2  # noqa: E402

TASK = trajectory_pb2.Task(task_id="t1-c0", environment="single_answer", prompt="2+3=", answer="5")


def _waited_s() -> float:
    """Seconds episodes have waited at Reset so far (counted before each wait)."""
    return rollout_mod.ENV_WAIT_SECONDS._value.get()


def test_reset_waits_for_an_environment_that_comes_back(tmp_path: Path) -> None:
    port = free_port()
    cfg = load_config(None, {"run_dir": str(tmp_path / "run"), "rollout.environment_wait_s": 60.0})

    async def body() -> tuple[str, float]:
        rollout = RolloutService(cfg)
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            rollout.envs = [services_pb2_grpc.EnvironmentStub(channel)]
            before = _waited_s()
            reset = asyncio.ensure_future(rollout._reset(TASK, "t1-c0-0", 3))
            deadline = time.monotonic() + 30
            while _waited_s() == before:  # the event: a round in which no replica answered, then a wait
                assert not reset.done(), "Reset ended before the environment was back"
                assert time.monotonic() < deadline, "no Reset round failed against an absent environment"
                await asyncio.sleep(0.02)
            env = EnvironmentService(cfg, grpc_port=port)
            await env.setup()
            try:
                got = await asyncio.wait_for(reset, 30)
            finally:
                await env.stop()
            assert got is not None, "Reset gave up although the environment came back"
            return got[1].observation, _waited_s() - before

    observation, waited = asyncio.run(body())
    assert observation == "2+3=" and waited > 0


def test_reset_gives_up_after_environment_wait_s(tmp_path: Path) -> None:
    port = free_port()
    wait_s = 1.0
    cfg = load_config(None, {"run_dir": str(tmp_path / "run"), "rollout.environment_wait_s": wait_s})

    async def body() -> tuple[object, float]:
        rollout = RolloutService(cfg)
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            rollout.envs = [services_pb2_grpc.EnvironmentStub(channel)]
            start = time.monotonic()
            got = await asyncio.wait_for(rollout._reset(TASK, "t1-c0-0", 3), 30)
            return got, time.monotonic() - start

    got, took = asyncio.run(body())
    assert got is None
    assert took >= wait_s - 0.3, f"gave up after {took:.2f} s, before environment_wait_s={wait_s}"
