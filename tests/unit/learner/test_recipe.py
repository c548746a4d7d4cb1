"""The training recipe (learner/recipe.py) without a service: what a step trains on, worked by hand
for a batch of two groups, one trajectory too stale to train."""

from __future__ import annotations

import pytest
import torch

from trajmesh.config import load_config
from trajmesh.contract import Trajectory
from trajmesh.learner.recipe import prepare
from trajmesh.v1 import trajectory_pb2


def _traj(tid: str, group: str, reward: float, version: int, n: int = 2) -> Trajectory:
    t = Trajectory.new(trajectory_id=tid)
    t.pb.group_id = group
    t.append_prompt([1, 2, 3])
    t.append_sampled([5 + k for k in range(n)], [-0.5] * n, version)
    t.finish(trajectory_pb2.EOS)
    t.set_reward(reward)
    return t


def _batch() -> list[Trajectory]:
    # learner version 4, η = 1: "old" (sampled at 2, lag 2) is stale; the rest are kept
    return [_traj("a0", "a", 1.0, 4), _traj("a1", "a", 0.0, 3, n=3),
            _traj("b0", "b", 1.0, 4), _traj("b1", "b", 1.0, 4), _traj("old", "b", 0.0, 2)]


def test_the_recipe_splits_stale_batches_and_computes_grpo_by_hand() -> None:
    cfg = load_config(None, {"learner.advantage.type": "grpo", "learner.advantage.scale_by_std": False})
    recipe = prepare(_batch(), cfg, version=4, eta=1, pad_id=0)
    assert [t.trajectory_id for t in recipe.keep] == ["a0", "a1", "b0", "b1"]
    assert [t.trajectory_id for t in recipe.stale] == ["old"]
    assert recipe.batch is not None and recipe.adv_BT is not None
    mask = recipe.batch.mask_BT > 0
    # Group a: rewards 1, 0 (mean 0.5) → +0.5, −0.5 on every sampled token; group b (kept: 1, 1) → 0.
    per_row = [sorted(set(recipe.adv_BT[r][mask[r]].tolist())) for r in range(4)]
    assert per_row == [[0.5], [-0.5], [0.0], [0.0]]
    assert mask.sum(dim=1).tolist() == [2, 3, 2, 2]
    assert recipe.metrics["trajmesh_learner_response_length_mean_tokens"] == pytest.approx(9 / 4)
    assert "advantage_minus_grpo_max_abs" not in recipe.metrics  # grpo itself: nothing to compare


def test_a_non_grpo_recipe_says_how_far_it_is_from_grpo() -> None:
    cfg = load_config(None, {"learner.advantage.type": "rloo"})
    recipe = prepare(_batch(), cfg, version=4, eta=1, pad_id=0)
    assert recipe.adv_BT is not None and recipe.batch is not None
    # RLOO, group a: 1 − 0 = +1 and 0 − 1 = −1; GRPO (std-scaled) is ±0.707: the gap is 1 − 1/√2
    assert recipe.metrics["advantage_minus_grpo_max_abs"] == pytest.approx(1 - 2 ** -0.5, rel=1e-4)
    assert torch.equal(recipe.adv_BT[2], torch.zeros_like(recipe.adv_BT[2]))


def test_an_all_stale_batch_trains_nothing() -> None:
    cfg = load_config(None)
    recipe = prepare(_batch(), cfg, version=9, eta=1, pad_id=0)
    assert recipe.keep == [] and len(recipe.stale) == 5
    assert recipe.batch is None and recipe.adv_BT is None
    assert "trajmesh_learner_response_length_mean_tokens" not in recipe.metrics
