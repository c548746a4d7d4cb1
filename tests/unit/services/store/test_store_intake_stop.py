"""The store's intake loop ends once `stopping` is set, even when its cancellation is swallowed:
nats-py's fetch can swallow a cancel (a fetch that completed at the same moment, Python < 3.12
`asyncio.wait_for`), and a loop that fetched on kept the store's stop waiting out its whole budget."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace
from typing import Any

from trajmesh.services.store.service import TrajectoryStore


class SwallowingIntake:
    """A consumer whose fetch swallows the cancellation it gets while waiting, as nats-py's can."""

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


def test_a_swallowed_cancel_does_not_keep_the_intake_loop_running() -> None:
    async def go() -> SwallowingIntake:
        intake = SwallowingIntake()
        store: Any = SimpleNamespace(
            stopping=asyncio.Event(), state=SimpleNamespace(ready_count=0),
            cfg=SimpleNamespace(store=SimpleNamespace(max_buffered_groups=8)),
            w=SimpleNamespace(intake=intake), _note_recovery=lambda: None)
        loop = asyncio.ensure_future(TrajectoryStore.intake_loop(store))
        await intake.fetching.wait()
        store.stopping.set()  # as a stop does (`begin_stop`), then the cancel
        loop.cancel()
        await asyncio.wait_for(asyncio.shield(loop), 5.0)  # a loop that fetched on never ends
        return intake

    intake = asyncio.run(go())
    assert intake.swallowed == 1 and intake.fetches == 1
