"""The trajectory store's bookkeeping as one pure state machine (no I/O, no torch).

Every trajectory the store takes in as a valid group member has one `TrajectoryRecord` with an
explicit state; `TRANSITIONS` says, for each (state, event), the next state and the side effects,
and `StoreState._apply` is the one function that moves records (and the group indexes derived from
them) and checks the invariants after each move::

    RECEIVED ──(its group completes, kept)──▶ READY ──(NextBatch)──▶ HANDED_OUT ──(Report)──▶ FINAL
       │                                         │                       │
       │ (group filtered / invalid member)       │ (end of run)          │ (a new learner process:
       └────────────────▶ FINAL ◀────────────────┘                       │  back to READY, in order)
                                                                         └──▶ READY

An invalid member never gets a record: it is FINAL on arrival (`finalize`). A record reaching FINAL
leaves the store's memory; its outcome waits in the commit queue. Until FINAL a trajectory's
TRAJ_GRADED message stays unacked (JetStream redelivers it to a restarted store). FINAL means:
archived, then (at the next `take_commit`) marked final in Redis and acked. Recovery paths:

- **redelivery** of a message the store still holds: the newest handle replaces the old one;
- **a dead learner** (the next one says so on its first NextBatch): what it took and never
  reported goes back to READY, in admission order;
- **a store restart**: the new store learns from Redis which trajectories its predecessor held
  (`begin_recovery`) and hands nothing to the learner until they are all back (or a deadline
  passes), so the learner cannot advance past them while they wait for redelivery — the
  mechanism behind `stale` quarantines after a store restart (issue 16);
- **the end of a finished run** (`end_of_run`): whatever is still held ends as a recorded final
  outcome (`filtered:unused_at_end_of_run` or `in_flight_at_stop:held_at_stop`), never a gap.

**Infra failures refill the sample, not the group.** A member that ends INFRA_FAILURE (its engine,
environment, agent, teacher or grader failed, or its deadline passed: `Trajectory.infra_cause`) is
FINAL on arrival as `failed_infra:infra_<cause>`, like any invalid member; but first the store
admits a refill in its place (`StoreRepo.refill`, one gate step: a new trajectory of the same task,
id task id + "-" + (G + k), counted in `admitted`, the failed one's slot handed over so capacity is
unchanged) and publishes it on TASKS. The group then completes at G + refills members received
(`Group.refills`), so it trains on G valid samples, not G − 1. At most
`store.infra_refills_per_group` per group, none once the run is finished: past that the group ends
with the members it has, by the rule above (`filter_reason`).

READY groups are served oldest admission first (`Group.order`, the sampler cursor), so groups
rebuilt after a restart or recycled from a dead learner never fall behind younger ones. And a
group admitted at learner version a may be trained at versions ≤ a + η only: when the learner is
at v, every group admitted at ≤ v − η ("due") must be in the batch it takes now, so `hand_out`
holds the learner until a due straggler is ready (at most `straggler_wait_s`) instead of letting
younger groups overtake it and leaving it to be generated, graded and thrown away as stale.
"""

from __future__ import annotations

import bisect
import enum
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from trajmesh.contract import Trajectory

UNUSED_AT_END = ("filtered", "unused_at_end_of_run")
"""Final outcome of a kept trajectory the learner never took before the run finished."""
HELD_AT_STOP = ("in_flight_at_stop", "held_at_stop")
"""Final outcome of a member whose group was still incomplete when the finished run stopped."""
NOT_RETURNED = ("in_flight_at_stop", "not_returned")
"""Final outcome of an admitted trajectory that never reached a live store before the run stopped."""
ACCEPTED_BEFORE_CRASH = "before_store_crash"
"""Reason of an ``accepted`` row the end of a run writes for a member of a group the gate had
finished as kept while its store's own ``accepted`` row was lost unflushed in a crash."""


class TrajectoryState(enum.Enum):
    RECEIVED = "received"
    """Taken in as a valid member; its group is still assembling (or being judged)."""
    READY = "ready"
    """Its group is complete and kept, waiting for the learner."""
    HANDED_OUT = "handed_out"
    """Given to the learner, not yet reported."""
    FINAL = "final"
    """Its outcome is decided: the record is gone, the outcome waits for the next commit."""


HELD_STATES = (TrajectoryState.RECEIVED, TrajectoryState.READY, TrajectoryState.HANDED_OUT)
"""The states of a record the store keeps (FINAL ones leave)."""


class Event(enum.Enum):
    TAKE = "take"
    """A valid member's membership is recorded in Redis (`take_member`)."""
    REDELIVER = "redeliver"
    """A newer message for an id already held (`redelivered`)."""
    KEEP = "keep"
    """Its complete group passed the filters (`make_ready`)."""
    FILTER = "filter"
    """Its complete group was dropped by a filter (`filter_group`)."""
    HAND_OUT = "hand_out"
    """Its group went to the learner (`hand_out`)."""
    REPORT = "report"
    """The learner's verdict, or a report of an id a restarted store holds again (`report`)."""
    RECYCLE = "recycle"
    """A new learner process: the old one's unreported group goes back (`recycle_handed_out`)."""
    END_OF_RUN = "end_of_run"
    """The run finished while it was held (`end_of_run`)."""


class Effect(enum.Enum):
    """The side effects a transition has besides the record's new state (see `StoreState._effect`)."""
    JOIN_GROUP = "join_group"
    """The record is created and its trajectory joins its group's members."""
    NEW_HANDLE = "new_handle"
    """The record keeps the newest message handle."""
    PAY_OWED = "pay_owed"
    """Recovery: the id is back, no longer owed (a held id never is)."""
    QUEUE_GROUP = "queue_group"
    """Its group enters the READY index (sorted by admission order), once."""
    UNQUEUE_GROUP = "unqueue_group"
    """Its group leaves the READY index."""
    HAND_GROUP = "hand_group"
    """Its group enters the HANDED_OUT index, stamped with the learner version that took it."""
    UNHAND_GROUP = "unhand_group"
    """Its group leaves the HANDED_OUT index (the taker's version is cleared)."""
    QUEUE_FINAL = "queue_final"
    """Its id and message go to the commit queue (marked final and acked at the next commit)."""
    LEAVE = "leave"
    """The record goes and its trajectory leaves its group; a group left empty leaves the indexes."""


_S, _E, _F = TrajectoryState, Event, Effect
TRANSITIONS: dict[tuple[TrajectoryState | None, Event], tuple[TrajectoryState, tuple[Effect, ...]]] = {
    (None, _E.TAKE): (_S.RECEIVED, (_F.JOIN_GROUP, _F.PAY_OWED)),
    (_S.RECEIVED, _E.REDELIVER): (_S.RECEIVED, (_F.NEW_HANDLE,)),
    (_S.READY, _E.REDELIVER): (_S.READY, (_F.NEW_HANDLE,)),
    (_S.HANDED_OUT, _E.REDELIVER): (_S.HANDED_OUT, (_F.NEW_HANDLE,)),
    (_S.RECEIVED, _E.KEEP): (_S.READY, (_F.QUEUE_GROUP,)),
    (_S.RECEIVED, _E.FILTER): (_S.FINAL, (_F.QUEUE_FINAL, _F.LEAVE)),
    (_S.READY, _E.HAND_OUT): (_S.HANDED_OUT, (_F.UNQUEUE_GROUP, _F.HAND_GROUP)),
    (_S.HANDED_OUT, _E.RECYCLE): (_S.READY, (_F.UNHAND_GROUP, _F.QUEUE_GROUP)),
    # A report's outcome is queued by the caller (`finalize`): only it knows whether Redis has the
    # id final already (then the message is acked without a second mark).
    (_S.RECEIVED, _E.REPORT): (_S.FINAL, (_F.LEAVE,)),
    (_S.READY, _E.REPORT): (_S.FINAL, (_F.LEAVE,)),
    (_S.HANDED_OUT, _E.REPORT): (_S.FINAL, (_F.LEAVE,)),
    (_S.RECEIVED, _E.END_OF_RUN): (_S.FINAL, (_F.QUEUE_FINAL, _F.LEAVE)),
    (_S.READY, _E.END_OF_RUN): (_S.FINAL, (_F.QUEUE_FINAL, _F.LEAVE)),
    (_S.HANDED_OUT, _E.END_OF_RUN): (_S.FINAL, (_F.QUEUE_FINAL, _F.LEAVE)),
}
"""(state, event) → (next state, side effects); state None: the id has no record. Any pair not
here is a bug of the caller (`InvalidTransition`)."""


class InvalidTransition(RuntimeError):
    """An event the transitions table does not allow in the record's state."""


class InvariantViolation(RuntimeError):
    """The records and the indexes derived from them disagree after a transition."""


@dataclass(eq=False)
class Group:
    group_id: str
    expected: int
    """G: members admitted for this group's task."""
    refills: int = 0
    """Members admitted since, each in the place of an infra-failed one: the group is complete
    when G + refills have come back."""
    order: int = 1 << 62
    """Admission order (sampler cursor); READY groups are served lowest first."""
    admitted_version: int = 0
    """Learner version when the gate admitted it: it must be trained at a version ≤ this + η."""
    source: str = ""
    members: list[Trajectory] = field(default_factory=list)
    """Valid members held (the ones the learner may train): every one has a record."""
    ready_at: float = 0.0
    """time.time() when the group became ready for the learner."""
    taken_at: int | None = None
    """The learner version that took it (None unless its members are HANDED_OUT)."""


@dataclass(eq=False)
class TrajectoryRecord:
    """One held trajectory: its state, its group (admission order and version), its message."""
    traj: Trajectory
    group: Group
    msg: Any
    """The newest unacked TRAJ_GRADED message handle (None: it came back by Report only)."""
    state: TrajectoryState = TrajectoryState.RECEIVED

    @property
    def trajectory_id(self) -> str:
        return self.traj.trajectory_id

    @property
    def group_id(self) -> str:
        return self.group.group_id

    @property
    def admitted_version(self) -> int:
        return self.group.admitted_version

    @property
    def taken_at(self) -> int | None:
        """The learner version that took it (HANDED_OUT only)."""
        return self.group.taken_at


class Commit(NamedTuple):
    """One commit's work, in the order the store does it."""
    final_ids: list[str]
    """Ids to mark final (their archive rows are flushed)."""
    messages: list[Any]
    """Messages to ack."""
    groups: list[str]
    """Groups whose Redis membership sets go."""
    settled: list[str]
    """Of `groups`, those settled (complete, every member final): their gate records go too."""


@dataclass(frozen=True)
class Final:
    """A final outcome to archive: `traj` when the store has the trajectory, else only its id."""
    trajectory_id: str
    outcome: str
    reason: str
    traj: Trajectory | None = None


class StoreState:
    """Owns every held trajectory's record and its transitions (see the module doc)."""

    def __init__(self, straggler_wait_s: float = 60.0) -> None:
        self.straggler_wait_s = straggler_wait_s
        """How long the learner may be held for a due group that is not ready (then it goes on,
        and that group, if it ever comes, is trained stale)."""
        self.held_since: float | None = None
        """When the learner was first held for the due groups now missing (None: not held)."""
        self.given_up: set[str] = set()
        """Due groups the learner stopped waiting for."""
        self.records: dict[str, TrajectoryRecord] = {}
        """Held trajectory id → its record (the truth; everything below but the commit queue and
        recovery is an index over it, kept by `_apply`)."""
        self.assembling: dict[str, Group] = {}
        """Groups still waiting for the rest of their G (their members RECEIVED)."""
        self.ready: list[Group] = []
        """Groups whose members are READY, sorted by `order`."""
        self._ready_ids: set[str] = set()
        """The ids of the groups in `ready`."""
        self.handed: dict[str, Group] = {}
        """Groups whose members are HANDED_OUT."""
        self._counts: dict[TrajectoryState, int] = dict.fromkeys(HELD_STATES, 0)
        """Records in each held state."""
        self.pending_final: list[tuple[str, Any]] = []
        """(id to mark final or '', message to ack) of outcomes archived but not yet committed."""
        self.finalizing: set[str] = set()
        """The ids to mark final at the next commit: FINAL, archived, not yet marked in Redis (so a
        redelivery now is a duplicate, not a new arrival)."""
        self.pending_cleanup: list[str] = []
        """Groups whose Redis membership sets can go at the next commit."""
        self.pending_settled: list[str] = []
        """Of those, groups settled: complete, and every member FINAL. Their gate records (done,
        accepted count) go with their membership, since no member can enter a group again (a
        redelivery of a final id is a duplicate) and the end of a run reads them only for members
        without a final outcome."""
        self.owed: set[str] = set()
        """Recovery: ids a previous store held, not yet back (redelivery) or final."""
        self.recovery_deadline = 0.0
        """Recovery: time after which the learner is served even if some owed ids never came back."""

    # ------------------------------------------------------------------ the one transition function
    def _apply(self, event: Event, records: Iterable[TrajectoryRecord], arg: Any = None) -> None:
        """Moves each record by `event` (`TRANSITIONS`), doing the named side effects, then checks
        the invariants of every record moved and of the counts (O(G) per record, G the group
        size). The group-wide effects are idempotent, so a group's members move together. `arg`:
        the new message handle (REDELIVER) or the learner version (HAND_OUT)."""
        moved = list(records)
        for rec in moved:
            held = self.records.get(rec.trajectory_id)
            key = (held.state if held is not None else None, event)
            try:
                nxt, effects = TRANSITIONS[key]
            except KeyError:
                raise InvalidTransition(f"{rec.trajectory_id}: {event.value} in state "
                                        f"{key[0].value if key[0] else 'none'}") from None
            if key[0] is not None:
                self._counts[key[0]] -= 1
            rec.state = nxt
            for effect in effects:
                self._EFFECTS[effect](self, rec, arg)
            if nxt is not TrajectoryState.FINAL:
                self._counts[nxt] += 1
        for rec in moved:
            self._check(rec)
        if sum(self._counts.values()) != len(self.records):
            raise InvariantViolation(f"counts {self._counts} but {len(self.records)} records")

    def _check(self, rec: TrajectoryRecord) -> None:
        tid, gid, group = rec.trajectory_id, rec.group_id, rec.group
        in_group = any(t.trajectory_id == tid for t in group.members)
        if rec.state is TrajectoryState.FINAL:
            ok = tid not in self.records and not in_group
        else:
            ok = self.records.get(tid) is rec and in_group and tid not in self.owed
            ready, handed = gid in self._ready_ids, self.handed.get(gid) is group
            if rec.state is TrajectoryState.READY:
                ok = ok and ready and not handed and group.taken_at is None
            elif rec.state is TrajectoryState.HANDED_OUT:
                ok = ok and handed and not ready and group.taken_at is not None
            else:
                ok = ok and not ready and not handed
        if not ok:
            raise InvariantViolation(f"{tid} ({rec.state.value}) disagrees with its group {gid}")

    def _join_group(self, rec: TrajectoryRecord, arg: Any) -> None:
        self.records[rec.trajectory_id] = rec
        if all(t.trajectory_id != rec.trajectory_id for t in rec.group.members):
            rec.group.members.append(rec.traj)

    def _new_handle(self, rec: TrajectoryRecord, arg: Any) -> None:
        rec.msg = arg

    def _pay_owed(self, rec: TrajectoryRecord, arg: Any) -> None:
        self.owed.discard(rec.trajectory_id)

    def _queue_group(self, rec: TrajectoryRecord, arg: Any) -> None:
        group = rec.group
        if group.group_id not in self._ready_ids:
            self._ready_ids.add(group.group_id)
            bisect.insort(self.ready, group, key=lambda g: g.order)

    def _unqueue_group(self, rec: TrajectoryRecord, arg: Any) -> None:
        group = rec.group
        if group.group_id in self._ready_ids:
            self._ready_ids.discard(group.group_id)
            i = bisect.bisect_left(self.ready, group.order, key=lambda g: g.order)
            while self.ready[i] is not group:
                i += 1
            del self.ready[i]

    def _hand_group(self, rec: TrajectoryRecord, arg: Any) -> None:
        self.handed[rec.group_id] = rec.group
        rec.group.taken_at = arg

    def _unhand_group(self, rec: TrajectoryRecord, arg: Any) -> None:
        if self.handed.get(rec.group_id) is rec.group:
            del self.handed[rec.group_id]
        rec.group.taken_at = None

    def _queue_final(self, rec: TrajectoryRecord, arg: Any) -> None:
        self.pending_final.append((rec.trajectory_id, rec.msg))
        self.finalizing.add(rec.trajectory_id)

    def _leave(self, rec: TrajectoryRecord, arg: Any) -> None:
        del self.records[rec.trajectory_id]
        group = rec.group
        group.members = [t for t in group.members if t.trajectory_id != rec.trajectory_id]
        if not group.members:
            self._unqueue_group(rec, None)
            self._unhand_group(rec, None)

    _EFFECTS: dict[Effect, Callable[[StoreState, TrajectoryRecord, Any], None]] = {
        Effect.JOIN_GROUP: _join_group, Effect.NEW_HANDLE: _new_handle, Effect.PAY_OWED: _pay_owed,
        Effect.QUEUE_GROUP: _queue_group, Effect.UNQUEUE_GROUP: _unqueue_group,
        Effect.HAND_GROUP: _hand_group, Effect.UNHAND_GROUP: _unhand_group,
        Effect.QUEUE_FINAL: _queue_final, Effect.LEAVE: _leave,
    }

    def _members(self, group: Group) -> list[TrajectoryRecord]:
        return [self.records[t.trajectory_id] for t in group.members]

    # ------------------------------------------------------------------ queries
    def state(self, tid: str) -> TrajectoryState | None:
        """The state of a held trajectory (None: not held — unknown, or final)."""
        rec = self.records.get(tid)
        return rec.state if rec is not None else None

    def holds(self, tid: str) -> bool:
        return bool(tid) and tid in self.records

    def awaiting_commit(self, tid: str) -> bool:
        """Whether `tid` is FINAL with its outcome archived and not yet marked in Redis."""
        return tid in self.finalizing

    def held_counts(self) -> dict[str, int]:
        """Trajectories held in each state (for the store's gauge)."""
        return {s.value: n for s, n in self._counts.items()}

    @property
    def ready_count(self) -> int:
        return len(self.ready)

    # ------------------------------------------------------------------ recovery after a store restart
    def begin_recovery(self, owed: Iterable[str], deadline: float) -> None:
        """A new store: `owed` are the ids its predecessor held (membership in Redis, not final)."""
        self.owed = set(owed)
        self.recovery_deadline = deadline

    def recovering(self, now: float) -> bool:
        """Whether handing out must wait for owed trajectories to come back."""
        return bool(self.owed) and now < self.recovery_deadline

    # ------------------------------------------------------------------ intake
    def redelivered(self, tid: str, msg: Any) -> None:
        """A message for a trajectory already held: keep the newest handle (the old one is dead).
        For one awaiting its commit (`awaiting_commit`) the message is acked with the others."""
        rec = self.records.get(tid)
        if rec is not None:
            self._apply(Event.REDELIVER, [rec], msg)
        elif tid in self.finalizing:
            self.pending_final.append(("", msg))
        else:
            raise InvalidTransition(f"{tid}: redeliver in state none")

    def finalize(self, tid: str, msg: Any, *, mark: bool = True) -> None:
        """An outcome of an id the store does not hold was archived: mark `tid` final (unless
        `mark` is False: not a member) and ack `msg` at the next commit."""
        if tid in self.records:
            raise InvalidTransition(f"{tid}: finalized while {self.records[tid].state.value}")
        self.pending_final.append((tid if mark else "", msg))
        if tid and mark:
            self.finalizing.add(tid)
        if tid:
            self.owed.discard(tid)

    def take_member(self, traj: Trajectory, msg: Any, *, valid: bool, expected: int, order: int, source: str,
                    received: int, valid_count: int, admitted_version: int = 0, refills: int = 0) -> Group | None:
        """A member whose membership is recorded in Redis (`received`/`valid_count`: the group's
        counts right after it; `refills`: the group's refills admitted so far, never fewer than
        before). A valid one becomes RECEIVED (an invalid one was finalized by the caller). Returns
        the group when it is now complete: all G + refills came back and every valid member is
        here (after a store restart the valid members arrive again by redelivery)."""
        gid = traj.group_id
        group = self.assembling.get(gid)
        if group is None:
            group = self.assembling[gid] = Group(gid, expected, order=order, admitted_version=admitted_version,
                                                 source=source)
        group.refills = max(group.refills, refills)
        if valid:
            self._apply(Event.TAKE, [TrajectoryRecord(traj, group, msg)])
        if received >= group.expected + group.refills and len(group.members) >= valid_count:
            del self.assembling[gid]
            return group
        return None

    def filter_group(self, group: Group, reason: str) -> list[Final]:
        """A complete group dropped by a filter: every member FINAL (filtered, `reason`)."""
        out = [Final(t.trajectory_id, "filtered", reason, t) for t in group.members]
        self._apply(Event.FILTER, self._members(group))
        self.pending_cleanup.append(group.group_id)
        self.pending_settled.append(group.group_id)
        return out

    def make_ready(self, group: Group, now: float, dropped: dict[str, str] | None = None) -> None:
        """A complete group kept: its members become READY, but those a selection dropped (id →
        reason, GRPO-RoC: `services/store/roc.py`), which become FINAL (filtered; the caller
        archives them). At least one member is kept."""
        drop = [r for r in self._members(group) if r.trajectory_id in (dropped or {})]
        if len(drop) >= len(group.members):
            raise InvalidTransition(f"{group.group_id}: a kept group must keep a member")
        self._apply(Event.FILTER, drop)
        group.ready_at = now
        self._apply(Event.KEEP, self._members(group))

    # ------------------------------------------------------------------ the learner
    def hand_out(self, want_groups: int, max_trajectories: int, now: float,
                 due: Iterable[str] = (), learner_version: int = 0) -> list[Trajectory]:
        """Whole READY groups, oldest admission first, up to `want_groups` groups and
        `max_trajectories`; [] unless `want_groups` are ready and the learner is not `held` (a
        recovery pending, or a `due` group — admitted so long ago that after this step it could
        only be trained stale — still on its way, at most `straggler_wait_s`). Every `due` group
        that is READY goes in the batch, also past `want_groups` and `max_trajectories` when
        older ones fill it: after this step it could only be trained stale. (The gate bounds the
        places admitted, not the order they are trained in: with η ≥ 2 a group ready early takes
        a place while older ones still sample, and those can fall due together, more of them
        than a batch; docs/RELIABILITY.md "More due groups ready than a batch holds".)"""
        if self.recovering(now) or len(self.ready) < want_groups:
            return []
        take, n = 0, 0
        while take < min(want_groups, len(self.ready)) and n + len(self.ready[take].members) <= max_trajectories:
            n += len(self.ready[take].members)
            take += 1
        due = set(due)
        batch = self.ready[:take] + [g for g in self.ready[take:] if g.group_id in due]
        if self.held(now, due, clock=True):
            return []
        out: list[Trajectory] = []
        for group in batch:
            out.extend(group.members)
            self._apply(Event.HAND_OUT, self._members(group), learner_version)
        return out

    def held(self, now: float, due: Iterable[str], *, clock: bool) -> bool:
        """Whether the learner must wait for this store: a recovery is pending, or a `due` group
        is neither ready nor given up. With `clock` (the learner has a batch otherwise) the
        straggler wait runs: past `straggler_wait_s` the missing due groups are given up and the
        learner goes on."""
        if self.recovering(now):
            return True
        missing = set(due) - self._ready_ids - self.given_up
        if missing:
            if not clock:
                return True
            if self.held_since is None:
                self.held_since = now
            if now - self.held_since < self.straggler_wait_s:
                return True
            self.given_up |= missing
        self.held_since = None
        return False

    def ready_versions(self, limit: int) -> list[int]:
        """The admission version of the first `limit` READY groups, in hand-out order."""
        return [g.admitted_version for g in self.ready[:limit]]

    def held_for_stragglers(self) -> bool:
        """Whether the learner is being held for a due group that is not ready."""
        return self.held_since is not None

    def report(self, tid: str) -> tuple[Any, str | None]:
        """The learner's verdict on `tid` (trained or quarantined): its record goes. Returns its
        message (None if not held) and its group id (if it was HANDED_OUT). The caller archives
        the outcome (unless it was final already) and calls `finalize`."""
        rec = self.records.get(tid)
        if rec is None:
            self.owed.discard(tid)
            return None, None
        was = rec.state
        self._apply(Event.REPORT, [rec])
        return rec.msg, rec.group_id if was is TrajectoryState.HANDED_OUT else None

    def done_reporting(self, group_ids: Iterable[str]) -> None:
        """Groups whose reported members are final: their Redis membership goes at the next commit,
        and a group none of whose members is still HANDED_OUT is settled."""
        for gid in group_ids:
            self.pending_cleanup.append(gid)
            if gid not in self.handed:
                self.pending_settled.append(gid)

    def trained_unreported(self, learner_version: int) -> dict[int, list[str]]:
        """A new learner process at `learner_version`: HANDED_OUT groups taken at an older version
        were trained — its checkpoint is past the step that took them (a learner that fails
        checkpoints on its way out, before it reported that step). Returns taken-at version → ids;
        the caller records them as the learner's Report would. Handing them out again would
        train them twice or, lagging, quarantine them as stale (issue 16: a learner crashed on a
        NATS timeout, and every batch after it came out stale)."""
        out: dict[int, list[str]] = {}
        for group in self.handed.values():
            assert group.taken_at is not None
            if group.taken_at < learner_version:
                out.setdefault(group.taken_at, []).extend(t.trajectory_id for t in group.members)
        return out

    def recycle_handed_out(self, now: float) -> dict[str, int]:
        """A new learner process: what the previous one took and never reported goes back to
        READY, whole groups in admission order. Returns group id → admission version of each."""
        out = {}
        for group in list(self.handed.values()):
            group.ready_at = now
            self._apply(Event.RECYCLE, self._members(group))
            out[group.group_id] = group.admitted_version
        return out

    # ------------------------------------------------------------------ the end of a finished run
    def end_of_run(self) -> list[Final]:
        """The run is finished: everything still held becomes FINAL — READY and HANDED_OUT as
        unused, RECEIVED (members of incomplete groups) as held at stop. Returns what to archive."""
        out: list[Final] = []
        complete = [g.group_id for g in self.ready] + list(self.handed)
        incomplete = list(self.assembling)
        for groups, outcome in ((list(self.ready), UNUSED_AT_END), (list(self.handed.values()), UNUSED_AT_END),
                                (list(self.assembling.values()), HELD_AT_STOP)):
            for group in groups:
                out += [Final(t.trajectory_id, *outcome, t) for t in group.members]
                self._apply(Event.END_OF_RUN, self._members(group))
        for rec in list(self.records.values()):  # RECEIVED in a complete group not yet judged
            incomplete.append(rec.group_id)
            out.append(Final(rec.trajectory_id, *HELD_AT_STOP, rec.traj))
            self._apply(Event.END_OF_RUN, [rec])
        self.pending_cleanup += complete + list(dict.fromkeys(incomplete))
        self.pending_settled += complete  # an incomplete group has members that never came back
        self.assembling = {}
        return out

    # ------------------------------------------------------------------ commit
    def take_commit(self) -> Commit:
        """What to commit since the last commit (see `Commit`). The caller flushes the archive
        first, then marks, acks and cleans up, in that order."""
        pending, self.pending_final = self.pending_final, []
        self.finalizing = set()
        groups, self.pending_cleanup = self.pending_cleanup, []
        settled, self.pending_settled = self.pending_settled, []
        ids = [tid for tid, _ in pending if tid]
        return Commit(ids, [m for _, m in pending if m is not None], groups, settled)

    def live_messages(self) -> list[Any]:
        """Messages to heartbeat (in-progress acks) while this store lives."""
        return [r.msg for r in self.records.values() if r.msg is not None]


def filter_reason(rewards: list[float], *, drop_zero_variance: bool) -> str:
    """Why a complete group is dropped ('' = kept): fewer than 2 valid members, or all rewards
    equal when dynamic sampling is on."""
    if len(rewards) < 2:
        return "group_too_small"
    if drop_zero_variance and max(rewards) == min(rewards):
        return "zero_variance"
    return ""


def member_ids(task_id: str, group_size: int) -> list[str]:
    """The trajectory ids rollout gives a task's G samples (`services/rollout.py`: task id + index)."""
    return [f"{task_id}-{i}" for i in range(group_size)]


def member_task_id(trajectory_id: str) -> str:
    """The task id of one of its members' ids (`member_ids`, inverted)."""
    return trajectory_id.rpartition("-")[0]
