"""A backlog poll that NATS does not answer does not crash the store: `queue_loop` (gauges only)
counts it and polls again. Seen in a SmolLM2 training run on the loaded 2-core machine: a
consumer-info request timed out during the final held-out evaluation, the loop raised, and the
whole store exited 1 and was restarted by the launcher."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace
from typing import Any

import nats.errors

from trajmesh.services.store import service as store_service
from trajmesh.services.store.service import TrajectoryStore


def test_a_poll_timeout_is_counted_and_the_loop_polls_again() -> None:
    async def go() -> int:
        polls = 0
        polled_again = asyncio.Event()

        async def poll() -> None:
            nonlocal polls
            polls += 1
            if polls == 1:
                raise nats.errors.TimeoutError  # what nats-py's JetStream API request raises
            polled_again.set()

        store: Any = SimpleNamespace(
            _poll_queues=poll, state=SimpleNamespace(ready=[], held_counts=lambda: {}),
            _note_recovery=lambda: None)
        loop = asyncio.ensure_future(TrajectoryStore.queue_loop(store, every_s=0.01))
        try:
            await asyncio.wait_for(polled_again.wait(), 5.0)
            assert not loop.done(), loop  # an old loop ended here with the TimeoutError
        finally:
            loop.cancel()
        return polls

    before = store_service.QUEUE_POLL_FAILURES._value.get()
    assert asyncio.run(go()) >= 2
    assert store_service.QUEUE_POLL_FAILURES._value.get() == before + 1
