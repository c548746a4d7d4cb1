"""The store's Redis bookkeeping (`trajmesh.services.store.repo`) against a real redis-server."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable

import redis.asyncio

from trajmesh.gate import AsyncStalenessGate
from trajmesh.infra import RedisServer
from trajmesh.services.store.keys import RedisKeys
from trajmesh.services.store.repo import Membership, StoreRepo

KEYS = RedisKeys("t")
ETA, B = 1, 4


def _with_repo(redis_server: RedisServer, body: Callable[[StoreRepo, redis.asyncio.Redis], Awaitable[None]]) -> None:
    async def main() -> None:
        r = redis.asyncio.Redis.from_url(redis_server.url)
        try:
            gate = AsyncStalenessGate(r, key_prefix=KEYS.gate_prefix, eta=ETA, batch_size=B)
            await body(StoreRepo(r, KEYS, gate), r)
        finally:
            await r.aclose()
    asyncio.run(main())


def test_lookup_reads_version_task_and_final_mark(redis_server: RedisServer) -> None:
    async def body(repo: StoreRepo, r: redis.asyncio.Redis) -> None:
        await r.set(f"{KEYS.gate_prefix}:version", 7)
        await r.hset(KEYS.tasks, "task-a", json.dumps({"group_id": "ga", "group_size": 2}))
        await r.sadd(KEYS.final_trajectories, "task-a-1")
        version, found = await repo.lookup([("task-a", "task-a-0"), ("task-a", "task-a-1"), ("nope", "x")])
        assert version == 7
        assert [(f.task is not None, f.already_final) for f in found] == [(True, False), (True, True), (False, False)]
        assert found[0].task == {"group_id": "ga", "group_size": 2}
    _with_repo(redis_server, body)


def test_record_members_returns_counts_after_each_member(redis_server: RedisServer) -> None:
    async def body(repo: StoreRepo, r: redis.asyncio.Redis) -> None:
        counts = await repo.record_members([
            Membership("ga", "a0", True), Membership("ga", "a1", False), Membership("gb", "b0", True),
            Membership("ga", "a2", True), Membership("ga", "a0", True),  # a repeat counts once
        ])
        assert counts == [(1, 1), (2, 1), (1, 1), (3, 2), (3, 2)]
        assert {m.decode() for m in await r.smembers(KEYS.open_groups)} == {"ga", "gb"}
    _with_repo(redis_server, body)


def test_owed_ids_are_open_valid_members_not_final_and_cleanup_closes_groups(redis_server: RedisServer) -> None:
    async def body(repo: StoreRepo, r: redis.asyncio.Redis) -> None:
        await repo.record_members([Membership("ga", "a0", True), Membership("ga", "a1", False),
                                   Membership("gb", "b0", True), Membership("gb", "b1", True)])
        await repo.mark_final(["b1"])
        assert await repo.owed_ids() == {"a0", "b0"}
        await repo.cleanup(["gb"])
        assert await repo.owed_ids() == {"a0"}
        assert not await r.exists(KEYS.group_received("gb"), KEYS.group_valid("gb"))
        await repo.cleanup(["ga"])
        assert await repo.owed_ids() == set()
    _with_repo(redis_server, body)


def test_admission_is_gated_recorded_counted_and_marked_unpublished(redis_server: RedisServer) -> None:
    async def body(repo: StoreRepo, r: redis.asyncio.Redis) -> None:
        assert [await repo.next_cursor() for _ in range(3)] == [0, 1, 2]
        # capacity (η + 0 + 1)·B = 8: two groups of 4, not a third.
        assert await repo.try_admit("task-a", {"group_id": "ga", "group_size": 4, "admitted_at_version": 0}, b"bytes-a", 4)
        assert await repo.try_admit("task-b", {"group_id": "gb", "group_size": 4, "admitted_at_version": 1}, b"bytes-b", 4)
        assert not await repo.try_admit("task-c", {"group_id": "gc", "group_size": 4, "admitted_at_version": 1}, b"bytes-c", 4)
        assert await repo.unpublished() == {"task-a": b"bytes-a", "task-b": b"bytes-b"}
        assert int(await r.get(KEYS.admitted_trajectories)) == 8
        assert not await r.hexists(KEYS.tasks, "task-c")
        assert int(await r.get(f"{KEYS.gate_prefix}:running")) == 8
        await repo.published("task-a")
        assert await repo.unpublished() == {"task-b": b"bytes-b"}
        assert not await repo.run_finished()
        await r.set(KEYS.run_finished, "budget")
        assert await repo.run_finished()
    _with_repo(redis_server, body)


def test_finish_group_counts_once(redis_server: RedisServer) -> None:
    async def body(repo: StoreRepo, r: redis.asyncio.Redis) -> None:
        assert await repo.try_admit("task-a", {"group_id": "ga", "group_size": 4, "admitted_at_version": 0}, b"", 4)
        assert await repo.finish_group("ga", accepted=3, rejected=1)
        assert not await repo.finish_group("ga", accepted=3, rejected=1)  # rebuilt after a restart
        c = await repo.gate.counters()
        assert (c.accepted, c.running) == (3, 0)
    _with_repo(redis_server, body)


def test_unfinished_members_enumerates_every_admitted_id_without_outcome(redis_server: RedisServer) -> None:
    async def body(repo: StoreRepo, r: redis.asyncio.Redis) -> None:
        assert await repo.try_admit("task-a", {"group_id": "ga", "group_size": 2, "source": "s", "admitted_at_version": 0}, b"", 2)
        assert await repo.try_admit("task-b", {"group_id": "gb", "group_size": 3, "source": "s", "admitted_at_version": 0}, b"", 3)
        await repo.mark_final(["task-a-0", "task-a-1", "task-b-1"])
        left = await repo.unfinished_members()
        assert sorted((m.trajectory_id, m.group_id) for m in left) == [("task-b-0", "gb"), ("task-b-2", "gb")]
        assert await repo.finish_group("ga", accepted=2, rejected=0)
        assert await repo.abandon_groups(["ga", "gb", "gb"], 3) == 1  # ga was done: only gb freed
        assert await repo.abandon_groups(["gb"], 3) == 0
        c = await repo.gate.counters()
        assert (c.accepted, c.running) == (2, 0)
        assert await repo.finals(["task-b-1", "task-b-2"]) == [True, False]
    _with_repo(redis_server, body)


def test_pending_groups_by_admission_version(redis_server: RedisServer) -> None:
    async def body(repo: StoreRepo, r: redis.asyncio.Redis) -> None:
        await r.set(f"{KEYS.gate_prefix}:version", 5)  # capacity (1 + 5 + 1)·4 = 28: room for all
        for gid, v in (("g3", 3), ("g4", 4), ("g5", 5)):
            assert await repo.try_admit(f"task-{gid}", {"group_id": gid, "group_size": 4, "admitted_at_version": v},
                                        b"", 4)
        assert await repo.due_groups(4) == {"g3", "g4"}
        await repo.not_pending(["g3"])
        assert await repo.due_groups(4) == {"g4"}
        await repo.pending_again({"g3": 3})
        assert await repo.due_groups(3) == {"g3"}
        assert await repo.due_groups(2) == set()
    _with_repo(redis_server, body)
