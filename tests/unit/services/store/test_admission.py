"""The store's admission transactions (services/store/admission.py) against a real Redis: the gate's
counters and the store's record change together, once."""

from __future__ import annotations

import asyncio

import pytest
import redis.asyncio

from trajmesh.gate import AsyncStalenessGate
from trajmesh.infra import RedisServer
from trajmesh.services.store.admission import Admission
from trajmesh.services.store.keys import RedisKeys

KEYS = RedisKeys("run0")


def test_admission_with_its_record_is_one_atomic_step(redis_server: RedisServer) -> None:
    async def main() -> None:
        r = redis.asyncio.Redis.from_url(redis_server.url)
        try:
            gate = AsyncStalenessGate(r, key_prefix=KEYS.gate_prefix, eta=0, batch_size=4)  # capacity 4
            adm = Admission(r, KEYS, gate)
            assert await adm.admit(4, task_id="t1", record="{}", data=b"x", group_id="g1", version=3)
            assert not await adm.admit(1, task_id="t2", record="{}", data=b"y", group_id="g2", version=3)
            assert await r.hgetall(KEYS.tasks) == {b"t1": b"{}"}
            assert await r.hgetall(KEYS.unpublished_tasks) == {b"t1": b"x"}
            assert await r.zrange(KEYS.pending_groups, 0, -1, withscores=True) == [(b"g1", 3.0)]
            assert int(await r.get(KEYS.admitted_trajectories)) == 4
            assert (await gate.counters()).running == 4
            # A group finishes once, whatever the number of calls: 3 accepted, 1 dropped. Kept, it
            # fills a batch place of 4: the place its dropped member left stays taken (`unfilled`).
            assert await adm.finish_group("g1", accepted=3, rejected=1, place=4)
            assert not await adm.finish_group("g1", accepted=3, rejected=1, place=4)
            c = await gate.counters()
            assert (c.accepted, c.unfilled, c.running, c.capacity) == (3, 1, 0, 0)
            # A group none of whose members is kept takes no place: all of it is free again.
            assert await adm.admit(4, task_id="t3", record="{}", data=b"z", group_id="g3", version=4) is False
            await gate.set_version(4)  # capacity (0 + 4 + 1)·4 − 4 = 16
            assert await adm.admit(4, task_id="t3", record="{}", data=b"z", group_id="g3", version=4)
            assert await adm.finish_group("g3", accepted=0, rejected=4, place=4)
            c = await gate.counters()
            assert (c.accepted, c.unfilled, c.running, c.capacity) == (3, 1, 0, 16)
            with pytest.raises(ValueError):
                await adm.finish_group("g2", accepted=0, rejected=0)
        finally:
            await r.aclose()
    asyncio.run(main())


def test_a_retried_admission_counts_once(redis_server: RedisServer) -> None:
    """A client retrying an admission after a timeout (the script ran, the reply was lost; a
    SIGSTOPped store did this) must not admit the task twice: capacity 8, one task of 4 twice."""
    async def main() -> None:
        r = redis.asyncio.Redis.from_url(redis_server.url)
        try:
            gate = AsyncStalenessGate(r, key_prefix=KEYS.gate_prefix, eta=1, batch_size=4)  # capacity 8
            adm = Admission(r, KEYS, gate)
            for _ in range(2):
                assert await adm.admit(4, task_id="t1", record="{}", data=b"x", group_id="g1", version=0)
            c = await gate.counters()
            assert (c.running, c.capacity, int(await r.get(KEYS.admitted_trajectories))) == (4, 4, 4)
        finally:
            await r.aclose()
    asyncio.run(main())
