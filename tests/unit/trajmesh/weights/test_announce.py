"""The announce/poll protocol of weight versions (`trajmesh.weights.announce`) against a real
nats-server."""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from typing import Any

from trajmesh import bus as busmod
from trajmesh.bus import Bus
from trajmesh.infra import NatsServer
from trajmesh.weights import announce

_TEST_DEADLINE_S = 30.0


def _run(coro: Coroutine[Any, Any, Any]) -> Any:
    return asyncio.run(asyncio.wait_for(coro, _TEST_DEADLINE_S))


async def _build_bus(url: str, name: str) -> Bus:
    bus = await busmod.connect(url, name=name, max_reconnect_attempts=0)
    await bus.ensure_streams()
    return bus


def _ann(version: int) -> announce.Announcement:
    return announce.Announcement(version=version, path=f"/weights/v{version}", sha256=f"{version:064x}")


def test_weights_kv_serves_late_joiners_and_watchers(nats_server: NatsServer) -> None:
    async def body() -> None:
        learner = await _build_bus(nats_server.url, name="learner")
        assert await announce.latest(learner) is None
        await announce.publish(learner, _ann(1))
        await announce.publish(learner, _ann(2))

        rollout = await _build_bus(nats_server.url, name="rollout-late")
        assert await announce.latest(rollout) == _ann(2)

        seen: list[announce.Announcement] = []
        watch = announce.watch(rollout)
        seen.append(await anext(watch))  # the current value first
        await announce.publish(learner, _ann(3))
        seen.append(await anext(watch))
        await watch.aclose()
        assert seen == [_ann(2), _ann(3)]

        # Only values written after the watch started: the first value it yields is v4, not the
        # current v3 (a watch that replayed v3 would yield it first).
        caught_up = asyncio.Event()
        fresh = announce.watch(rollout, include_current=False, caught_up=caught_up)
        next_value = asyncio.ensure_future(anext(fresh))
        await caught_up.wait()
        await announce.publish(learner, _ann(4))
        assert await next_value == _ann(4)
        await fresh.aclose()

        # The stream keeps each announcement once per version.
        await announce.publish(learner, _ann(4))
        info = await learner.stream_info(busmod.STREAM_WEIGHTS)
        assert info.state.messages == 4
        await learner.close()
        await rollout.close()

    _run(body())


def test_weights_watch_that_never_delivers_is_covered_by_the_poll(nats_server: NatsServer) -> None:
    """A rollout's KV watch once delivered neither the existing-value marker nor any update, with no
    error, and it sampled with its first weights for minutes. The poll runs from the start, so
    announcements still arrive, only through it (the watch here is one that never yields)."""

    class SilentWatcher:
        def __aiter__(self) -> SilentWatcher:
            return self

        async def __anext__(self) -> Any:
            await asyncio.Event().wait()  # never

        async def stop(self) -> None:
            return None

    async def body() -> None:
        learner = await _build_bus(nats_server.url, name="learner")
        rollout = await _build_bus(nats_server.url, name="rollout-silent")
        kv = await rollout.weights_kv()

        async def silent_watch(key: str) -> SilentWatcher:
            return SilentWatcher()

        kv.watch = silent_watch  # type: ignore[method-assign]
        watch = announce.watch(rollout, poll_s=0.05)
        await announce.publish(learner, _ann(1))
        assert await anext(watch) == _ann(1)
        await announce.publish(learner, _ann(2))
        assert await anext(watch) == _ann(2)
        await watch.aclose()
        await learner.close()
        await rollout.close()

    _run(body())
