"""The staleness gate (docs/DESIGN.md §3; AReaL §7.3 of the survey), kept atomically in Redis.

With learner version v, batch size B (trajectories per learner step), maximum lag η and the
counters ``accepted`` and ``running`` (all counted in trajectories)::

    capacity = (η + v + 1)·B − (accepted + running)        [and ≤ max_concurrent − running]

The store admits a group of G trajectories only if capacity ≥ G (``running += G``). When the group
comes back graded, ``finish`` frees it: accepted groups move to ``accepted`` (they will be
trained), filtered or failed groups just leave ``running``. The learner advancing to v+1 opens B
more slots. So at most (η+1)·B trajectories are ever admitted beyond what versions < v consumed,
which bounds how stale an admitted trajectory can be at the time it is trained. (It does not
bound every token — interruptible generation can carry a trajectory across versions — so the
learner also checks v − u ≤ η per token at consume time.)

Every read-modify-write is one Lua script, so many store replicas can share one gate. The
counters live in Redis keys ``{prefix}:version``, ``{prefix}:accepted``, ``{prefix}:running``;
with AOF on (see ``trajmesh.infra.RedisServer``) they survive a Redis restart.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any

import redis
import redis.asyncio

if TYPE_CHECKING:
    from typing_extensions import Self

    from trajmesh.config import RunConfig

__all__ = ["AsyncStalenessGate", "GateCounters", "StalenessGate"]

def gate_prefix(namespace: str = "") -> str:
    """Prefix of the gate's counters in Redis (``<prefix>:version``, ``:accepted``, ``:running``),
    namespaced like every key of a run."""
    return f"{namespace}:trajmesh:gate" if namespace else "trajmesh:gate"


# The capacity both admission scripts compute. KEYS[1..3]: version, accepted, running. ARGV[1..4]:
# n, eta, batch_size, max_concurrent (-1 = no cap). capacity = (eta + v + 1)·B − (accepted + running).
_CAPACITY = """
local v = tonumber(redis.call('GET', KEYS[1]) or '0')
local accepted = tonumber(redis.call('GET', KEYS[2]) or '0')
local running = tonumber(redis.call('GET', KEYS[3]) or '0')
local n = tonumber(ARGV[1])
local cap = (tonumber(ARGV[2]) + v + 1) * tonumber(ARGV[3]) - (accepted + running)
local max_concurrent = tonumber(ARGV[4])
if max_concurrent >= 0 then cap = math.min(cap, max_concurrent - running) end
"""

# KEYS and ARGV as _CAPACITY. Returns {admitted (0/1), capacity before admitting}.
_TRY_ADMIT = _CAPACITY + """
if cap >= n then
  redis.call('INCRBY', KEYS[3], n)
  return {1, cap}
end
return {0, cap}
"""

# KEYS: accepted, running. ARGV: n, accepted (0/1). running never goes below 0: work admitted
# before a rebase (which zeroes running) may still finish afterwards.
_FINISH = """
local n = tonumber(ARGV[1])
local running = tonumber(redis.call('GET', KEYS[2]) or '0')
redis.call('SET', KEYS[2], math.max(running - n, 0))
if ARGV[2] == '1' then redis.call('INCRBY', KEYS[1], n) end
return redis.call('GET', KEYS[2])
"""

# KEYS: version, accepted, running, tasks hash, unpublished hash, admitted count, pending zset.
# ARGV: n, eta, batch_size, max_concurrent, task id, task record, task bytes, group id,
# admission version (the score of the group in the pending set).
# try_admit plus the admission's record in one step: a store killed between admitting and
# recording can no longer leave `running` counting a task nobody will ever finish. Idempotent per
# task id: a client that retries the call after a timeout (the script ran, the reply was lost)
# gets {1, -1} and counts nothing twice. Seen with the store SIGSTOPped 12 s: on resume its
# pending call timed out, the retry admitted the same task again, and `admitted` and `running`
# kept 4 trajectories that no group would ever finish (exact accounting broken).
_TRY_ADMIT_RECORDED = """
if redis.call('HEXISTS', KEYS[4], ARGV[5]) == 1 then return {1, -1} end
""" + _CAPACITY + """
if cap < n then return {0, cap} end
redis.call('INCRBY', KEYS[3], n)
redis.call('HSET', KEYS[4], ARGV[5], ARGV[6])
redis.call('HSET', KEYS[5], ARGV[5], ARGV[7])
redis.call('INCRBY', KEYS[6], n)
redis.call('ZADD', KEYS[7], ARGV[9], ARGV[8])
return {1, cap}
"""

# KEYS: accepted, running, set of finished groups[, hash group id -> n accepted]. ARGV: group id,
# n accepted, n not accepted. finish() for a whole group, at most once per group id, atomically with
# marking it finished: a store killed in between can neither skip it (capacity leaked) nor repeat it
# (counted twice). The optional hash records how many of a group's members the gate counted as
# accepted (the end of a run reconciles the archive with it after a store crash). The caller drops
# both entries once the group is settled (every member final, so none can rebuild it).
_FINISH_GROUP = """
if redis.call('SADD', KEYS[3], ARGV[1]) == 0 then return 0 end
local a = tonumber(ARGV[2])
local n = a + tonumber(ARGV[3])
local running = tonumber(redis.call('GET', KEYS[2]) or '0')
redis.call('SET', KEYS[2], math.max(running - n, 0))
if a > 0 then
  redis.call('INCRBY', KEYS[1], a)
  if #KEYS >= 4 then redis.call('HSET', KEYS[4], ARGV[1], a) end
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

# KEYS: version. ARGV: new version. Monotone: a lower version is ignored. Returns the version.
_SET_VERSION = """
local v = tonumber(redis.call('GET', KEYS[1]) or '0')
local new = tonumber(ARGV[1])
if new > v then redis.call('SET', KEYS[1], new) return new end
return v
"""

# KEYS: version, accepted, running. ARGV: version, accepted.
_REBASE = """
redis.call('SET', KEYS[1], ARGV[1])
redis.call('SET', KEYS[2], ARGV[2])
redis.call('SET', KEYS[3], 0)
return 1
"""


@dataclass(frozen=True)
class GateCounters:
    """One consistent snapshot of the gate (read with a single MGET)."""

    version: int
    accepted: int
    running: int
    # (η + version + 1)·B − (accepted + running), before the max_concurrent cap.
    capacity: int

    def as_dict(self) -> dict[str, int]:
        return asdict(self)


class _GateSpec:
    """Keys, parameters and pure arithmetic shared by the sync and async gates."""

    def __init__(self, *, key_prefix: str, eta: int, batch_size: int, max_concurrent: int | None) -> None:
        if eta < 0:
            raise ValueError(f"eta must be >= 0, got {eta}")
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        if max_concurrent is not None and max_concurrent < 1:
            raise ValueError(f"max_concurrent must be >= 1 or None, got {max_concurrent}")
        self.key_prefix = key_prefix
        self.eta = eta
        self.batch_size = batch_size
        self.max_concurrent = max_concurrent
        self.version_key = f"{key_prefix}:version"
        self.accepted_key = f"{key_prefix}:accepted"
        self.running_key = f"{key_prefix}:running"
        self.keys = [self.version_key, self.accepted_key, self.running_key]

    def admit_args(self, n: int) -> list[int]:
        if n < 1:
            raise ValueError(f"n must be >= 1, got {n}")
        cap = -1 if self.max_concurrent is None else self.max_concurrent
        return [n, self.eta, self.batch_size, cap]

    @staticmethod
    def finish_args(n: int, accepted: bool) -> list[int]:
        if n < 1:
            raise ValueError(f"n must be >= 1, got {n}")
        return [n, 1 if accepted else 0]

    def rebase_args(self, version: int, buffered: int) -> list[int]:
        if version < 0 or buffered < 0:
            raise ValueError(f"version and buffered must be >= 0, got {version}, {buffered}")
        return [version, version * self.batch_size + buffered]

    def snapshot(self, raw: list[Any]) -> GateCounters:
        version, accepted, running = (int(x) if x is not None else 0 for x in raw)
        capacity = (self.eta + version + 1) * self.batch_size - (accepted + running)
        return GateCounters(version=version, accepted=accepted, running=running, capacity=capacity)

    def effective_capacity(self, c: GateCounters) -> int:
        if self.max_concurrent is None:
            return c.capacity
        return min(c.capacity, self.max_concurrent - c.running)


class _Gate:
    """What both gates share: the spec (keys, η, B, the optional cap), the Lua scripts registered on
    the client, and how a run's config builds one (`from_config`, the one place that maps config to
    a gate)."""

    def __init__(
        self,
        redis_client: Any,
        *,
        key_prefix: str,
        eta: int,
        batch_size: int,
        max_concurrent: int | None = None,
    ) -> None:
        self._r = redis_client
        self._spec = _GateSpec(
            key_prefix=key_prefix, eta=eta, batch_size=batch_size, max_concurrent=max_concurrent
        )
        self._try_admit = redis_client.register_script(_TRY_ADMIT)
        self._finish = redis_client.register_script(_FINISH)
        self._set_version = redis_client.register_script(_SET_VERSION)
        self._rebase = redis_client.register_script(_REBASE)

    @classmethod
    def from_config(cls, redis_client: Any, cfg: RunConfig) -> Self:
        """The run's gate: its namespace's keys, the effective η (0 in sync mode), B = the learner's
        batch in trajectories, and `gate.max_concurrent`."""
        return cls(redis_client, key_prefix=gate_prefix(cfg.infra.namespace), eta=cfg.effective_eta,
                   batch_size=cfg.batch_trajectories, max_concurrent=cfg.gate.max_concurrent)

    @property
    def eta(self) -> int:
        return self._spec.eta

    @property
    def batch_size(self) -> int:
        return self._spec.batch_size


class StalenessGate(_Gate):
    """The gate over a synchronous ``redis.Redis`` client; safe to share across threads.

    ``key_prefix`` scopes the counters to one run (e.g. ``trajmesh:<run_id>:gate``); ``eta`` is
    the maximum lag η in learner versions; ``batch_size`` is B, trajectories per learner step;
    ``max_concurrent`` optionally also caps ``running`` (rollout fleet capacity).
    """

    _r: redis.Redis

    def try_admit(self, n: int) -> bool:
        """Admit ``n`` trajectories (running += n) iff capacity ≥ n, atomically."""
        s = self._spec
        admitted, _capacity = self._try_admit(keys=s.keys, args=s.admit_args(n))
        return bool(int(admitted))

    def finish(self, n: int, accepted: bool) -> None:
        """Release ``n`` admitted trajectories; ``accepted`` ones count as trained-or-to-be."""
        s = self._spec
        self._finish(keys=[s.accepted_key, s.running_key], args=s.finish_args(n, accepted))

    def set_version(self, version: int) -> int:
        """Record that the learner reached ``version``; never decreases. Returns the stored one."""
        return int(self._set_version(keys=[self._spec.version_key], args=[int(version)]))

    def version(self) -> int:
        return self.counters().version

    def counters(self) -> GateCounters:
        """Version, accepted, running and capacity from one atomic MGET."""
        return self._spec.snapshot(self._r.mget(self._spec.keys))

    def capacity(self) -> int:
        """Trajectories that could be admitted now (max_concurrent cap applied)."""
        return self._spec.effective_capacity(self.counters())

    def rebase_after_recovery(self, version: int, *, buffered: int = 0) -> None:
        """Re-base the counters after the learner resumed from a checkpoint at ``version``.

        Why (AReaL PR #1345 / issue #1388): the counters outlive the learner. After a crash,
        ``accepted`` still counts trajectories that the lost steps ≥ ``version`` were going to
        train and ``running`` counts work whose results may never be reported, so capacity
        would stay pinned near zero (or, if ``version`` went back, negative) and rollout would
        stall. The learner at ``version`` has consumed exactly the batches of steps < version,
        so ``accepted = version·B`` (+ ``buffered``: trajectories the store still holds,
        accepted but not yet trained) and ``running = 0``: in-flight tasks are unacked on
        JetStream and come back by redelivery, to be admitted again. The version is set
        exactly, not monotonically, because recovery may move it back. A finish() for work
        admitted before the rebase clamps ``running`` at 0 rather than going negative.
        """
        s = self._spec
        self._rebase(keys=s.keys, args=s.rebase_args(version, buffered))


class AsyncStalenessGate(_Gate):
    """The same gate over ``redis.asyncio.Redis``, for asyncio services (the store), with the
    store's two group-aware scripts besides."""

    _r: redis.asyncio.Redis

    def __init__(self, redis_client: redis.asyncio.Redis, **spec: Any) -> None:
        super().__init__(redis_client, **spec)
        self._try_admit_recorded = redis_client.register_script(_TRY_ADMIT_RECORDED)
        self._finish_group = redis_client.register_script(_FINISH_GROUP)
        self._refill = redis_client.register_script(_REFILL)

    async def try_admit(self, n: int) -> bool:
        """See :meth:`StalenessGate.try_admit`."""
        s = self._spec
        admitted, _capacity = await self._try_admit(keys=s.keys, args=s.admit_args(n))
        return bool(int(admitted))

    async def finish(self, n: int, accepted: bool) -> None:
        """See :meth:`StalenessGate.finish`."""
        s = self._spec
        await self._finish(keys=[s.accepted_key, s.running_key], args=s.finish_args(n, accepted))

    async def try_admit_recorded(self, n: int, *, task_id: str, record: str, data: bytes, group_id: str,
                                 version: int, tasks_key: str, unpublished_key: str, admitted_key: str,
                                 pending_key: str) -> bool:
        """:meth:`try_admit`, and when admitted, in the same atomic step: the task's `record` in
        hash `tasks_key`, its bytes in `unpublished_key` (cleared once published), `n` more in
        the admitted count `admitted_key`, and `group_id` in sorted set `pending_key` with score
        `version` (the learner version it was admitted at)."""
        s = self._spec
        admitted, _capacity = await self._try_admit_recorded(
            keys=[*s.keys, tasks_key, unpublished_key, admitted_key, pending_key],
            args=[*s.admit_args(n), task_id, record, data, group_id, int(version)])
        return bool(int(admitted))

    async def refill(self, *, failed_id: str, index: int, msg_id: str, data: bytes, cap: int,
                     unpublished_key: str, admitted_key: str, refills_key: str, refills_total_key: str,
                     finished_key: str) -> tuple[int, int]:
        """Admit one refill of a group in the place of its infra-failed member `failed_id` (see
        `_REFILL`): its sample `index` in hash `refills_key`, its task bytes in `unpublished_key`
        under `msg_id`, one more in `admitted_key` and `refills_total_key`; `running` unchanged.
        Idempotent per `failed_id`; refused once the run is finished (`finished_key` exists) or
        the group has `cap` refills. Returns (1 admitted | 0 already | -1 finished | -2 cap, the
        group's refills after)."""
        status, refills = await self._refill(
            keys=[self._spec.running_key, unpublished_key, admitted_key, refills_key, refills_total_key, finished_key],
            args=[failed_id, int(index), msg_id, data, int(cap)])
        return int(status), int(refills)

    async def finish_group(self, group_id: str, *, accepted: int, rejected: int, done_key: str,
                           accepted_by_group_key: str | None = None) -> bool:
        """Release a whole group once: `accepted` trajectories move to `accepted`, `rejected` just
        leave `running`; `group_id` joins set `done_key` (and, when `accepted` > 0, hash
        `accepted_by_group_key` records `accepted` under it). False (nothing changed) if it was there."""
        if accepted < 0 or rejected < 0 or accepted + rejected < 1:
            raise ValueError(f"need accepted, rejected >= 0 and a non-empty group, got {accepted}, {rejected}")
        s = self._spec
        keys = [s.accepted_key, s.running_key, done_key]
        if accepted_by_group_key is not None:
            keys.append(accepted_by_group_key)
        done = await self._finish_group(keys=keys, args=[group_id, accepted, rejected])
        return bool(int(done))

    async def set_version(self, version: int) -> int:
        """See :meth:`StalenessGate.set_version`."""
        return int(await self._set_version(keys=[self._spec.version_key], args=[int(version)]))

    async def version(self) -> int:
        return (await self.counters()).version

    @property
    def version_key(self) -> str:
        """The Redis key holding the learner version (for callers that batch it into a pipeline;
        parse with `int(raw or 0)`)."""
        return self._spec.version_key

    async def counters(self) -> GateCounters:
        return self._spec.snapshot(await self._r.mget(self._spec.keys))

    async def capacity(self) -> int:
        return self._spec.effective_capacity(await self.counters())

    async def rebase_after_recovery(self, version: int, *, buffered: int = 0) -> None:
        """See :meth:`StalenessGate.rebase_after_recovery`."""
        s = self._spec
        await self._rebase(keys=s.keys, args=s.rebase_args(version, buffered))
