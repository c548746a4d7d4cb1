"""Which version is where: the announce/poll protocol of weight versions over NATS.

::

    learner ── publish(ann) ──▶ KV trajmesh_weights["latest"] (written first) ──▶ WEIGHTS stream
    rollout, evaluator ◀── watch(): the KV watch, and a read of "latest" every POLL_S seconds
    rollout ── request_anchor() ──▶ KV ["anchor_request"] ──▶ learner (anchor_request_revision)

An announcement (`trajectory_pb2.WeightsAnnouncement`: version, the version's directory, its
sha256) is the one record of which version is where; the directory's layout is
`trajmesh.weights.layout`'s. The bus (`trajmesh.bus`) owns the NATS objects (the KV bucket, the
WEIGHTS stream, their names and limits); this module owns what is written to them and how it is
read back.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import AsyncGenerator
from pathlib import Path

import nats.errors
import nats.js.errors
from prometheus_client import Counter

from trajmesh.bus import SUBJECT_WEIGHTS, WEIGHTS_VERSION_HEADER, Bus
from trajmesh.v1 import trajectory_pb2

Announcement = trajectory_pb2.WeightsAnnouncement

LATEST_KEY = "latest"
"""The KV key holding the newest announcement."""
ANCHOR_REQUEST_KEY = "anchor_request"
"""A rollout that could rebuild no version from the current anchor (``weights.sync: delta``) asks
for a full anchor here; each request is a new revision of the key (`request_anchor`)."""

POLL_S = 2.0
"""How often a watch also reads the current announcement (`watch`)."""
PUBLISH_RETRY_S = 120.0
"""How long an announcement is retried while NATS is unreachable (restarting) before it fails; a
JetStream restart with recovery takes seconds to tens of seconds."""

PUBLISH_FAILURES = Counter(
    "trajmesh_bus_weights_publish_failures_total",
    "Failed weights announcement attempts (NATS unreachable or timed out), each retried until its deadline",
)

_log = logging.getLogger("trajmesh.weights.announce")


def announcement(version: int, path: str | Path, sha256: str) -> Announcement:
    """The announcement of ``version`` in directory ``path`` (made absolute), stamped now."""
    return Announcement(version=int(version), path=str(Path(path).resolve()), sha256=sha256,
                        published_unix_seconds=time.time())


async def publish(bus: Bus, ann: Announcement, *, retry_s: float = PUBLISH_RETRY_S) -> None:
    """Announce ``ann``: written to the KV's ``latest`` first, so anyone who hears the stream
    message and reads the KV sees it, then published on WEIGHTS (deduped per version).

    A NATS error or timeout (NATS restarting) is retried with backoff for up to ``retry_s``
    seconds, then raised: both writes are idempotent (the KV value is the same, the stream
    dedupes on the version's message id), and a learner that exits here has already trained
    the step it announces (issue 16)."""
    data = ann.SerializeToString()
    deadline = time.monotonic() + retry_s
    delay = 0.2
    while True:
        try:
            kv = await bus.weights_kv()
            await kv.put(LATEST_KEY, data)
            await bus.publish(SUBJECT_WEIGHTS, data, msg_id=f"weights-v{ann.version}",
                              headers={WEIGHTS_VERSION_HEADER: str(ann.version)})
            return
        except (nats.errors.Error, nats.js.errors.Error, asyncio.TimeoutError) as err:
            if time.monotonic() + delay > deadline:
                raise
            PUBLISH_FAILURES.inc()
            _log.warning("announcing weights v%d failed (%s); retrying in %.1f s", ann.version, err, delay)
            await asyncio.sleep(delay)
            delay = min(delay * 2, 5.0)


async def latest(bus: Bus) -> Announcement | None:
    """The newest announcement, None if no version was announced yet."""
    kv = await bus.weights_kv()
    try:
        entry = await kv.get(LATEST_KEY)
    except nats.js.errors.KeyNotFoundError:
        return None
    return None if entry.value is None else Announcement.FromString(bytes(entry.value))


async def latest_version(bus: Bus) -> int:
    """The newest announced version, 0 if none was announced."""
    ann = await latest(bus)
    return 0 if ann is None else int(ann.version)


async def request_anchor(bus: Bus, worker: str, version: int) -> int:
    """Asks the learner to make its next version a full anchor (``weights.sync: delta``): a
    rollout whose rebuild of `version` failed from its anchor too. Returns the request's KV
    revision; the learner honours each revision once (`anchor_request_revision`)."""
    kv = await bus.weights_kv()
    body = json.dumps({"worker": worker, "version": int(version), "unix_seconds": time.time()})
    return int(await kv.put(ANCHOR_REQUEST_KEY, body.encode()))


async def anchor_request_revision(bus: Bus) -> int:
    """The KV revision of the latest anchor request (0: none was made)."""
    kv = await bus.weights_kv()
    try:
        entry = await kv.get(ANCHOR_REQUEST_KEY)
    except nats.js.errors.KeyNotFoundError:
        return 0
    return int(entry.revision or 0)


async def watch(
    bus: Bus, *, include_current: bool = True, caught_up: asyncio.Event | None = None,
    poll_s: float = POLL_S,
) -> AsyncGenerator[Announcement, None]:
    """Yield each new announcement as it is written (KV watch on ``latest``).

    With ``include_current`` the latest existing announcement (if any) comes first. The
    ``caught_up`` event is set once the existing value has been delivered (or skipped): every
    announcement written after that is yielded, each once, in revision order (an older one
    arriving late is skipped). Stops the watcher when the iterator is closed.

    The watch alone does not survive a NATS restart reliably: its server-side consumer is
    ephemeral and in memory, and nats-py re-creates it only after two missed idle heartbeats
    (≥ 10 s), retrying each 10 s while JetStream recovers; a rollout meanwhile kept sampling
    with old weights while the learner moved on, and its tasks, admitted at the newer
    version, were trained stale (issue 16). So the current value is also read every ``poll_s``
    seconds from the start (failures while NATS is down are ignored) and yielded when its
    revision is newer than the last one yielded (before the existing value was delivered, only
    with ``include_current``).
    """
    kv = await bus.weights_kv()
    # (revision, value, from the poll) in arrival order; None: the watch delivered the existing value.
    found: asyncio.Queue[tuple[int, bytes, bool] | None | BaseException] = asyncio.Queue()
    watcher = await kv.watch(LATEST_KEY)

    async def watch_kv() -> None:
        try:
            async for entry in watcher:
                if entry is None:  # the watcher sends None once the existing value was delivered
                    await found.put(None)
                    continue
                if entry.operation in ("DEL", "PURGE") or entry.value is None:
                    continue
                await found.put((int(entry.revision or 0), bytes(entry.value), False))
        except Exception as exc:  # noqa: BLE001 - raised to the generator's consumer
            await found.put(exc)

    async def poll() -> None:
        while True:
            await asyncio.sleep(poll_s)
            try:
                entry = await kv.get(LATEST_KEY)
            except (nats.errors.Error, nats.js.errors.Error, asyncio.TimeoutError):
                continue  # NATS down or the key deleted: a later poll (or the watch) sees it
            if entry.value is not None:
                await found.put((int(entry.revision or 0), bytes(entry.value), True))

    # The poll runs from the start, not only once the watch has delivered the existing value: a
    # rollout once never got that marker nor any update from its watch (no error either) and
    # sampled with its first weights for minutes while the learner published v1, v2, ...
    tasks = [asyncio.ensure_future(watch_kv()), asyncio.ensure_future(poll())]
    _log.info("watching weight announcements (%s, polled every %.0f s)", LATEST_KEY, poll_s)
    last, seen_current = 0, False
    try:
        while True:
            item = await found.get()
            if isinstance(item, BaseException):
                raise item
            if item is None:
                if not seen_current:
                    seen_current = True
                    if caught_up is not None:
                        caught_up.set()
                continue
            revision, value, polled = item
            if polled and not seen_current and not include_current:
                continue  # maybe the existing value, maybe newer: the watch orders those
            if revision <= last:
                continue  # already yielded (the watch and the poll both saw it), or older
            last = revision
            if seen_current or include_current:
                yield Announcement.FromString(value)
    finally:
        for t in tasks:
            t.cancel()
        await watcher.stop()
