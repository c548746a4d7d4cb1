"""The grader's loop ends once `stopping` is set, even when its cancellation is swallowed by
nats-py's fetch (Python < 3.12 `asyncio.wait_for`; tests/unit/services/store/test_store_intake_stop.py)."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace
from typing import Any

from swallowing_fetch import SwallowingConsumer

from trajmesh.services.grader import GraderService


def test_a_swallowed_cancel_does_not_keep_the_grade_loop_running() -> None:
    async def go() -> SwallowingConsumer:
        consumer = SwallowingConsumer()
        grader: Any = SimpleNamespace(stopping=asyncio.Event(), bus=object(), consumer=consumer,
                                      cfg=SimpleNamespace(store=SimpleNamespace(replicas=1)))
        loop = asyncio.ensure_future(GraderService.grade_loop(grader))
        await consumer.fetching.wait()
        grader.stopping.set()
        loop.cancel()
        await asyncio.wait_for(asyncio.shield(loop), 5.0)
        return consumer

    consumer = asyncio.run(go())
    assert consumer.swallowed == 1 and consumer.fetches == 1
