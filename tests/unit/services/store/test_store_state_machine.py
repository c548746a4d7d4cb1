"""A property-based state-machine test of the store's bookkeeping (`StoreState`), pure and fast.

Hypothesis drives the store through any order of: the gate admitting a group, a member arriving
(first delivery or a JetStream redelivery; valid, invalid, or an infrastructure failure, which the
store refills with one more member of its group; a duplicate of a final id), the
learner taking a batch, reporting it, dying (with or without having checkpointed its last step),
the store crashing and a new one recovering from what Redis says was held, the clock running past
a wait, a commit; the run ends after the last step (`teardown`). The test plays the store
service's part around the state (`services/store/service.py`: intake, `_complete`, `report`,
`recycle_handed_out`, `_commit_final`) against a model of Redis (membership sets, final marks, pending groups), of
JetStream (unacked messages) and of the archive (rows flushed at commit, lost in a crash).

Checked after every step: each admitted id is in exactly one of final (marked in Redis),
finalized and awaiting commit, held by the store, or in flight (not yet seen by this store), so
admitted = final + held as the gate counts them; no id has two final rows; the store's counts per
state match the model's; recovery holds the learner exactly while owed ids are missing. At each
hand-out: whole groups, oldest admission first, never an id this learner already got, never one
that is final. At the end of the run: nothing this store saw is left without exactly one final
row, and every message it was given is acked.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from trajmesh.contract import Trajectory
from trajmesh.services.store.state import (
    HELD_AT_STOP,
    UNUSED_AT_END,
    StoreState,
    TrajectoryState,
    filter_reason,
    member_ids,
)
from trajmesh.v1 import trajectory_pb2

G = 2
"""Members per group."""
MAX_GROUPS = 6
ETA = 1
"""Max policy lag: a group admitted at a is due when the learner is at a + η."""
STRAGGLER_WAIT_S = 10.0
RECOVERY_WAIT_S = 20.0
MAX_RESTARTS = 2
"""Store crashes and learner restarts per run, each (more only reset the progress of a run)."""
FINAL_OUTCOMES = {"trained", "quarantined", "filtered", "failed_infra", UNUSED_AT_END[0], HELD_AT_STOP[0]}
REFILL_CAP = 1
"""Refills per group (store.infra_refills_per_group)."""


@dataclass(frozen=True)
class Content:
    """What rollout and the grader made of one member: the same on every delivery of its message."""
    valid: bool
    reward: float
    infra: bool = False
    """An infrastructure failure (invalid): the store admits a refill in its place."""


@dataclass
class Learner:
    version: int = 0
    incarnation: int = 0
    batch: list[str] | None = None
    """Ids of the batch in hand (taken, not reported)."""
    batch_epoch: int = -1
    """The store epoch that handed the batch out."""
    got: set[str] = field(default_factory=set)
    """Every id this learner process was given."""


def _traj(tid: str, gid: str, reward: float) -> Trajectory:
    t = Trajectory.new(trajectory_id=tid)
    t.pb.task_id, t.pb.group_id = gid, gid
    t.append_prompt([1, 2])
    t.append_sampled([3], [-0.5], 0)
    t.finish(trajectory_pb2.EOS)
    t.set_reward(reward)
    return t


class StoreMachine(RuleBasedStateMachine):
    """One run: the store state under test plus models of Redis, JetStream, the archive, the learner."""

    @initialize()
    def start(self) -> None:
        self.now = 0.0
        self.state = StoreState(straggler_wait_s=STRAGGLER_WAIT_S)
        self.epoch = 0
        self.finished = False
        # the gate and the tasks
        self.groups: dict[str, tuple[int, int]] = {}
        """Admitted group id → (admission order, admission version)."""
        self.content: dict[str, Content] = {}
        # Redis
        self.received: dict[str, set[str]] = {}
        self.valid: dict[str, set[str]] = {}
        self.final_marks: set[str] = set()
        self.pending_groups: set[str] = set()
        self.refills: dict[str, dict[str, str]] = {}
        """Group id → infra-failed id → the refill admitted in its place (`group:<id>:refills`)."""
        # JetStream
        self.published: set[str] = set()
        self.unacked: dict[str, int] = {}
        """Id → deliveries so far, of messages not acked."""
        # the archive
        self.rows: dict[str, list[str]] = {}
        self.unflushed: list[tuple[str, str]] = []
        # what the current store (epoch) should hold
        self.touched: set[str] = set()
        """Ids delivered to or reported to this store."""
        self.delivered: set[str] = set()
        """Ids whose message this store was given."""
        self.members: dict[str, set[str]] = {}
        """Group id → valid ids this store took in and still holds."""
        self.ready: dict[str, int] = {}
        """Group id → order, of the groups this store should hold READY."""
        self.handed: set[str] = set()
        self.owed: set[str] = set()
        self.deadline = 0.0
        self.learner = Learner()

    # ------------------------------------------------------------------ the store service's part
    def _intake(self, tid: str) -> None:
        n = self.unacked[tid] = self.unacked.get(tid, 0) + 1
        handle = (tid, n)
        self.touched.add(tid)
        self.delivered.add(tid)
        self.owed.discard(tid)
        if self.state.holds(tid) or self.state.awaiting_commit(tid):
            self.state.redelivered(tid, handle)
            return
        if tid in self.final_marks:  # a duplicate: acked, no second outcome
            self.state.finalize(tid, handle, mark=False)
            return
        gid, c = tid.rpartition("-")[0], self.content[tid]
        self.received.setdefault(gid, set()).add(tid)
        if c.valid:
            self.valid.setdefault(gid, set()).add(tid)
        else:
            refills = self.refills.setdefault(gid, {})
            if c.infra and tid not in refills and len(refills) < REFILL_CAP:  # idempotent per failed id
                refills[tid] = refill = f"{gid}-{G + len(refills)}"
                self.content[refill] = Content(True, 0.5)
            self._row(tid, "failed_infra" if c.infra else "quarantined")
            self.state.finalize(tid, handle)
        order, version = self.groups[gid]
        group = self.state.take_member(
            _traj(tid, gid, c.reward), handle, valid=c.valid, expected=G, order=order, source="s",
            received=len(self.received[gid]), valid_count=len(self.valid.get(gid, ())), admitted_version=version,
            refills=len(self.refills.get(gid, {})))
        if c.valid:
            self.members.setdefault(gid, set()).add(tid)
        if group is None:
            return
        assert group.group_id == gid and {t.trajectory_id for t in group.members} == self.members.get(gid, set())
        assert len(self.received[gid]) == G + len(self.refills.get(gid, {})), "completed before its refills came back"
        if filter_reason([t.reward for t in group.members], drop_zero_variance=True):
            for f in self.state.filter_group(group, "zero_variance"):
                self._row(f.trajectory_id, f.outcome)
            self.pending_groups.discard(gid)
            self.members.pop(gid, None)
        else:
            self.state.make_ready(group, self.now)
            self.ready[gid] = order

    def _row(self, tid: str, outcome: str) -> None:
        assert outcome in FINAL_OUTCOMES
        self.unflushed.append((tid, outcome))

    def _note_recovery(self) -> None:
        if self.state.owed and not self.state.recovering(self.now):
            self.state.owed.clear()
        if self.now >= self.deadline:
            self.owed.clear()

    def _leave(self, tid: str) -> None:
        """The model's side of an id leaving this store's hold."""
        gid = tid.rpartition("-")[0]
        members = self.members.get(gid, set())
        members.discard(tid)
        self.handed.discard(tid)
        if not members:
            self.members.pop(gid, None)
            self.ready.pop(gid, None)

    def _report(self, trained: list[str], quarantined: list[str]) -> None:
        """`TrajectoryStore.report`: each id leaves the state; its outcome is archived unless Redis
        has it final already; then one commit."""
        groups: set[str] = set()
        for tid, outcome in [(t, "trained") for t in trained] + [(t, "quarantined") for t in quarantined]:
            self.touched.add(tid)
            self.owed.discard(tid)
            msg, gid = self.state.report(tid)
            self._leave(tid)
            if gid is not None:
                groups.add(gid)
            if tid in self.final_marks:
                self.state.finalize("", msg, mark=False)
                continue
            self._row(tid, outcome)
            self.state.finalize(tid, msg)
        self.state.done_reporting(groups)
        self._commit()

    def _commit(self) -> None:
        """`_commit_final`: flush the archive, mark final, ack, clean up."""
        for tid, outcome in self.unflushed:
            self.rows.setdefault(tid, []).append(outcome)
        self.unflushed = []
        commit = self.state.take_commit()
        assert all(tid in self.rows for tid in commit.final_ids), "marked final before it was archived"
        self.final_marks.update(commit.final_ids)
        for tid, _ in commit.messages:
            self.unacked.pop(tid, None)
        for gid in commit.groups:
            self.received.pop(gid, None)
            self.valid.pop(gid, None)
        assert set(commit.settled) <= set(commit.groups)

    # ------------------------------------------------------------------ rules
    @precondition(lambda self: len(self.groups) < MAX_GROUPS)
    @rule(valid=st.lists(st.sampled_from([True, True, True, False]), min_size=G, max_size=G),
          rewards=st.sampled_from([[0.0, 1.0], [1.0, 0.0], [0.0, 1.0], [1.0, 1.0]]),
          infra=st.sampled_from([None, None, 0, 1]))
    def admit(self, valid: list[bool], rewards: list[float], infra: int | None) -> None:
        """The gate admits a task's group at the learner's version; its members' contents are fixed
        (valid or not; rewards, all equal in a zero-variance group that the filter drops; member
        `infra` an infrastructure failure)."""
        gid = f"g{len(self.groups)}"
        self.groups[gid] = (len(self.groups), self.learner.version)
        self.pending_groups.add(gid)
        for k, (tid, v, r) in enumerate(zip(member_ids(gid, G), valid, rewards, strict=True)):
            self.content[tid] = Content(False, r, infra=True) if k == infra else Content(v, r)

    @precondition(lambda self: (set(self.content) - self.published or self.unacked))
    @rule(data=st.data())
    def deliver(self, data: st.DataObject) -> None:
        """A member's first delivery, or a redelivery of an unacked message (a stalled or dead store)."""
        tid = data.draw(st.sampled_from(sorted((set(self.content) - self.published) | set(self.unacked))))
        self.published.add(tid)
        self._intake(tid)
        self._note_recovery()

    @precondition(lambda self: set(self.content) - self.published)
    @rule(data=st.data())
    def deliver_group(self, data: st.DataObject) -> None:
        """Every member of one group not yet delivered comes back (the usual case), in any order."""
        gids = sorted({t.rpartition("-")[0] for t in set(self.content) - self.published})
        gid = data.draw(st.sampled_from(gids))
        todo = [t for t in member_ids(gid, G) if t not in self.published]
        for tid in data.draw(st.permutations(todo)):
            self.published.add(tid)
            self._intake(tid)
        self._note_recovery()

    @precondition(lambda self: self.learner.batch is None and bool(self.ready))
    @rule(want=st.integers(1, 2), max_trajectories=st.sampled_from([G, 2 * G, 100]))
    def next_batch(self, want: int, max_trajectories: int) -> None:
        due = {g for g in self.pending_groups if self.groups[g][1] <= self.learner.version - ETA}
        missing_due = bool(due - set(self.ready))
        out = self.state.hand_out(want, max_trajectories, self.now, due, self.learner.version)
        if not out:
            if not self.state.recovering(self.now) and not missing_due and len(self.ready) >= want \
                    and max_trajectories >= G:
                raise AssertionError(f"nothing handed out though {sorted(self.ready)} are ready")
            return
        ids = [t.trajectory_id for t in out]
        gids = list(dict.fromkeys(t.group_id for t in out))
        oldest_first = sorted(self.ready, key=self.ready.__getitem__)
        # the oldest groups up to `want` and `max_trajectories`, then every other due one (it could
        # only be trained stale after this step)
        k, n = 0, 0
        while k < min(want, len(oldest_first)) and n + len(self.members[oldest_first[k]]) <= max_trajectories:
            n += len(self.members[oldest_first[k]])
            k += 1
        expected = oldest_first[:k] + [g for g in oldest_first[k:] if g in due]
        assert gids == expected, f"served {gids}, READY in admission order {oldest_first}, due {sorted(due)}"
        for gid in gids:
            assert {tid for tid in ids if tid.startswith(gid + "-")} == self.members[gid], "a group split"
        assert not set(ids) & self.learner.got, "handed out twice to one learner"
        assert not set(ids) & (self.final_marks | {t for t, _ in self.unflushed}), "handed out a final id"
        assert len(ids) <= max_trajectories or set(gids[k:]) <= due
        for gid in gids:
            del self.ready[gid]
        self.pending_groups -= set(gids)
        self.handed |= set(ids)
        self.learner.got |= set(ids)
        self.learner.batch, self.learner.batch_epoch = ids, self.epoch

    @precondition(lambda self: self.learner.batch is not None)
    @rule(quarantine=st.integers(0, G))
    def report(self, quarantine: int) -> None:
        batch = self.learner.batch
        assert batch is not None
        self._report(batch[quarantine:], batch[:quarantine])
        self.learner.batch = None
        self.learner.version += 1

    @precondition(lambda self: self.learner.incarnation < MAX_RESTARTS
                  and (self.learner.batch is not None or bool(self.state.handed)))
    @rule(checkpointed=st.booleans())
    def learner_restarts(self, checkpointed: bool) -> None:
        """The learner dies; the next process says so on its first NextBatch. `checkpointed`: the
        dead one trained its batch and saved that step before it went (so the new one is past it)."""
        lost, lost_epoch = self.learner.batch, self.learner.batch_epoch
        if lost is not None and checkpointed:
            self.learner.version += 1
        self.learner = Learner(version=self.learner.version, incarnation=self.learner.incarnation + 1)
        for taken, ids in sorted(self.state.trained_unreported(self.learner.version).items()):
            assert taken < self.learner.version
            self._report(ids, [])
        groups = self.state.recycle_handed_out(self.now)
        self.pending_groups |= set(groups)
        for gid in groups:
            self.ready[gid] = self.groups[gid][0]
            assert groups[gid] == self.groups[gid][1]
        if lost is not None and lost_epoch == self.epoch:
            for tid in lost:
                if checkpointed:
                    assert self.rows.get(tid) == ["trained"] or tid in self.final_marks
                elif tid in self.handed:
                    assert self.state.state(tid) is TrajectoryState.READY
        assert not self.state.handed
        self.handed = set()

    @precondition(lambda self: self.epoch < MAX_RESTARTS
                  and bool(self.state.records or self.state.pending_final))
    @rule()
    def store_crashes(self) -> None:
        """The store dies: its memory and unflushed archive rows are gone, its messages stay
        unacked. A new store learns from Redis what its predecessor held."""
        self.unflushed = []
        self.epoch += 1
        self.state = StoreState(straggler_wait_s=STRAGGLER_WAIT_S)
        self.touched, self.delivered, self.members, self.ready, self.handed = set(), set(), {}, {}, set()
        owed = {t for gid in self.received for t in self.valid.get(gid, ()) if t not in self.final_marks}
        self.deadline = self.now + RECOVERY_WAIT_S
        self.state.begin_recovery(owed, self.deadline)
        self.owed = set(owed)

    @rule(dt=st.sampled_from([1.0, STRAGGLER_WAIT_S, RECOVERY_WAIT_S]))
    def time_passes(self, dt: float) -> None:
        self.now += dt
        self._note_recovery()

    @precondition(lambda self: self.state.pending_final)
    @rule()
    def commit(self) -> None:
        self._commit()

    def run_ends(self) -> None:
        """The run finished (after whatever steps came before): everything held ends as a final
        row; nothing this store saw is lost."""
        self.finished = True
        for f in self.state.end_of_run():
            self._row(f.trajectory_id, f.outcome)
        self._commit()
        self.members, self.ready, self.handed = {}, {}, set()
        assert not self.state.records and not self.state.live_messages()
        for tid in self.touched:
            assert len(self.rows.get(tid, [])) == 1, f"{tid} seen by the store has rows {self.rows.get(tid)}"
        for tid in self.delivered:
            assert tid not in self.unacked, f"{tid}'s message was never acked"

    def teardown(self) -> None:
        if hasattr(self, "state") and not self.finished:
            self.run_ends()

    # ------------------------------------------------------------------ invariants
    @invariant()
    def each_admitted_id_is_in_exactly_one_place(self) -> None:
        """admitted = final + finalized-awaiting-commit + held + in flight, each id in one."""
        if not hasattr(self, "state"):
            return
        waiting = [t for t, _ in self.state.pending_final if t]
        assert sorted(waiting) == sorted(t for t, _ in self.unflushed), "archived and queued disagree"
        for tid in self.content:
            places = [tid in self.final_marks, waiting.count(tid), self.state.holds(tid),
                      tid not in self.touched and tid not in self.final_marks]
            assert sum(places) == 1, f"{tid}: final/awaiting/held/in flight = {places}"
        for tid, rows in self.rows.items():
            assert len(rows) == 1, f"{tid} has final rows {rows}"

    @invariant()
    def counts_match_the_model(self) -> None:
        if not hasattr(self, "state"):
            return
        held = {t for members in self.members.values() for t in members}
        ready = {t for gid in self.ready for t in self.members[gid]}
        counts = self.state.held_counts()
        assert sum(counts.values()) == len(held) and all(self.state.holds(t) for t in held)
        assert counts[TrajectoryState.READY.value] == len(ready)
        assert counts[TrajectoryState.HANDED_OUT.value] == len(self.handed)
        assert self.state.ready_count == len(self.ready)
        assert self.state.recovering(self.now) == (bool(self.owed) and self.now < self.deadline)


StoreMachine.TestCase.settings = settings(max_examples=200, stateful_step_count=60, deadline=None)
test_store_state_machine = StoreMachine.TestCase
