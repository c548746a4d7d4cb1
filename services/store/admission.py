"""The store's admission transactions: the gate's counters and the store's own record of a task
changed together, in one Lua script each.

A store killed between changing the gate (`trajmesh.gate`: version, accepted, running and the
capacity rule, `CAPACITY_LUA`) and writing its record (services/store/keys.py) would leak capacity
or count a group twice, so each transaction below is one script over both sets of keys:

- `admit`: the gate's admission of a group and the task's record, its unpublished copy, the
  admitted count and the pending group, idempotent per task id;
- `refill`: a new sample of a task in the place of an infra-failed member, capacity unchanged;
- `finish_group`: a whole group's release in the gate, once per group id (a kept group short of
  members holds its whole batch place: the gate's `unfilled`).

The gate knows none of the store's keys; this module passes them in (`GateSpec` gives the gate's).
"""

from __future__ import annotations

import redis.asyncio

from trajmesh.gate import CAPACITY_LUA, AsyncStalenessGate
from trajmesh.services.store.keys import RedisKeys

# KEYS: version, accepted, running, unfilled, tasks hash, unpublished hash, admitted count, pending zset.
# ARGV: n, eta, batch_size, max_concurrent, task id, task record, task bytes, group id,
# admission version (the score of the group in the pending set).
# try_admit plus the admission's record in one step: a store killed between admitting and
# recording can no longer leave `running` counting a task nobody will ever finish. Idempotent per
# task id: a client that retries the call after a timeout (the script ran, the reply was lost)
# gets {1, -1} and counts nothing twice. Seen with the store SIGSTOPped 12 s: on resume its
# pending call timed out, the retry admitted the same task again, and `admitted` and `running`
# kept 4 trajectories that no group would ever finish (exact accounting broken).
_TRY_ADMIT_RECORDED = """
if redis.call('HEXISTS', KEYS[5], ARGV[5]) == 1 then return {1, -1} end
""" + CAPACITY_LUA + """
if cap < n then return {0, cap} end
redis.call('INCRBY', KEYS[3], n)
redis.call('HSET', KEYS[5], ARGV[5], ARGV[6])
redis.call('HSET', KEYS[6], ARGV[5], ARGV[7])
redis.call('INCRBY', KEYS[7], n)
redis.call('ZADD', KEYS[8], ARGV[9], ARGV[8])
return {1, cap}
"""

# KEYS: accepted, running, unfilled, set of finished groups, hash group id -> n accepted. ARGV: group
# id, n accepted, n not accepted, n unfilled. finish() for a whole group, at most once per group id,
# atomically with marking it finished: a store killed in between can neither skip it (capacity
# leaked) nor repeat it (counted twice). The hash records how many of a group's members the gate
# counted as accepted (the end of a run reconciles the archive with it after a store crash). The
# caller drops both entries once the group is settled (every member final, so none can rebuild it).
# `unfilled` holds the rest of a kept group's batch place (G − accepted) in the gate's capacity,
# apart from `accepted`, which the archive's accepted rows reconcile with.
_FINISH_GROUP = """
if redis.call('SADD', KEYS[4], ARGV[1]) == 0 then return 0 end
local a = tonumber(ARGV[2])
local n = a + tonumber(ARGV[3])
local running = tonumber(redis.call('GET', KEYS[2]) or '0')
redis.call('SET', KEYS[2], math.max(running - n, 0))
if a > 0 then
  redis.call('INCRBY', KEYS[1], a)
  redis.call('HSET', KEYS[5], ARGV[1], a)
  redis.call('INCRBY', KEYS[3], tonumber(ARGV[4]))
end
return 1
"""

# KEYS: running, unpublished hash, admitted count, the group's refills hash, refills count, run
# finished flag. ARGV: failed member id, refill sample index, refill message id, refill task bytes,
# cap. Returns {status, refills of the group after}: status 1 admitted, 0 already refilled (a
# redelivery of the failed member), -1 the run is finished, -2 the group is at its cap.
# A refill is admitted in the failed member's place: the failed one leaves `running` (as a
# rejected member would at its group's finish) and the refill enters it, in one step, so capacity
# is unchanged and the slot cannot go to another group meanwhile (with eta 0 and a full gate that
# would leave the group waiting for capacity only its own completion can free). `admitted` counts
# the refill: the accounting's left side grows by one trajectory with its own final outcome.
_REFILL = """
local prior = redis.call('HGET', KEYS[4], ARGV[1])
if prior then return {0, redis.call('HLEN', KEYS[4])} end
if redis.call('EXISTS', KEYS[6]) == 1 then return {-1, redis.call('HLEN', KEYS[4])} end
if redis.call('HLEN', KEYS[4]) >= tonumber(ARGV[5]) then return {-2, redis.call('HLEN', KEYS[4])} end
local running = tonumber(redis.call('GET', KEYS[1]) or '0')
redis.call('SET', KEYS[1], math.max(running - 1, 0) + 1)
redis.call('HSET', KEYS[4], ARGV[1], ARGV[2])
redis.call('HSET', KEYS[2], ARGV[3], ARGV[4])
redis.call('INCRBY', KEYS[3], 1)
redis.call('INCRBY', KEYS[5], 1)
return {1, redis.call('HLEN', KEYS[4])}
"""


class Admission:
    """The three transactions of one run's store over its Redis client, its keys and its gate."""

    def __init__(self, client: redis.asyncio.Redis, keys: RedisKeys, gate: AsyncStalenessGate) -> None:
        self.keys = keys
        self.gate = gate.spec
        self._admit = client.register_script(_TRY_ADMIT_RECORDED)
        self._finish_group = client.register_script(_FINISH_GROUP)
        self._refill = client.register_script(_REFILL)

    async def admit(self, n: int, *, task_id: str, record: str, data: bytes, group_id: str, version: int) -> bool:
        """The gate's try_admit of `n` trajectories and, when admitted, in the same atomic step: the
        task's `record` (`keys.tasks`), its bytes until published (`keys.unpublished_tasks`), `n`
        more admitted (`keys.admitted_trajectories`) and `group_id` pending with score `version`,
        the learner version it was admitted at (`keys.pending_groups`)."""
        k = self.keys
        admitted, _capacity = await self._admit(
            keys=[*self.gate.keys, k.tasks, k.unpublished_tasks, k.admitted_trajectories, k.pending_groups],
            args=[*self.gate.admit_args(n), task_id, record, data, group_id, int(version)])
        return bool(int(admitted))

    async def refill(self, group_id: str, *, failed_id: str, index: int, msg_id: str, data: bytes,
                     cap: int) -> tuple[int, int]:
        """Admit one refill of `group_id` in the place of its infra-failed member `failed_id` (see
        `_REFILL`): its sample `index` in the group's refills, its task bytes unpublished under
        `msg_id`, one more admitted and one more refill in the run's count; `running` unchanged.
        Idempotent per `failed_id`; refused once the run is finished or the group has `cap`
        refills. Returns (1 admitted | 0 already | -1 finished | -2 cap, the group's refills after)."""
        k = self.keys
        status, refills = await self._refill(
            keys=[self.gate.running_key, k.unpublished_tasks, k.admitted_trajectories, k.group_refills(group_id),
                  k.refills_admitted, k.run_finished],
            args=[failed_id, int(index), msg_id, data, int(cap)])
        return int(status), int(refills)

    async def finish_group(self, group_id: str, *, accepted: int, rejected: int, place: int = 0) -> bool:
        """Release a whole group once: `accepted` trajectories move to the gate's `accepted`,
        `rejected` just leave `running`; the group joins `keys.groups_done` (and, when `accepted` >
        0, `keys.groups_accepted` records `accepted` under it). A kept group (`accepted` > 0) fills
        one of a batch's places, `place` trajectories (tasks.group_size) of the learner's B: the
        rest of it, `place` − `accepted`, goes to the gate's `unfilled`, so a group short of
        members takes as many of the gate's slots as a full one (without it, each let the gate
        admit that many trajectories more than the steps consume, and the extra groups aged into
        more due ones than a batch takes). False (nothing changed) if it was done already."""
        if accepted < 0 or rejected < 0 or accepted + rejected < 1:
            raise ValueError(f"need accepted, rejected >= 0 and a non-empty group, got {accepted}, {rejected}")
        k = self.keys
        done = await self._finish_group(
            keys=[self.gate.accepted_key, self.gate.running_key, self.gate.unfilled_key, k.groups_done,
                  k.groups_accepted],
            args=[group_id, accepted, rejected, max(place - accepted, 0) if accepted else 0])
        return bool(int(done))
