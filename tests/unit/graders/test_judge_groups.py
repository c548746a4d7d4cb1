"""Pairwise judging's group buffer against a real Redis: a group is claimed once, by the member
that completes it; redelivered members neither claim it twice nor get lost; the claimant's own
redelivery (a grader that died mid-group) claims it again; after `finish` a redelivered member is
known as published and a member that was never in the group is late."""

from __future__ import annotations

import asyncio

import pytest

from trajmesh.graders.judge_groups import ALREADY_PUBLISHED, CLAIMED, LATE, WAIT, JudgeGroups
from trajmesh.infra import RedisServer

pytestmark = pytest.mark.timeout(60)


def test_a_group_is_claimed_once_and_survives_redelivery(redis_server: RedisServer) -> None:
    import redis.asyncio

    async def go() -> None:
        r = redis.asyncio.Redis.from_url(redis_server.url)
        try:
            groups = JudgeGroups(r, "t", ttl_s=60)
            assert await groups.add("g", "t-0", b"zero", 3) == WAIT
            assert await groups.add("g", "t-1", b"one", 3) == WAIT
            assert await groups.add("g", "t-1", b"one", 3) == WAIT  # redelivered: still two parked
            assert await groups.add("g", "t-2", b"two", 3) == CLAIMED  # completes the group
            assert await groups.add("g", "t-0", b"zero", 3) == WAIT  # whole, but t-2 holds the claim
            assert await groups.add("g", "t-2", b"two", 3) == CLAIMED  # t-2's grader died: claimed again
            assert await groups.members("g") == {"t-0": b"zero", "t-1": b"one", "t-2": b"two"}
            assert await groups.add("other", "o-0", b"x", 2) == WAIT  # groups are apart
            await groups.finish("g", ["t-0", "t-1", "t-2"])
            assert await groups.members("g") == {}
            assert await groups.add("g", "t-1", b"one", 3) == ALREADY_PUBLISHED
            assert await groups.add("g", "t-2", b"two", 3) == ALREADY_PUBLISHED
            assert await groups.add("g", "t-3", b"refill", 3) == LATE
            assert await groups.members("g") == {}  # neither re-parked
            assert 0 < await r.ttl("t:judge:group:other:members") <= 60
        finally:
            await r.aclose()

    asyncio.run(go())


def test_concurrent_completers_claim_the_group_once(redis_server: RedisServer) -> None:
    import redis.asyncio

    async def go() -> list[int]:
        r = redis.asyncio.Redis.from_url(redis_server.url)
        try:
            groups = JudgeGroups(r, "t", ttl_s=60)
            return list(await asyncio.gather(*(groups.add("g", f"t-{i}", b"x", 8) for i in range(8))))
        finally:
            await r.aclose()

    states = asyncio.run(go())
    assert sorted(states) == [WAIT] * 7 + [CLAIMED], states
