"""The staleness gate (docs/DESIGN.md §3; AReaL §7.3 of the survey), kept atomically in Redis.

With learner version v, batch size B (trajectories per learner step: `learner.batch_groups` places
of G), maximum lag η and the counters ``accepted``, ``unfilled`` and ``running`` (all counted in
trajectories)::

    capacity = (η + v + 1)·B − (accepted + unfilled + running)        [and ≤ max_concurrent − running]

The store admits a group of G trajectories only if capacity ≥ G (``running += G``). When the group
comes back graded, ``finish`` frees it: accepted groups move to ``accepted`` (they will be
trained), filtered or failed groups just leave ``running``. A kept group of k < G members (the
rest quarantined, say) still fills one of a batch's places, G trajectories of the B a step
consumes: the store's `finish_group` (services/store/admission.py) counts its k in ``accepted``
(what the archive's accepted rows reconcile with) and its G − k in ``unfilled``, so every kept
group takes G slots, as a full one does. The learner advancing to v+1 opens B more slots. So at most
(η+1)·B trajectories' worth of places are ever admitted beyond what versions < v consumed, which
bounds how stale an admitted trajectory can be at the time it is trained. (It does not bound
every token — interruptible generation can carry a trajectory across versions — so the learner
also checks v − u ≤ η per token at consume time.)

Every read-modify-write is one Lua script, so many store replicas can share one gate. The
counters live in Redis keys ``{prefix}:version``, ``{prefix}:accepted``, ``{prefix}:running``,
``{prefix}:unfilled``; with AOF on (see ``trajmesh.infra.RedisServer``) they survive a Redis restart.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any

import redis
import redis.asyncio

if TYPE_CHECKING:
    from typing_extensions import Self

    from trajmesh.config import RunConfig

__all__ = ["CAPACITY_LUA", "AsyncStalenessGate", "GateCounters", "GateSpec", "StalenessGate", "gate_prefix",
           "run_key"]

def run_key(namespace: str, name: str) -> str:
    """A run's Redis key `name`, in its namespace: the one spelling of every key's prefix (the
    gate's counters here, the store's record in services/store/keys.py)."""
    return f"{namespace}:trajmesh:{name}" if namespace else f"trajmesh:{name}"


def gate_prefix(namespace: str = "") -> str:
    """Prefix of the gate's counters in Redis (``<prefix>:version``, ``:accepted``, ``:running``,
    ``:unfilled``), namespaced like every key of a run."""
    return run_key(namespace, "gate")


# The capacity every admission script computes (this module's and the store's, which admit with their
# own records in the same step: services/store/admission.py). KEYS[1..4]: version, accepted, running,
# unfilled. ARGV[1..4]: n, eta, batch_size, max_concurrent (-1 = no cap). Leaves `cap` and `n` set:
# capacity = (eta + v + 1)·B − (accepted + unfilled + running).
CAPACITY_LUA = """
local v = tonumber(redis.call('GET', KEYS[1]) or '0')
local accepted = tonumber(redis.call('GET', KEYS[2]) or '0')
local running = tonumber(redis.call('GET', KEYS[3]) or '0')
local unfilled = tonumber(redis.call('GET', KEYS[4]) or '0')
local n = tonumber(ARGV[1])
local cap = (tonumber(ARGV[2]) + v + 1) * tonumber(ARGV[3]) - (accepted + unfilled + running)
local max_concurrent = tonumber(ARGV[4])
if max_concurrent >= 0 then cap = math.min(cap, max_concurrent - running) end
"""

# KEYS and ARGV as CAPACITY_LUA. Returns {admitted (0/1), capacity before admitting}.
_TRY_ADMIT = CAPACITY_LUA + """
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


# KEYS: version. ARGV: new version. Monotone: a lower version is ignored. Returns the version.
_SET_VERSION = """
local v = tonumber(redis.call('GET', KEYS[1]) or '0')
local new = tonumber(ARGV[1])
if new > v then redis.call('SET', KEYS[1], new) return new end
return v
"""

# KEYS: version, accepted, running, unfilled. ARGV: version, accepted.
_REBASE = """
redis.call('SET', KEYS[1], ARGV[1])
redis.call('SET', KEYS[2], ARGV[2])
redis.call('SET', KEYS[3], 0)
redis.call('SET', KEYS[4], 0)
return 1
"""


@dataclass(frozen=True)
class GateCounters:
    """One consistent snapshot of the gate (read with a single MGET)."""

    version: int
    accepted: int
    running: int
    # (η + version + 1)·B − (accepted + unfilled + running), before the max_concurrent cap.
    capacity: int
    # Places of kept groups their members did not fill: G − k for each kept group of k < G.
    unfilled: int = 0

    def as_dict(self) -> dict[str, int]:
        return asdict(self)


class GateSpec:
    """Keys, parameters and pure arithmetic shared by the sync and async gates (and the store's
    admission scripts, which write the same counters: `_Gate.spec`)."""

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
        self.unfilled_key = f"{key_prefix}:unfilled"
        self.keys = [self.version_key, self.accepted_key, self.running_key, self.unfilled_key]

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
        version, accepted, running, unfilled = (int(x) if x is not None else 0 for x in raw)
        capacity = (self.eta + version + 1) * self.batch_size - (accepted + unfilled + running)
        return GateCounters(version=version, accepted=accepted, running=running, capacity=capacity,
                            unfilled=unfilled)

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
        self._spec = GateSpec(
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
    def spec(self) -> GateSpec:
        """The counters' keys and the admission's arguments, for scripts that change them together
        with records of their own (services/store/admission.py)."""
        return self._spec

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
        so ``accepted = version·B`` (+ ``buffered``: the store's kept groups not yet trained, G
        each, whatever their members), ``unfilled = 0`` and ``running = 0``: in-flight tasks are
        unacked on JetStream and come back by redelivery, to be admitted again. The version is set
        exactly, not monotonically, because recovery may move it back. A finish() for work
        admitted before the rebase clamps ``running`` at 0 rather than going negative.
        """
        s = self._spec
        self._rebase(keys=s.keys, args=s.rebase_args(version, buffered))


class AsyncStalenessGate(_Gate):
    """The same gate over ``redis.asyncio.Redis``, for asyncio services (the store). The store's
    admissions that also write its own records are the store's (services/store/admission.py)."""

    _r: redis.asyncio.Redis

    async def try_admit(self, n: int) -> bool:
        """See :meth:`StalenessGate.try_admit`."""
        s = self._spec
        admitted, _capacity = await self._try_admit(keys=s.keys, args=s.admit_args(n))
        return bool(int(admitted))

    async def finish(self, n: int, accepted: bool) -> None:
        """See :meth:`StalenessGate.finish`."""
        s = self._spec
        await self._finish(keys=[s.accepted_key, s.running_key], args=s.finish_args(n, accepted))

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
