"""A rollout whose weights watch delivers nothing still loads the version a task waits for.

In a clean-clone CI run (the verifiers mesh test, 2 cores under load), a rollout got neither the
watch's nor its poll's announcement of v1 and v2: it sampled with v0 for six minutes while the store
cut every trajectory as too stale, and the learner never got a third batch. Whatever stalls the
watch, a task waiting for a version now reads the announcement itself after its wait and hands a
version the watch has not delivered to the weights loop (services/rollout.py `_wait_for_version`).
The watch here is one that never yields; the announcement read and the load are stand-ins, the
weights loop and the wait are the service's own."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from prometheus_client import REGISTRY

pytest.importorskip("torch")

from trajmesh.config import load_config  # noqa: E402
from trajmesh.services.rollout import RolloutService  # noqa: E402
from trajmesh.weights import announce  # noqa: E402

MISSES = "trajmesh_rollout_weight_watch_missed_versions_total"


WAIT_S = 2.0
"""Each of the task's two waits; the first always runs out (nothing loads before it)."""


def _service(monkeypatch: pytest.MonkeyPatch, delivered: list[int], *, load_after_read: bool
             ) -> tuple[RolloutService, list[int]]:
    """A rollout at v0 whose watch delivers the versions in `delivered` then nothing, and whose
    announcement reads v2. With `load_after_read` a load finishes only once the task has read the
    announcement (its first wait over: a load still under way then). Returns it and the versions
    it loaded."""
    service = RolloutService(load_config(None, {}))
    service.version = 0
    service.version_changed = asyncio.Condition()
    service.bus = object()  # type: ignore[assignment]  # only passed to the stand-ins below

    async def watch(bus: Any, include_current: bool = True, **_: Any) -> Any:
        for v in delivered:
            yield announce.Announcement(version=v, path=f"/w/v{v}")
        await asyncio.Event().wait()  # then silent, without an error

    read = asyncio.Event()

    async def latest(bus: Any) -> Any:
        read.set()
        return announce.Announcement(version=2, path="/w/v2")

    loaded: list[int] = []

    async def load(ann: Any) -> None:
        if load_after_read:
            await read.wait()
        loaded.append(int(ann.version))
        service.version = int(ann.version)
        async with service.version_changed:
            service.version_changed.notify_all()

    monkeypatch.setattr(announce, "watch", watch)
    monkeypatch.setattr(announce, "latest", latest)
    service._load_weights = load  # type: ignore[method-assign]
    return service, loaded


def _wait_for_v2(service: RolloutService) -> None:
    async def main() -> None:
        weights = asyncio.create_task(service.weights_loop())
        try:
            await service._wait_for_version(2, timeout_s=WAIT_S)
        finally:
            weights.cancel()

    asyncio.run(main())


def test_a_version_the_watch_never_delivers_is_loaded_once_a_task_waits_for_it(monkeypatch: pytest.MonkeyPatch) -> None:
    service, loaded = _service(monkeypatch, delivered=[], load_after_read=False)
    before = REGISTRY.get_sample_value(MISSES) or 0.0
    _wait_for_v2(service)
    assert (loaded, service.version) == ([2], 2)
    assert (REGISTRY.get_sample_value(MISSES) or 0.0) == before + 1


def test_a_delivered_version_still_loading_is_waited_for_not_counted_a_miss(monkeypatch: pytest.MonkeyPatch) -> None:
    service, loaded = _service(monkeypatch, delivered=[2], load_after_read=True)  # outlasts the first wait
    before = REGISTRY.get_sample_value(MISSES) or 0.0
    _wait_for_v2(service)
    assert (loaded, service.version) == ([2], 2)
    assert (REGISTRY.get_sample_value(MISSES) or 0.0) == before
