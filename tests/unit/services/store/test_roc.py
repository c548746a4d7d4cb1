"""GRPO-RoC's selection (`trajmesh.services.store.roc`) on hand-made groups, every expected value
worked out by hand from the rule in the module doc (survey §5.2)."""

from __future__ import annotations

import re

import pytest

from trajmesh.contract import Trajectory
from trajmesh.services.store import roc
from trajmesh.v1 import trajectory_pb2

TAG = re.compile(r"<answer>")
OK, ERR, TIMEOUT = trajectory_pb2.TOOL_OK, trajectory_pb2.TOOL_ERROR, trajectory_pb2.TOOL_TIMEOUT


def _traj(tid: str, reward: float, calls: tuple[int, ...] = (), turns: int = 1) -> Trajectory:
    """`turns` sampled turns; a tool call (with status) per entry of `calls`, in turn 0."""
    t = Trajectory.new(trajectory_id=tid)
    t.pb.group_id = "g"
    t.append_prompt([1, 2])
    for k in range(turns):
        t.append_sampled([3], [-0.5], 0, action_type=trajectory_pb2.TOOL_CALL if calls and k == 0
                         else trajectory_pb2.TEXT, turn_index=k)
        if k + 1 < turns:
            t.append_observation([4])
    for status in calls:
        t.add_tool_call("python", "print(1)", "1", status=status)
    t.finish(trajectory_pb2.EOS)
    t.set_reward(reward)
    return t


def test_tool_error_score_by_hand() -> None:
    assert roc.tool_error_score(_traj("a", 1.0)) == 0.5  # no call
    assert roc.tool_error_score(_traj("a", 1.0, (OK, ERR))) == 0.5
    assert roc.tool_error_score(_traj("a", 1.0, (OK, OK, OK, TIMEOUT))) == 0.25
    assert roc.tool_error_score(_traj("a", 1.0, (OK, OK))) == 0.0


def test_format_score_by_hand() -> None:
    one_turn, two_turns = _traj("a", 1.0), _traj("b", 1.0, turns=2)
    assert roc.sampled_turns(one_turn) == 1 and roc.sampled_turns(two_turns) == 2
    assert roc.scores(one_turn, "the sum is 5", TAG).format == 1.0  # no answer tag
    assert roc.scores(one_turn, "<answer>5</answer>", TAG).format == 0.0  # (1 - 1) / 1
    assert roc.scores(two_turns, "<answer>1</answer> then <answer>2</answer>", TAG).format == 0.5  # (2 - 1) / 2
    assert roc.scores(one_turn, "<answer>1</answer><answer>2</answer><answer>3</answer>", TAG).format == 1.0  # min(1, 2)


@pytest.mark.parametrize(("positives", "negatives", "keep", "expected"), [
    (5, 3, 4, (2, 2)),  # negatives up to half, positives the rest
    (1, 7, 4, (1, 3)),  # too few positives: negatives fill in
    (6, 1, 4, (3, 1)),  # too few negatives: positives fill in
    (0, 8, 4, (0, 4)),
    (8, 0, 4, (4, 0)),
    (5, 4, 5, (3, 2)),  # odd keep: floor(5 / 2) negatives
    (2, 1, 4, (2, 1)),  # at most keep members: all kept
])
def test_split_counts_by_hand(positives: int, negatives: int, keep: int, expected: tuple[int, int]) -> None:
    assert roc.split_counts(positives, negatives, keep) == expected


def _group() -> list[Trajectory]:
    """8 members: 5 correct (p*), 3 incorrect (n*); keep 4 → 2 of each."""
    return ([_traj(f"p{i}", 1.0, (OK,)) for i in range(5)] + [_traj(f"n{i}", 0.0) for i in range(3)])


def _select(group_id: str, members: list[Trajectory], keep: int = 4) -> list[roc.Decision]:
    return roc.select(group_id, members, keep, correct_above=0.5, penalty_floor=0.1,
                      scored=lambda t: roc.scores(t, "<answer>1</answer>", TAG))


def test_a_hand_made_group_keeps_two_of_each_side_with_reasons() -> None:
    decisions = _select("g1", _group())
    kept = [d for d in decisions if d.kept]
    assert len(kept) == 4
    assert sorted(d.reason for d in kept) == sorted([roc.KEPT_NEGATIVE] * 2 + [roc.KEPT_POSITIVE] * 2)
    dropped = {d.trajectory_id: d.reason for d in decisions if not d.kept}
    assert len(dropped) == 4
    assert all(r == (roc.DROPPED_POSITIVE if tid.startswith("p") else roc.DROPPED_NEGATIVE) for tid, r in dropped.items())
    assert sum(tid.startswith("n") for tid in dropped) == 1  # 3 incorrect, 2 kept
    # one OK call and one answer tag in one turn: tool 0, format 0
    assert {d.scores for d in decisions if d.trajectory_id.startswith("p")} == {roc.Scores(0.0, 0.0)}


def test_the_draw_depends_on_the_group_id_not_the_arrival_order() -> None:
    members = _group()
    first = {(d.trajectory_id, d.kept) for d in _select("g1", members)}
    assert first == {(d.trajectory_id, d.kept) for d in _select("g1", members[::-1])}  # a rebuilt group
    draws = {frozenset(d.trajectory_id for d in _select(f"g{i}", members) if d.kept) for i in range(50)}
    assert len(draws) > 1  # other groups draw other members


def test_a_group_of_at_most_keep_members_keeps_them_all() -> None:
    members = _group()[:3] + _group()[5:6]  # 3 correct, 1 incorrect
    assert all(d.kept for d in _select("g1", members))


def test_clean_successes_are_drawn_in_proportion_to_the_inverse_penalty() -> None:
    """One positive slot (keep 2: one incorrect, one correct) between a clean correct trace (tool 0 +
    format 0 = penalty 0) and a messy one (no tool call 0.5 + no answer tag 1 = 1.5). Weights
    1 / (0 + 0.1) = 10 and 1 / (1.5 + 0.1) = 0.625: the clean one is kept with probability
    10 / 10.625 = 0.941 (over 4,000 groups the share's standard error is 0.004)."""
    clean, messy, wrong = _traj("clean", 1.0, (OK,)), _traj("messy", 1.0), _traj("wrong", 0.0)
    text = {"clean": "<answer>3</answer>", "messy": "3", "wrong": "<answer>4</answer>"}
    n, clean_kept = 4000, 0
    for i in range(n):
        decisions = roc.select(f"group-{i}", [clean, messy, wrong], 2, correct_above=0.5, penalty_floor=0.1,
                               scored=lambda t: roc.scores(t, text[t.trajectory_id], TAG))
        kept = {d.trajectory_id for d in decisions if d.kept}
        assert "wrong" in kept and len(kept) == 2
        clean_kept += "clean" in kept
    assert abs(clean_kept / n - 10 / 10.625) < 0.02


def test_the_store_admits_oversample_times_the_group_size() -> None:
    from trajmesh.config import load_config

    on = load_config(None, {"tasks.group_size": 4, "store.resample_on_correct.enabled": True,
                            "store.resample_on_correct.oversample": 3, "gate.eta": 1, "learner.batch_groups": 2})
    assert on.admitted_group_size == 12 and on.batch_trajectories == 8  # the learner still trains G a group
    assert load_config(None, {"tasks.group_size": 4}).admitted_group_size == 4
