"""The store's admission transactions: the gate's counters and the store's own record of a task
changed together, in one Lua script each.

A store killed between changing the gate (`trajmesh.gate`: version, accepted, running and the
capacity rule, `CAPACITY_LUA`) and writing its record (services/store/keys.py) would leak capacity
or count a group twice, so each transaction below is one script over both sets of keys:

- `admit`: the gate's admission of a group and the task's record, its unpublished copy, the
  admitted count and the pending group, idempotent per task id;
- `refill`: a new sample of a task in the place of an infra-failed member, capacity unchanged;
- `finish_group`: a whole group's release in the gate, once per group id (a kept group short of
  members holds its whole batch place: the gate's `unfilled`);
- `intake`: a run of graded trajectories taken in: each one's lookup, its group membership and,
  for a group it completes, the group's `finish_group`, in one step (`store.pipelined_intake`).

The gate knows none of the store's keys; this module passes them in (`GateSpec` gives the gate's).
"""

from __future__ import annotations

from typing import Any

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

# finish() for a whole group, at most once per group id, atomically with marking it finished: a
# store killed in between can neither skip it (capacity leaked) nor repeat it (counted twice).
# Arguments: the gate's accepted, running and unfilled keys, the set of finished groups, the hash
# group id -> n accepted; the group id, n accepted, n not accepted, n unfilled. The hash records
# how many of a group's members the gate counted as accepted (the end of a run reconciles the
# archive with it after a store crash). The caller drops both entries once the group is settled
# (every member final, so none can rebuild it). `unfilled` holds the rest of a kept group's batch
# place (G − accepted) in the gate's capacity, apart from `accepted`, which the archive's accepted
# rows reconcile with. A Lua function: the group's finish script and the intake script share it.
_FINISH_FN = """
local function finish_group(accepted_key, running_key, unfilled_key, done_key, kept_key, gid, a, r, u)
  if redis.call('SADD', done_key, gid) == 0 then return 0 end
  local running = tonumber(redis.call('GET', running_key) or '0')
  redis.call('SET', running_key, math.max(running - (a + r), 0))
  if a > 0 then
    redis.call('INCRBY', accepted_key, a)
    redis.call('HSET', kept_key, gid, a)
    redis.call('INCRBY', unfilled_key, u)
  end
  return 1
end
"""

# KEYS: accepted, running, unfilled, set of finished groups, hash group id -> n accepted. ARGV: group
# id, n accepted, n not accepted, n unfilled.
_FINISH_GROUP = _FINISH_FN + """
return finish_group(KEYS[1], KEYS[2], KEYS[3], KEYS[4], KEYS[5], ARGV[1], tonumber(ARGV[2]), tonumber(ARGV[3]),
                    tonumber(ARGV[4]))
"""

INTAKE_ITEM_ARGS = 11
"""ARGV per item of `_INTAKE` (see `Admission.intake`)."""

# KEYS: 1 the gate's version, 2 tasks hash, 3 final set, 4 pending zset, 5 settled bitmap, 6 open
# groups, 7-9 the gate's accepted, running, unfilled, 10 finished groups, 11 group id -> n accepted;
# then per item: its group's received set, valid set, refills hash.
# ARGV: 1 items, 2 eta, 3 a kept group's place; then per item (INTAKE_ITEM_ARGS): task id,
# trajectory id, group id, sampler cursor of a task member (-1: none), valid member (1/0), newest
# version, oldest sampled version, the valid members its group holds after it when every
# valid-member item of the group so far is recorded valid, refills the store knows of, the
# group's accepted count if it completes (-1: not finished here), last (1: the group's last item).
# One step per run of messages: each one's lookup (`StoreRepo.lookup`'s facts), then, for a member
# of its task's group, its membership (`StoreRepo.record_members`), valid when it is a valid member
# (`intake.Prejudged.valid_member`), has no version from the future and is not stale on arrival
# (its group pending, its oldest sampled version more than eta behind); then, when its group is
# complete by the store's rule (`StoreState.take_member`) at the group's last item, the group's
# finish (and a filtered one leaves the pending set). The store computes every verdict again from
# the facts returned and checks they agree; what the script cannot decide (a valid member that was
# not recorded valid, a RoC selection) it leaves to the store (finish code -1).
# Returns {version, then per item: recorded, valid, received, valid count, task record or nil,
# final, pending, refills, finish (-2 not complete, -1 left to the store, 0 finished already, 1 finished)}.
_INTAKE = _FINISH_FN + """
local version = tonumber(redis.call('GET', KEYS[1]) or '0')
local n, eta, place = tonumber(ARGV[1]), tonumber(ARGV[2]), tonumber(ARGV[3])
local broken, completed = {}, {}
local out = {version}
for i = 0, n - 1 do
  local a, k = 3 + 11 * i, 11 + 3 * i
  local task_id, tid, gid = ARGV[a + 1], ARGV[a + 2], ARGV[a + 3]
  local cursor, good = tonumber(ARGV[a + 4]), ARGV[a + 5] == '1'
  local newest, oldest, held = tonumber(ARGV[a + 6]), tonumber(ARGV[a + 7]), tonumber(ARGV[a + 8])
  local raw = redis.call('HGET', KEYS[2], task_id)
  local marked = redis.call('SISMEMBER', KEYS[3], tid)
  local pending = redis.call('ZSCORE', KEYS[4], gid)
  local bit = redis.call('GETBIT', KEYS[5], math.max(cursor, 0))
  local refills = redis.call('HLEN', KEYS[k + 3])
  local final = marked == 1 or (cursor >= 0 and bit == 1)
  local recorded, valid, received, nvalid, finish = 0, 0, 0, 0, -2
  local rec = nil
  if raw and not final then rec = cjson.decode(raw) end
  if rec and rec['group_id'] == gid then
    recorded = 1
    local stale = pending and oldest >= 0 and version - oldest > eta
    if good and newest <= version and not stale then valid = 1 end
    redis.call('SADD', KEYS[6], gid)
    redis.call('SADD', KEYS[k + 1], tid)
    if valid == 1 then redis.call('SADD', KEYS[k + 2], tid) else redis.call('SREM', KEYS[k + 2], tid) end
    received = redis.call('SCARD', KEYS[k + 1])
    nvalid = redis.call('SCARD', KEYS[k + 2])
  end
  if good and valid == 0 then broken[gid] = true end
  if recorded == 1 then
    local size = tonumber(rec['group_size'])
    if broken[gid] or completed[gid] then
      finish = -1
    elseif received >= size + math.max(refills, tonumber(ARGV[a + 9])) and held >= nvalid then
      completed[gid] = true
      local kept = tonumber(ARGV[a + 10])
      if kept >= 0 and kept <= size and ARGV[a + 11] == '1' then
        local unfilled = 0
        if kept > 0 then unfilled = math.max(place - kept, 0) end
        finish = finish_group(KEYS[7], KEYS[8], KEYS[9], KEYS[10], KEYS[11], gid, kept, size - kept, unfilled)
        if kept == 0 then redis.call('ZREM', KEYS[4], gid) end
      else
        finish = -1
      end
    end
  end
  local f = 0
  if final then f = 1 end
  local p = 0
  if pending then p = 1 end
  table.insert(out, {recorded, valid, received, nvalid, raw, f, p, refills, finish})
end
return out
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
    """The four transactions of one run's store over its Redis client, its keys and its gate."""

    def __init__(self, client: redis.asyncio.Redis, keys: RedisKeys, gate: AsyncStalenessGate) -> None:
        self.keys = keys
        self.gate = gate.spec
        self._admit = client.register_script(_TRY_ADMIT_RECORDED)
        self._finish_group = client.register_script(_FINISH_GROUP)
        self._refill = client.register_script(_REFILL)
        self._intake = client.register_script(_INTAKE)

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

    async def intake(self, version_key: str, items: list[tuple[Any, ...]], *, eta: int, place: int) -> list[Any]:
        """One run of TRAJ_GRADED messages in one atomic step (see `_INTAKE`): `items` are each
        message's ARGV (`INTAKE_ITEM_ARGS` of them) with its group id third. Returns the script's
        reply (the learner version, then each item's facts)."""
        k = self.keys
        keys = [version_key, k.tasks, k.final_trajectories, k.pending_groups, k.settled_tasks, k.open_groups,
                self.gate.accepted_key, self.gate.running_key, self.gate.unfilled_key, k.groups_done,
                k.groups_accepted]
        args: list[Any] = [len(items), int(eta), int(place)]
        for item in items:
            assert len(item) == INTAKE_ITEM_ARGS
            gid = str(item[2])
            keys += [k.group_received(gid), k.group_valid(gid), k.group_refills(gid)]
            args += item
        return list(await self._intake(keys=keys, args=args))
