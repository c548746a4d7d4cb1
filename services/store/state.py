"""The trajectory store's bookkeeping as one pure state machine (no I/O, no torch).

Every trajectory the store takes in as a group member is in exactly one state::

    RECEIVED ──(its group completes, kept)──▶ READY ──(NextBatch)──▶ HANDED_OUT ──(Report)──▶ FINAL
       │                                         │                       │
       │ (group filtered / invalid member)       │ (end of run)          │ (a new learner process:
       └────────────────▶ FINAL ◀────────────────┘                       │  back to READY, in order)
                                                                         └──▶ READY

Until FINAL a trajectory's TRAJ_GRADED message stays unacked (JetStream redelivers it to a
restarted store). FINAL means: archived, then (at the next `take_commit`) marked final in Redis and
acked. Recovery paths:

- **redelivery** of a message the store still holds: the newest handle replaces the old one;
- **a dead learner** (the next one says so on its first NextBatch): what it took and never
  reported goes back to READY, in admission order;
- **a store restart**: the new store learns from Redis which trajectories its predecessor held
  (`begin_recovery`) and hands nothing to the learner until they are all back (or a deadline
  passes), so the learner cannot advance past them while they wait for redelivery — the
  mechanism behind `stale` quarantines after a store restart (issue 16);
- **the end of a finished run** (`end_of_run`): whatever is still held ends as a recorded final
  outcome (`filtered:unused_at_end_of_run` or `in_flight_at_stop:held_at_stop`), never a gap.

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
from collections.abc import Iterable
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
    """Taken in as a valid member; its group is still assembling."""
    READY = "ready"
    """Its group is complete and kept, waiting for the learner."""
    HANDED_OUT = "handed_out"
    """Given to the learner, not yet reported."""


@dataclass
class Group:
    group_id: str
    expected: int
    """G: members admitted for this group's task."""
    order: int = 1 << 62
    """Admission order (sampler cursor); READY groups are served lowest first."""
    admitted_version: int = 0
    """Learner version when the gate admitted it: it must be trained at a version ≤ this + η."""
    source: str = ""
    members: list[Trajectory] = field(default_factory=list)
    """Valid members received so far (the ones the learner may train)."""
    ready_at: float = 0.0
    """time.time() when the group became ready for the learner."""


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
    """Owns every held trajectory's and group's state and its transitions (see the module doc)."""

    def __init__(self, straggler_wait_s: float = 60.0) -> None:
        self.straggler_wait_s = straggler_wait_s
        """How long the learner may be held for a due group that is not ready (then it goes on,
        and that group, if it ever comes, is trained stale)."""
        self.held_since: float | None = None
        """When the learner was first held for the due groups now missing (None: not held)."""
        self.given_up: set[str] = set()
        """Due groups the learner stopped waiting for."""
        self.assembling: dict[str, Group] = {}
        """Groups with members RECEIVED, waiting for the rest of their G."""
        self.ready: list[Group] = []
        """READY groups, sorted by `order`."""
        self.held: dict[str, Any] = {}
        """RECEIVED or READY trajectory id → its unacked message."""
        self.handed_out: dict[str, Any] = {}
        """HANDED_OUT trajectory id → its unacked message (None: came back by Report only)."""
        self.handed_traj: dict[str, Trajectory] = {}
        """HANDED_OUT trajectory id → the trajectory (to recycle it for a new learner)."""
        self.handed_meta: dict[str, tuple[int, int]] = {}
        """Group id → (admission order, admission version) of groups with members HANDED_OUT."""
        self.handed_at: dict[str, int] = {}
        """Group id → the learner version that took it (HANDED_OUT groups)."""
        self.pending_final: list[tuple[str, Any]] = []
        """(id to mark final or '', message to ack) of outcomes archived but not yet committed."""
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

    # ------------------------------------------------------------------ queries
    def state(self, tid: str) -> TrajectoryState | None:
        """The state of a held trajectory (None: not held — unknown, or final)."""
        if tid in self.handed_out:
            return TrajectoryState.HANDED_OUT
        if any(t.trajectory_id == tid for g in self.ready for t in g.members):
            return TrajectoryState.READY
        if tid in self.held:
            return TrajectoryState.RECEIVED
        return None

    def holds(self, tid: str) -> bool:
        return bool(tid) and (tid in self.held or tid in self.handed_out)

    def held_counts(self) -> dict[str, int]:
        """Trajectories held in each state (for the store's gauge)."""
        ready = sum(len(g.members) for g in self.ready)
        return {TrajectoryState.RECEIVED.value: len(self.held) - ready, TrajectoryState.READY.value: ready,
                TrajectoryState.HANDED_OUT.value: len(self.handed_out)}

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

    def _seen(self, tid: str) -> None:
        self.owed.discard(tid)

    # ------------------------------------------------------------------ intake
    def redelivered(self, tid: str, msg: Any) -> None:
        """A message for a trajectory already held: keep the newest handle (the old one is dead)."""
        holder = self.handed_out if tid in self.handed_out else self.held
        holder[tid] = msg
        self._seen(tid)

    def finalize(self, tid: str, msg: Any, *, mark: bool = True) -> None:
        """An outcome was archived: mark `tid` final (unless `mark` is False: not a member) and ack
        `msg` at the next commit."""
        self.pending_final.append((tid if mark else "", msg))
        if tid:
            self._seen(tid)

    def take_member(self, traj: Trajectory, msg: Any, *, valid: bool, expected: int, order: int, source: str,
                    received: int, valid_count: int, admitted_version: int = 0) -> Group | None:
        """A member whose membership is recorded in Redis (`received`/`valid_count`: the group's
        counts right after it). A valid one becomes RECEIVED (an invalid one was finalized by the
        caller). Returns the group when it is now complete: all G came back and every valid
        member is here (after a store restart the valid members arrive again by redelivery)."""
        tid, gid = traj.trajectory_id, traj.group_id
        group = self.assembling.get(gid)
        if group is None:
            group = self.assembling[gid] = Group(gid, expected, order=order, admitted_version=admitted_version,
                                                 source=source)
        if valid:
            self.held[tid] = msg
            self._seen(tid)
            if all(m.trajectory_id != tid for m in group.members):
                group.members.append(traj)
        if received >= group.expected and len(group.members) >= valid_count:
            del self.assembling[gid]
            return group
        return None

    def filter_group(self, group: Group, reason: str) -> list[Final]:
        """A complete group dropped by a filter: every member FINAL (filtered, `reason`)."""
        out = [Final(t.trajectory_id, "filtered", reason, t) for t in group.members]
        for t in group.members:
            self.finalize(t.trajectory_id, self.held.pop(t.trajectory_id, None))
        self.pending_cleanup.append(group.group_id)
        self.pending_settled.append(group.group_id)
        return out

    def make_ready(self, group: Group, now: float) -> None:
        """A complete group kept: its members become READY."""
        group.ready_at = now
        bisect.insort(self.ready, group, key=lambda g: g.order)

    # ------------------------------------------------------------------ the learner
    def hand_out(self, want_groups: int, max_trajectories: int, now: float,
                 due: Iterable[str] = (), learner_version: int = 0) -> list[Trajectory]:
        """Whole READY groups, oldest admission first, up to `want_groups` groups and
        `max_trajectories`; [] unless `want_groups` are ready, no recovery is pending, and no
        `due` group (admitted so long ago that after this step it could only be trained stale)
        is still on its way — the learner is held for it, at most `straggler_wait_s`. (A due
        group that is READY goes in this batch unless older ones fill it; its tokens were
        sampled at or after its admission, so it may well still be within η later.)"""
        if self.recovering(now) or len(self.ready) < want_groups:
            return []
        take, n = 0, 0
        while take < min(want_groups, len(self.ready)) and n + len(self.ready[take].members) <= max_trajectories:
            n += len(self.ready[take].members)
            take += 1
        batch = self.ready[:take]
        missing = set(due) - {g.group_id for g in self.ready} - self.given_up
        if missing:
            if self.held_since is None:
                self.held_since = now
            if now - self.held_since < self.straggler_wait_s:
                return []
            self.given_up |= missing
        self.held_since = None
        del self.ready[:take]
        out: list[Trajectory] = []
        for group in batch:
            out.extend(group.members)
            self.handed_meta[group.group_id] = (group.order, group.admitted_version)
            self.handed_at[group.group_id] = learner_version
        for t in out:
            self.handed_out[t.trajectory_id] = self.held.pop(t.trajectory_id, None)
            self.handed_traj[t.trajectory_id] = t
        return out

    def held_for_stragglers(self) -> bool:
        """Whether the learner is being held for a due group that is not ready."""
        return self.held_since is not None

    def report(self, tid: str) -> tuple[Any, str | None]:
        """The learner's verdict on `tid` (trained or quarantined): it leaves every buffer.
        Returns its message (None if not held) and its group id (if it was HANDED_OUT). The
        caller archives the outcome (unless it was final already) and calls `finalize`."""
        msg = self.handed_out.pop(tid, None) or self.held.pop(tid, None)
        self.held.pop(tid, None)
        traj = self.handed_traj.pop(tid, None)
        for group in list(self.ready) + list(self.assembling.values()):
            group.members = [t for t in group.members if t.trajectory_id != tid]
        self.ready = [g for g in self.ready if g.members]
        self._seen(tid)
        return msg, traj.group_id if traj is not None else None

    def done_reporting(self, group_ids: Iterable[str]) -> None:
        """Groups whose reported members are final: their Redis membership goes at the next commit,
        and a group none of whose members is still HANDED_OUT is settled."""
        out_now = {t.group_id for t in self.handed_traj.values()}
        for gid in group_ids:
            self.handed_meta.pop(gid, None)
            self.handed_at.pop(gid, None)
            self.pending_cleanup.append(gid)
            if gid not in out_now:
                self.pending_settled.append(gid)

    def trained_unreported(self, learner_version: int) -> dict[int, list[str]]:
        """A new learner process at `learner_version`: HANDED_OUT groups taken at an older version
        were trained — its checkpoint is past the step that took them (a learner that fails
        checkpoints on its way out, before it reported that step). Returns taken-at version → ids;
        the caller records them as the learner's Report would. Handing them out again would
        train them twice or, lagging, quarantine them as stale (issue 16: a learner crashed on a
        NATS timeout, and every batch after it came out stale)."""
        out: dict[int, list[str]] = {}
        for tid, traj in self.handed_traj.items():
            taken = self.handed_at.get(traj.group_id, learner_version)
            if taken < learner_version:
                out.setdefault(taken, []).append(tid)
        return out

    def recycle_handed_out(self, now: float) -> dict[str, int]:
        """A new learner process: what the previous one took and never reported goes back to
        READY, whole groups in admission order. Returns group id → admission version of each."""
        by_group: dict[str, list[Trajectory]] = {}
        for traj in self.handed_traj.values():
            by_group.setdefault(traj.group_id, []).append(traj)
        out = {}
        for gid, members in by_group.items():
            order, version = self.handed_meta.pop(gid, (1 << 62, 0))
            self.handed_at.pop(gid, None)
            self.make_ready(Group(gid, len(members), order=order, admitted_version=version, members=members), now)
            out[gid] = version
            for t in members:
                self.held[t.trajectory_id] = self.handed_out.pop(t.trajectory_id)
        self.handed_traj.clear()
        return out

    # ------------------------------------------------------------------ the end of a finished run
    def end_of_run(self) -> list[Final]:
        """The run is finished: everything still held becomes FINAL — READY and HANDED_OUT as
        unused, members of incomplete groups as held at stop. Returns what to archive."""
        out: list[Final] = []
        for group in self.ready:
            out += [Final(t.trajectory_id, *UNUSED_AT_END, t) for t in group.members]
        out += [Final(tid, *UNUSED_AT_END, t) for tid, t in self.handed_traj.items()]
        for group in self.assembling.values():
            out += [Final(t.trajectory_id, *HELD_AT_STOP, t) for t in group.members]
        for f in out:
            msg = self.held.pop(f.trajectory_id, None) or self.handed_out.pop(f.trajectory_id, None)
            self.finalize(f.trajectory_id, msg)
        complete = [g.group_id for g in self.ready] + list(self.handed_meta)
        self.pending_cleanup += complete + list(self.assembling)
        self.pending_settled += complete  # an incomplete group has members that never came back
        self.ready, self.assembling = [], {}
        self.handed_traj.clear()
        self.handed_meta.clear()
        return out

    # ------------------------------------------------------------------ commit
    def take_commit(self) -> Commit:
        """What to commit since the last commit (see `Commit`). The caller flushes the archive
        first, then marks, acks and cleans up, in that order."""
        pending, self.pending_final = self.pending_final, []
        groups, self.pending_cleanup = self.pending_cleanup, []
        settled, self.pending_settled = self.pending_settled, []
        ids = [tid for tid, _ in pending if tid]
        return Commit(ids, [m for _, m in pending if m is not None], groups, settled)

    def live_messages(self) -> list[Any]:
        """Messages to heartbeat (in-progress acks) while this store lives."""
        return [m for m in list(self.held.values()) + list(self.handed_out.values()) if m is not None]


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

