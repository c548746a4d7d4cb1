"""A crashed rollout task fails the service with its error (exit non-zero naming it), not a clean stop."""

from __future__ import annotations

import asyncio

import pytest

pytest.importorskip("torch")

from trajmesh.config import load_config  # noqa: E402
from trajmesh.services.rollout import RolloutService  # noqa: E402


def test_a_crashed_task_fails_the_service_with_its_error() -> None:
    async def body() -> RolloutService:
        service = RolloutService(load_config(None))
        for _ in range(service.cfg.rollout.concurrent_tasks):  # every slot taken, as in a busy rollout
            await service.slots.acquire()

        async def crash() -> None:
            raise ValueError("engine answered garbage")

        task = asyncio.ensure_future(crash())
        service.inflight.add(task)
        await asyncio.gather(task, return_exceptions=True)
        service._task_done(task)
        assert task not in service.inflight and service.slots.locked() is False  # the slot came back
        return service

    service = asyncio.run(body())
    assert service.stopping.is_set()
    assert isinstance(service.failure, ValueError) and "garbage" in str(service.failure)


def test_a_cancelled_task_is_not_a_failure() -> None:
    async def body() -> RolloutService:
        service = RolloutService(load_config(None))
        for _ in range(service.cfg.rollout.concurrent_tasks):  # every slot taken, as in a busy rollout
            await service.slots.acquire()
        task = asyncio.ensure_future(asyncio.sleep(60))
        service.inflight.add(task)
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        service._task_done(task)
        return service

    service = asyncio.run(body())
    assert service.failure is None and not service.stopping.is_set()
