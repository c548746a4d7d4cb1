"""`learner.truncation` where the learner builds its batch (learner/step.py `apply_truncation`) and
the per-step response lengths, with values worked out by hand.

Three trajectories of one group: t0 answered in 2 tokens (EOS, reward 1), t1 ran out of its 4-token
budget (MAX_TOKENS, reward 1: a grader that still found an answer), t2 is an agent session of two
segments (rows) with 1 + 2 sampled tokens, truncated, reward 0. t1 comes from source src-b, the
others from src-a.
"""

from __future__ import annotations

import pytest

from trajmesh.config import ConfigError, load_config
from trajmesh.contract import Trajectory
from trajmesh.learner import step
from trajmesh.v1 import trajectory_pb2


def _trajs() -> list[Trajectory]:
    out = []
    for i, (segments, reason, reward) in enumerate([([2], trajectory_pb2.EOS, 1.0),
                                                   ([4], trajectory_pb2.MAX_TOKENS, 1.0),
                                                   ([1, 2], trajectory_pb2.MAX_TOKENS, 0.0)]):
        t = Trajectory.new(trajectory_id=f"t{i}")
        t.pb.group_id, t.pb.task_source = "g", "src-b" if i == 1 else "src-a"
        for n in segments:
            t.start_segment()
            t.append_prompt([1, 5])
            t.append_sampled([7] * n, [-1.0] * n, 0)
        t.finish(reason)
        t.set_reward(reward)
        out.append(t)
    return out


def _apply(policy: str, **lengths: int) -> tuple[list[float], list[float]]:
    trajs = _trajs()
    batch = step.build_batch(trajs, 0)
    assert batch.trajectory_ids == ["t0", "t1", "t2", "t2"]  # t2's two segments are two rows
    out = step.apply_truncation(batch, trajs, policy, **lengths)  # type: ignore[arg-type]
    return out.reward_B.tolist(), out.mask_BT.sum(-1).tolist()


def test_keep_changes_nothing() -> None:
    assert _apply("keep") == ([1.0, 1.0, 0.0, 0.0], [2.0, 4.0, 1.0, 2.0])


def test_mask_takes_every_row_of_a_truncated_trajectory_out_of_the_loss() -> None:
    assert _apply("mask") == ([1.0, 1.0, 0.0, 0.0], [2.0, 0.0, 0.0, 0.0])


def test_zero_reward_keeps_the_tokens_and_zeroes_the_reward() -> None:
    assert _apply("zero_reward") == ([1.0, 0.0, 0.0, 0.0], [2.0, 4.0, 1.0, 2.0])


def test_dapo_soft_penalizes_the_whole_response_length_on_every_row() -> None:
    # L_max 4, L_cache 2: free up to 2 tokens, then -(n-2)/2, -1 past 4.
    # t0: 2 tokens -> 1 + 0; t1: 4 tokens -> 1 - 1 = 0; t2: 1 + 2 = 3 tokens (both rows) -> 0 - 0.5.
    assert _apply("dapo_soft", max_length=4, cache_length=2) == ([1.0, 0.0, -0.5, -0.5], [2.0, 4.0, 1.0, 2.0])


def test_dapo_soft_defaults_and_bad_lengths_from_the_config() -> None:
    cfg = load_config(None, {"tasks.sampling.max_new_tokens": 10, "tasks.sampling.max_turns": 2,
                             "learner.truncation.policy": "dapo_soft"})
    assert cfg.learner.truncation.lengths(cfg.tasks.sampling) == (20, 4)
    with pytest.raises(ConfigError, match="cache_length 8 is larger than max_length 4"):
        load_config(None, {"learner.truncation.policy": "dapo_soft", "learner.truncation.max_length": 4,
                           "learner.truncation.cache_length": 8})
    with pytest.raises(ConfigError):
        load_config(None, {"learner.truncation.policy": "drop"})


def test_response_length_metrics_by_correctness_and_source() -> None:
    m = step.response_length_metrics(_trajs())  # lengths 2, 4, 3; rewards 1, 1, 0
    assert m["trajmesh_learner_response_length_mean_tokens"] == pytest.approx(3.0)
    assert m["trajmesh_learner_response_length_p50_tokens"] == 3.0
    assert m["trajmesh_learner_response_length_p90_tokens"] == pytest.approx(3.8)  # 3 + 0.8 * (4 - 3)
    assert m["trajmesh_learner_response_length_max_tokens"] == 4.0
    assert m["trajmesh_learner_response_length_correct_mean_tokens"] == pytest.approx(3.0)
    assert m["trajmesh_learner_response_length_incorrect_mean_tokens"] == 3.0
    assert m["response_length_mean_tokens_by_source"] == {"src-a": 2.5, "src-b": 4.0}
    assert step.response_length_metrics([]) == {}
