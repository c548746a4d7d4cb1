"""The store's intake loop ends once `stopping` is set, even when its cancellation is swallowed:
nats-py's fetch can swallow a cancel (a fetch that completed at the same moment, Python < 3.12
`asyncio.wait_for`), and a loop that fetched on kept the store's stop waiting out its whole budget."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace
from typing import Any

from swallowing_fetch import SwallowingConsumer

from trajmesh.services.store.service import TrajectoryStore


def test_a_swallowed_cancel_does_not_keep_the_intake_loop_running() -> None:
    async def go() -> SwallowingConsumer:
        intake = SwallowingConsumer()
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
