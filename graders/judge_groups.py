"""Where a pairwise judge's group comes together: the grader service grades TRAJ_RAW messages one
by one, replicas share one durable consumer, so a group's members reach different processes. Each
member is parked in Redis until the group is whole; the process whose member completes it judges
the whole group and publishes every member. No torch.

```
 member k ──▶ add(): HSET members[tid] = bytes ─┬─ fewer than G parked ──▶ WAIT: ack, publish nothing
   (TRAJ_RAW)          (one Lua call)           └─ G parked ──▶ CLAIM (first completer's tid holds it)
                                                      │ claimant: judge the group, publish all G
                                                      ▼ (msg id graded-<tid>: a second copy is dropped)
                                                 finish(): done[tid...], members and claim deleted, ack
```

Redelivery (JetStream acks) keeps every member: a parked member is acked only after its HSET, the
claimant's message only after every member is published and `finish` ran. A grader that dies
mid-group: parked members are safe in Redis; the claimant's own message is redelivered after the
ack wait, and its tid still holds the claim, so whichever grader gets it judges the group again (a
member already published is deduplicated by its msg id; at judge temperature 0 the verdicts are the
same). A member redelivered after `finish` is in ``done``: already published, acked again
(`ALREADY_PUBLISHED`). A member of a finished group that was never in it (a refill the store
admitted for an infra-failed member) has no partners left (`LATE`): the service ends it
INFRA_FAILURE (judge_error ``no_pair``), and the store's refill cap bounds how often that repeats.
Every key expires after ``ttl_s`` (a group whose members never all come is dropped by Redis).
"""

from __future__ import annotations

from typing import Any

WAIT, CLAIMED, ALREADY_PUBLISHED, LATE = 0, 1, 2, 3
"""`JudgeGroups.add` outcomes."""

_ADD = """
-- KEYS: members hash, claim, done set. ARGV: tid, bytes, expected members, ttl seconds.
if redis.call('SISMEMBER', KEYS[3], ARGV[1]) == 1 then return 2 end
if redis.call('EXISTS', KEYS[3]) == 1 then return 3 end
redis.call('HSET', KEYS[1], ARGV[1], ARGV[2])
redis.call('EXPIRE', KEYS[1], ARGV[4])
if redis.call('HLEN', KEYS[1]) < tonumber(ARGV[3]) then return 0 end
local holder = redis.call('GET', KEYS[2])
if not holder then
  redis.call('SET', KEYS[2], ARGV[1], 'EX', ARGV[4])
  return 1
end
if holder == ARGV[1] then return 1 end
return 0
"""

_FINISH = """
-- KEYS: members hash, claim, done set. ARGV: ttl seconds, tids...
for i = 2, #ARGV do redis.call('SADD', KEYS[3], ARGV[i]) end
redis.call('EXPIRE', KEYS[3], ARGV[1])
redis.call('DEL', KEYS[1], KEYS[2])
return 1
"""


class JudgeGroups:
    """The parked members of pairwise-judged groups, in Redis (``<namespace>:judge:group:<id>:*``)."""

    def __init__(self, redis: Any, namespace: str, ttl_s: int = 3600) -> None:
        self.redis, self.namespace, self.ttl_s = redis, namespace, ttl_s
        self._add = redis.register_script(_ADD)
        self._finish = redis.register_script(_FINISH)

    def _keys(self, group_id: str) -> list[str]:
        base = f"{self.namespace}:judge:group:{group_id}"
        return [f"{base}:members", f"{base}:claim", f"{base}:done"]

    async def add(self, group_id: str, trajectory_id: str, data: bytes, expected: int) -> int:
        """Parks a member; `WAIT`, `CLAIMED` (this member completed the group, or holds its claim
        from before a crash: judge it), `ALREADY_PUBLISHED` or `LATE`."""
        return int(await self._add(keys=self._keys(group_id), args=[trajectory_id, data, expected, self.ttl_s]))

    async def members(self, group_id: str) -> dict[str, bytes]:
        """Trajectory id → the parked member's TRAJ_RAW bytes."""
        raw = await self.redis.hgetall(self._keys(group_id)[0])
        return {(k.decode() if isinstance(k, bytes) else str(k)): v for k, v in raw.items()}

    async def finish(self, group_id: str, trajectory_ids: list[str]) -> None:
        """After every member is published: remembers them as done, drops the parked bytes and the claim."""
        await self._finish(keys=self._keys(group_id), args=[self.ttl_s, *trajectory_ids])
