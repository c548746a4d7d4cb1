"""RolloutService.stop() closes only what setup() opened: its state is declared in __init__ (None or
empty until setup), so a stop after a failed or partial setup neither raises nor skips a resource."""

from __future__ import annotations

import asyncio

import grpc
import pytest

pytest.importorskip("torch")

from trajmesh.config import load_config  # noqa: E402
from trajmesh.rollout.engines.synthetic_engine import SyntheticEngine  # noqa: E402
from trajmesh.services.rollout import RolloutService  # noqa: E402


def test_stop_before_setup_closes_nothing() -> None:
    service = RolloutService(load_config(None))
    assert service.bus is None and service.engine is None and service.engine_proc is None
    assert service.channels == [] and service.agent_server is None
    asyncio.run(service.stop())


def test_stop_after_a_partial_setup_closes_what_exists() -> None:
    closed: list[str] = []

    class Engine(SyntheticEngine):
        async def close(self) -> None:
            closed.append("engine")

    async def body() -> grpc.ChannelConnectivity:
        service = RolloutService(load_config(None))
        service.engine = Engine(16, 0)  # setup got as far as the engine and the environment channels
        channel = grpc.aio.insecure_channel("127.0.0.1:1")
        service.channels = [channel]
        await service.stop()
        return channel.get_state()

    assert asyncio.run(body()) == grpc.ChannelConnectivity.SHUTDOWN
    assert closed == ["engine"]
