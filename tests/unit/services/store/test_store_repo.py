"""The store's Redis bookkeeping (`trajmesh.services.store.repo`) against a real redis-server."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable

import redis.asyncio

from trajmesh.gate import AsyncStalenessGate
from trajmesh.infra import RedisServer
from trajmesh.services.store.keys import RedisKeys
from trajmesh.services.store.repo import FINISH_LEFT, NOT_COMPLETE, IntakeItem, Membership, StoreRepo

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


def test_admission_round_one_command_per_round_trip_reads_the_same(redis_server: RedisServer) -> None:
    """`store.pipelined_admission` false: the same round, each command on its own round trip."""
    async def body(repo: StoreRepo, r: redis.asyncio.Redis) -> None:
        await r.hset(KEYS.unpublished_tasks, mapping={"t0": b"x", "t1": b"y"})
        piped = await repo.admission_round(draw=True, published=["t0"])
        one_by_one = await repo.admission_round(draw=True, published=["t1"], pipelined=False)
        assert (piped.finished, piped.counters, piped.capacity) == (
            one_by_one.finished, one_by_one.counters, one_by_one.capacity)
        assert (piped.cursor, one_by_one.cursor) == (0, 1)
        assert await r.hlen(KEYS.unpublished_tasks) == 0
    _with_repo(redis_server, body)


def test_intake_round_records_valid_members_by_the_store_rule(redis_server: RedisServer) -> None:
    """Each item in a group of its own (none completes): recorded when its task's record names
    its group and it is not final; valid when it is a valid member, nothing it carries is newer
    than the learner's version, and it is not stale on arrival (pending, oldest > eta behind)."""
    async def body(repo: StoreRepo, r: redis.asyncio.Redis) -> None:
        version = 5
        await r.set(f"{KEYS.gate_prefix}:version", version)
        cases = []
        for good in (True, False):
            for newest in (version, version + 1):
                for oldest in (-1, version - ETA, version - ETA - 1):
                    for pending in (True, False):
                        cases.append((good, newest, oldest, pending))
        items = []
        for k, (good, newest, oldest, pending) in enumerate(cases):
            task_id, gid = f"task{k}-c{k}", f"g{k}"
            await r.hset(KEYS.tasks, task_id, json.dumps({"group_id": gid, "group_size": 4}))
            if pending:
                await r.zadd(KEYS.pending_groups, {gid: 0})
            items.append(IntakeItem(task_id, f"{task_id}-0", gid, good, newest, oldest, int(good), 0, -1, True))
        items.append(IntakeItem("task0-c0", "task0-c0-1", "g-other", True, 0, 0, 1, 0, -1, True))  # not its group
        items.append(IntakeItem("nope-c99", "nope-c99-0", "g99", True, 0, 0, 1, 0, -1, True))  # unknown task
        await r.setbit(KEYS.settled_tasks, 98, 1)
        await r.hset(KEYS.tasks, "old-c98", json.dumps({"group_id": "g98", "group_size": 4}))
        items.append(IntakeItem("old-c98", "old-c98-0", "g98", True, 0, 0, 1, 0, -1, True))  # settled: final
        got_version, facts = await repo.intake_round(items, eta=ETA, place=4)
        assert got_version == version
        for (good, newest, oldest, pending), f in zip(cases, facts, strict=False):
            stale = pending and oldest >= 0 and version - oldest > ETA
            assert f.recorded and f.valid == (good and newest <= version and not stale), (good, newest, oldest, pending)
            assert f.lookup.group_pending == pending and f.counts == (1, int(f.valid))
            # a valid member recorded otherwise leaves its group's finish to the store
            assert f.finish == (FINISH_LEFT if good and not f.valid else NOT_COMPLETE)
        assert [(f.recorded, f.lookup.task is not None, f.lookup.already_final) for f in facts[-3:]] == [
            (False, True, False), (False, False, False), (False, True, True)]
    _with_repo(redis_server, body)
