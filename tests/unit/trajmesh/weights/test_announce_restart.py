"""The weights watch survives a NATS restart (issue 16).

A rollout follows the learner's weights through `announce.watch`. nats-py's KV watch runs on an
ephemeral, in-memory consumer that a NATS restart destroys; nats-py re-creates it only after two
missed idle heartbeats (≥ 10 s, retried every 10 s while JetStream recovers). Meanwhile a rollout
kept sampling tasks admitted at the new version with old weights, and the learner quarantined
them as stale. The watch now also reads the current announcement every `poll_s`.
"""

from __future__ import annotations

import asyncio

from trajmesh import bus as busmod
from trajmesh.infra import NatsServer
from trajmesh.weights import announce

WATCH_ALONE_RECOVERY_S = 10.0
"""The earliest nats-py's own watch re-creates its consumer after a restart (2 × 5 s heartbeat)."""


def test_weights_watch_sees_announcements_made_after_a_nats_restart(nats_server: NatsServer) -> None:
    async def body() -> None:
        rollout = await busmod.connect(nats_server.url, name="rollout")
        await rollout.ensure_streams()
        learner = await busmod.connect(nats_server.url, name="learner")
        await announce.publish(learner, _ann(1))
        watch = announce.watch(rollout, include_current=True, poll_s=0.3)
        assert await asyncio.wait_for(anext(watch), 10) == _ann(1)

        nats_server.kill()
        nats_server.restart()
        await announce.publish(learner, _ann(2))  # retried until NATS is back (see the next test)
        # Well within the time the nats-py watch alone takes to come back.
        assert await asyncio.wait_for(anext(watch), WATCH_ALONE_RECOVERY_S - 1) == _ann(2)
        await announce.publish(learner, _ann(3))
        assert await asyncio.wait_for(anext(watch), 10) == _ann(3)  # each once, in order: no v2 again
        await watch.aclose()
        await learner.close()
        await rollout.close()

    asyncio.run(asyncio.wait_for(body(), 120))


def _ann(version: int) -> announce.Announcement:
    return announce.Announcement(version=version, path=f"/weights/v{version}")


def _retries() -> float:
    return announce.PUBLISH_FAILURES._value.get()


def test_weights_announcement_is_retried_while_nats_is_down(nats_server: NatsServer) -> None:
    """A learner announcing while NATS restarts waits for it instead of failing (it exited on a
    `nats: timeout` mid-run before, with the step trained but not announced)."""
    async def body() -> None:
        learner = await busmod.connect(nats_server.url, name="learner")
        await learner.ensure_streams()
        await announce.publish(learner, _ann(1))
        nats_server.kill()
        before = _retries()
        publish = asyncio.ensure_future(announce.publish(learner, _ann(2)))
        while _retries() == before:  # the event: a failed attempt while NATS is down
            assert not publish.done(), publish.exception()
            await asyncio.sleep(0.05)
        assert not publish.done()
        nats_server.restart()
        await asyncio.wait_for(publish, 60)
        reader = await busmod.connect(nats_server.url, name="reader")
        assert await announce.latest(reader) == _ann(2)
        # Without retries the same call fails while NATS is down.
        nats_server.kill()
        try:
            await announce.publish(learner, _ann(3), retry_s=0)
            raise AssertionError("publish with NATS down did not fail")
        except (busmod.nats.errors.Error, busmod.nats.js.errors.Error, asyncio.TimeoutError):
            pass
        nats_server.restart()
        await learner.close()
        await reader.close()

    asyncio.run(asyncio.wait_for(body(), 150))
