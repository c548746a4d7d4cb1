"""The store's state machine (`trajmesh.services.store.state`), every transition and recovery path, without
NATS or Redis. Messages are plain strings standing for JetStream handles."""

from __future__ import annotations

import pytest

from trajmesh.contract import Trajectory
from trajmesh.services.store.state import (
    HELD_AT_STOP,
    UNUSED_AT_END,
    Event,
    InvalidTransition,
    InvariantViolation,
    StoreState,
    TrajectoryState,
    filter_reason,
    member_ids,
)
from trajmesh.v1 import trajectory_pb2

G = 2


def _traj(tid: str, gid: str, reward: float = 1.0, version: int = 0) -> Trajectory:
    t = Trajectory.new(trajectory_id=tid)
    t.pb.task_id, t.pb.group_id = f"task-{gid}", gid
    t.append_prompt([1, 2])
    t.append_sampled([3], [-0.5], version)
    t.finish(trajectory_pb2.EOS)
    t.set_reward(reward)
    return t


def _take(s: StoreState, tid: str, gid: str, received: int, valid_count: int, *, order: int = 0,
          valid: bool = True, reward: float = 1.0):  # type: ignore[no-untyped-def]
    return s.take_member(_traj(tid, gid, reward), f"msg-{tid}", valid=valid, expected=G, order=order,
                         source="src", received=received, valid_count=valid_count, admitted_version=10 * order)


def _ready_group(s: StoreState, gid: str, order: int) -> None:
    """A complete kept group of G = 2, admitted at version 10 × order."""
    _take(s, f"{gid}-0", gid, 1, 1, order=order)
    group = _take(s, f"{gid}-1", gid, 2, 2, order=order)
    assert group is not None
    s.make_ready(group, now=0.0)


def test_received_then_ready_when_all_g_came_back() -> None:
    s = StoreState()
    assert _take(s, "a-0", "a", received=1, valid_count=1) is None
    assert s.state("a-0") is TrajectoryState.RECEIVED
    group = _take(s, "a-1", "a", received=2, valid_count=2)
    assert group is not None and [t.trajectory_id for t in group.members] == ["a-0", "a-1"]
    assert "a" not in s.assembling
    s.make_ready(group, now=5.0)
    assert s.state("a-0") is TrajectoryState.READY and s.state("a-1") is TrajectoryState.READY
    assert group.ready_at == 5.0


def test_an_invalid_member_counts_toward_g_but_is_not_held() -> None:
    s = StoreState()
    _take(s, "a-0", "a", received=1, valid_count=0, valid=False)
    assert s.state("a-0") is None and not s.holds("a-0")
    group = _take(s, "a-1", "a", received=2, valid_count=1)
    assert group is not None and [t.trajectory_id for t in group.members] == ["a-1"]


def test_group_waits_for_every_valid_member_after_a_restart() -> None:
    """Redis says 2 received and 2 valid, but only one valid member came back so far."""
    s = StoreState()
    assert _take(s, "a-1", "a", received=2, valid_count=2) is None
    assert _take(s, "a-0", "a", received=2, valid_count=2) is not None


def test_redelivery_of_a_held_message_keeps_the_newest_handle() -> None:
    s = StoreState()
    _take(s, "a-0", "a", 1, 1)
    s.redelivered("a-0", "msg-new")
    assert s.records["a-0"].msg == "msg-new"
    _ready_group(s, "b", order=1)
    s.hand_out(1, 10, now=0.0)
    s.redelivered("b-0", "msg-b-new")
    assert s.records["b-0"].msg == "msg-b-new" and s.state("b-0") is TrajectoryState.HANDED_OUT


def test_filtered_group_is_final_and_acked_at_commit() -> None:
    s = StoreState()
    _take(s, "a-0", "a", 1, 1)
    group = _take(s, "a-1", "a", 2, 2)
    assert group is not None
    finals = s.filter_group(group, "zero_variance")
    assert {(f.trajectory_id, f.outcome, f.reason) for f in finals} == {
        ("a-0", "filtered", "zero_variance"), ("a-1", "filtered", "zero_variance")}
    assert s.state("a-0") is None and s.state("a-1") is None
    ids, msgs, groups, settled = s.take_commit()
    assert sorted(ids) == ["a-0", "a-1"] and sorted(msgs) == ["msg-a-0", "msg-a-1"] and groups == ["a"]
    assert settled == ["a"]  # every member final: its gate records can go
    assert s.take_commit() == ([], [], [], [])


def test_finalize_without_mark_acks_but_does_not_mark() -> None:
    s = StoreState()
    s.finalize("dup-0", "msg-dup", mark=False)
    s.finalize("", "msg-garbage", mark=False)
    assert s.take_commit() == ([], ["msg-dup", "msg-garbage"], [], [])


def test_hand_out_serves_oldest_admission_first_and_whole_groups() -> None:
    s = StoreState()
    _ready_group(s, "young", order=7)
    _ready_group(s, "old", order=3)
    assert s.hand_out(3, 10, now=0.0) == []  # fewer than 3 groups ready: nothing
    out = s.hand_out(1, 10, now=0.0)
    assert [t.trajectory_id for t in out] == ["old-0", "old-1"]
    assert s.state("old-0") is TrajectoryState.HANDED_OUT
    assert s.hand_out(1, 1, now=0.0) == []  # a group never split to fit max_trajectories


def test_report_makes_handed_out_final_and_frees_the_group() -> None:
    s = StoreState()
    _ready_group(s, "a", order=0)
    s.hand_out(1, 10, now=0.0)
    assert s.report("a-0") == ("msg-a-0", "a")
    assert s.state("a-0") is None and s.state("a-1") is TrajectoryState.HANDED_OUT
    s.finalize("a-0", "msg-a-0")
    s.done_reporting({"a"})
    ids, msgs, groups, settled = s.take_commit()
    assert ids == ["a-0"] and msgs == ["msg-a-0"] and groups == ["a"]
    assert settled == []  # a-1 is still handed out: the group is not settled
    s.report("a-1")
    s.finalize("a-1", "msg-a-1")
    s.done_reporting({"a"})
    assert s.take_commit().settled == ["a"]


def test_report_of_an_id_held_again_after_a_restart_drops_it_from_its_group() -> None:
    """A restarted store rebuilt a group from redelivery; the learner reports what the old store gave it."""
    s = StoreState()
    _ready_group(s, "a", order=0)
    msg, gid = s.report("a-0")
    assert msg == "msg-a-0" and gid is None
    assert [t.trajectory_id for g in s.ready for t in g.members] == ["a-1"]
    s.report("a-1")
    assert s.ready == []


def test_dead_learner_recycles_handed_out_groups_in_admission_order() -> None:
    s = StoreState()
    _ready_group(s, "first", order=1)
    _ready_group(s, "second", order=2)
    s.hand_out(2, 10, now=0.0)
    _ready_group(s, "later", order=5)
    assert s.recycle_handed_out(now=1.0) == {"first": 10, "second": 20}  # back to pending, with versions
    assert [g.group_id for g in s.ready] == ["first", "second", "later"]
    assert s.state("first-0") is TrajectoryState.READY and s.records["first-0"].msg == "msg-first-0"
    assert not s.handed and s.held_counts()["handed_out"] == 0
    assert s.recycle_handed_out(now=2.0) == {}


def test_restart_recovery_holds_the_learner_until_owed_ids_are_back() -> None:
    s = StoreState()
    s.begin_recovery({"old-0", "old-1", "gone-0"}, deadline=100.0)
    _ready_group(s, "new", order=9)  # completed from fresh messages before the redeliveries
    assert s.recovering(now=1.0) and s.hand_out(1, 10, now=1.0) == []
    _ready_group(s, "old", order=2)  # redelivered: rebuilt
    s.finalize("gone-0", "msg-gone-0")  # came back and was final (e.g. quarantined)
    assert not s.owed and not s.recovering(now=1.0)
    assert [t.trajectory_id for t in s.hand_out(1, 10, now=1.0)] == ["old-0", "old-1"]


def test_recovery_gives_up_at_its_deadline() -> None:
    s = StoreState()
    s.begin_recovery({"lost-0"}, deadline=10.0)
    _ready_group(s, "a", order=0)
    assert s.hand_out(1, 10, now=9.9) == []
    assert [t.trajectory_id for t in s.hand_out(1, 10, now=10.0)] == ["a-0", "a-1"]


def test_learner_is_held_for_a_due_straggler_that_is_not_ready() -> None:
    """Learner at v = 5, η = 1: group "old" (admitted at 4) is due — after this step it could
    only be trained stale — but it is still in rollout; two younger groups are ready."""
    s = StoreState(straggler_wait_s=30.0)
    _ready_group(s, "young1", order=5)
    _ready_group(s, "young2", order=6)
    assert s.hand_out(1, 10, now=0.0, due={"old"}) == []
    assert s.held_for_stragglers() and s.state("young1-0") is TrajectoryState.READY
    assert s.hand_out(1, 10, now=29.0, due={"old"}) == []
    _ready_group(s, "old", order=4)  # it came back: it goes first
    assert [t.trajectory_id for t in s.hand_out(1, 10, now=29.5, due={"old"})] == ["old-0", "old-1"]
    assert not s.held_for_stragglers()


def test_a_due_group_already_in_the_batch_holds_nothing() -> None:
    s = StoreState()
    _ready_group(s, "due", order=1)
    _ready_group(s, "next", order=2)
    out = s.hand_out(2, 10, now=0.0, due={"due"})
    assert [t.trajectory_id for t in out] == ["due-0", "due-1", "next-0", "next-1"]


def test_every_ready_due_group_goes_in_the_batch_even_past_its_size() -> None:
    """Three due groups ready, a batch of two: after this step the third could only be trained
    stale, so the batch grows by it (past `want_groups` and `max_trajectories`); a younger group
    that is not due waits. (Seen after faults in the all-faults mesh: the third went stale.)"""
    s = StoreState()
    for gid, order in (("g10", 1), ("g11", 2), ("g12", 3), ("g13", 4)):
        _ready_group(s, gid, order=order)
    out = s.hand_out(2, 4, now=0.0, due={"g10", "g11", "g12"})
    assert [t.group_id for t in out] == ["g10", "g10", "g11", "g11", "g12", "g12"]
    assert not s.held_for_stragglers() and s.state("g13-0") is TrajectoryState.READY


def test_a_straggler_is_given_up_after_the_wait_and_never_waited_for_again() -> None:
    s = StoreState(straggler_wait_s=30.0)
    _ready_group(s, "a", order=5)
    _ready_group(s, "b", order=6)
    assert s.hand_out(1, 10, now=0.0, due={"lost"}) == []
    assert [t.trajectory_id for t in s.hand_out(1, 10, now=30.0, due={"lost"})] == ["a-0", "a-1"]
    assert s.given_up == {"lost"}
    assert [t.trajectory_id for t in s.hand_out(1, 10, now=30.1, due={"lost"})] == ["b-0", "b-1"]


def test_a_report_pays_back_an_owed_id() -> None:
    s = StoreState()
    s.begin_recovery({"a-0"}, deadline=100.0)
    s.report("a-0")
    assert not s.recovering(now=0.0)


def test_end_of_run_finalizes_everything_held() -> None:
    s = StoreState()
    _ready_group(s, "ready", order=1)
    _ready_group(s, "handed", order=0)
    s.hand_out(1, 10, now=0.0)
    _take(s, "partial-0", "partial", 1, 1)
    finals = {(f.trajectory_id, f.outcome, f.reason) for f in s.end_of_run()}
    assert finals == {
        ("ready-0", *UNUSED_AT_END), ("ready-1", *UNUSED_AT_END),
        ("handed-0", *UNUSED_AT_END), ("handed-1", *UNUSED_AT_END),
        ("partial-0", *HELD_AT_STOP),
    }
    assert UNUSED_AT_END == ("filtered", "unused_at_end_of_run") and HELD_AT_STOP[0] == "in_flight_at_stop"
    assert not s.records and not s.handed and not s.ready and not s.assembling
    ids, msgs, groups, settled = s.take_commit()
    assert sorted(ids) == ["handed-0", "handed-1", "partial-0", "ready-0", "ready-1"]
    assert len(msgs) == 5 and sorted(groups) == ["handed", "partial", "ready"]
    assert sorted(settled) == ["handed", "ready"]  # the partial group's other member never came back
    assert s.live_messages() == []


def test_live_messages_are_held_and_handed_out_ones() -> None:
    s = StoreState()
    _ready_group(s, "a", order=0)
    _take(s, "b-0", "b", 1, 1)
    s.hand_out(1, 10, now=0.0)
    assert sorted(s.live_messages()) == ["msg-a-0", "msg-a-1", "msg-b-0"]


@pytest.mark.parametrize(("rewards", "drop", "reason"), [
    ([1.0], True, "group_too_small"),
    ([], False, "group_too_small"),
    ([1.0, 1.0], True, "zero_variance"),
    ([1.0, 1.0], False, ""),
    ([0.0, 1.0], True, ""),
])
def test_filter_reason(rewards: list[float], drop: bool, reason: str) -> None:
    assert filter_reason(rewards, drop_zero_variance=drop) == reason


def test_member_ids_follow_rollout_naming() -> None:
    assert member_ids("t-c3", 3) == ["t-c3-0", "t-c3-1", "t-c3-2"]


def test_a_batch_taken_before_the_new_learners_version_counts_as_trained_not_recycled() -> None:
    """A learner that fails after training a step checkpoints on its way out, before reporting it:
    the new process starts past that step. Its batch was trained (recording it is the caller's);
    only a batch taken at the new process's version (never saved) goes back to the queue."""
    s = StoreState()
    _ready_group(s, "trained", order=1)
    s.hand_out(1, 10, now=0.0, learner_version=5)
    assert s.trained_unreported(5) == {}  # a learner back at v5 never got past that step
    assert s.trained_unreported(6) == {5: ["trained-0", "trained-1"]}


def test_an_event_the_table_does_not_allow_raises() -> None:
    """The transitions table is the only way a record moves: a READY member cannot be taken in
    again, a record cannot be recycled unless handed out, a held id cannot be finalized by hand."""
    s = StoreState()
    _ready_group(s, "a", order=0)
    with pytest.raises(InvalidTransition, match="take in state ready"):
        _take(s, "a-0", "a", 2, 2)
    with pytest.raises(InvalidTransition, match="recycle in state ready"):
        s._apply(Event.RECYCLE, [s.records["a-0"]])
    with pytest.raises(InvalidTransition, match="finalized while ready"):
        s.finalize("a-0", "msg")
    with pytest.raises(InvalidTransition, match="redeliver in state none"):
        s.redelivered("unknown-0", "msg")
    assert s.state("a-0") is TrajectoryState.READY and s.held_counts()["ready"] == 2


def test_every_transition_keeps_the_counts_and_indexes_of_its_records() -> None:
    """Each record's state agrees with the group indexes after every event of a full life."""
    s = StoreState()
    _ready_group(s, "a", order=0)
    assert s.held_counts() == {"received": 0, "ready": 2, "handed_out": 0}
    s.hand_out(1, 10, now=0.0, learner_version=3)
    assert s.held_counts() == {"received": 0, "ready": 0, "handed_out": 2}
    assert s.records["a-0"].taken_at == 3 and s.ready == [] and list(s.handed) == ["a"]
    s.recycle_handed_out(now=1.0)
    assert s.records["a-0"].taken_at is None and [g.group_id for g in s.ready] == ["a"] and not s.handed
    s.report("a-0")
    assert s.held_counts() == {"received": 0, "ready": 1, "handed_out": 0} and "a-0" not in s.records


def test_a_broken_index_is_caught_by_the_next_transition() -> None:
    s = StoreState()
    _ready_group(s, "a", order=0)
    s.handed["a"] = s.ready[0]  # an index out of step with the records
    with pytest.raises(InvariantViolation, match="a-0 .ready. disagrees"):
        s.redelivered("a-0", "msg-new")


def test_a_redelivery_before_the_commit_is_acked_not_taken_again() -> None:
    """Between an outcome's archive row and its Redis mark, a redelivery is a duplicate."""
    s = StoreState()
    _take(s, "a-0", "a", 1, 1, reward=1.0)
    group = _take(s, "a-1", "a", 2, 2, reward=1.0)
    assert group is not None
    s.filter_group(group, "zero_variance")
    assert s.awaiting_commit("a-0") and not s.holds("a-0")
    s.redelivered("a-0", "msg-a-0-again")
    ids, msgs, _, _ = s.take_commit()
    assert sorted(ids) == ["a-0", "a-1"] and sorted(msgs) == ["msg-a-0", "msg-a-0-again", "msg-a-1"]
    assert not s.awaiting_commit("a-0")


def test_a_selection_drops_members_final_and_keeps_the_rest_ready() -> None:
    """GRPO-RoC's partial keep: the dropped member is final and acked at the next commit, the kept
    one READY and the only one handed out; the group is not settled (its kept member is held)."""
    s = StoreState()
    _take(s, "a-0", "a", 1, 1)
    group = _take(s, "a-1", "a", 2, 2)
    assert group is not None
    s.make_ready(group, now=1.0, dropped={"a-1": "roc_correct_not_drawn"})
    assert s.state("a-1") is None and s.state("a-0") is TrajectoryState.READY
    assert [t.trajectory_id for t in group.members] == ["a-0"]
    assert s.take_commit() == (["a-1"], ["msg-a-1"], [], [])
    assert [t.trajectory_id for t in s.hand_out(1, 10, now=1.0)] == ["a-0"]


def test_a_selection_must_keep_a_member() -> None:
    s = StoreState()
    _take(s, "a-0", "a", 1, 1)
    group = _take(s, "a-1", "a", 2, 2)
    assert group is not None
    with pytest.raises(InvalidTransition):
        s.make_ready(group, now=1.0, dropped={"a-0": "x", "a-1": "x"})
    assert s.state("a-0") is TrajectoryState.RECEIVED  # nothing moved
