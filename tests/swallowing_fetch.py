"""A pull consumer whose fetch swallows the first cancellation it gets while waiting, as nats-py's
can (a fetch that completed at the same moment, Python < 3.12 `asyncio.wait_for`); imported by the
stop tests of the store's intake loop and the grader's loop (not a test module)."""

from __future__ import annotations

import asyncio
from typing import Any


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
