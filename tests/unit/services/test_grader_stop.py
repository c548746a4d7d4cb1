"""The grader's loop ends once `stopping` is set, even when its cancellation is swallowed by
nats-py's fetch (Python < 3.12 `asyncio.wait_for`; tests/unit/services/store/test_store_intake_stop.py)."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace
from typing import Any

from trajmesh.services.grader import GraderService


class SwallowingConsumer:
    def __init__(self) -> None:
        self.fetching = asyncio.Event()
        self.swallowed = 0
        self.fetches = 0

    async def fetch(self, batch: int = 1, timeout: float = 1.0) -> list[Any]:
        self.fetches += 1
        self.fetching.set()
        try:
            await asyncio.sleep(timeout)
        except asyncio.CancelledError:
            if self.swallowed:  # only the first (the test's own end cancels the loop again)
                raise
            self.swallowed += 1  # swallowed: the caller sees an empty fetch
        return []


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
