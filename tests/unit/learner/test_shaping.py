"""Hand-computed fixtures for trajmesh.learner.shaping (survey §3.7, §7.5, §10 item 7)."""

from __future__ import annotations

import json

import pytest
import torch

from trajmesh.learner.shaping import MagicEntropyController, apply_truncation_policy, dapo_overlong_penalty


def test_dapo_overlong_penalty_at_boundaries() -> None:
    # L_max = 20, L_cache = 4 -> soft region starts after 16.
    # |y|:   0   16 (=L_max-L_cache)  17              18      20 (=L_max)     21   100
    # r:     0   0                    (16-17)/4=-0.25 -0.5    (16-20)/4=-1    -1   -1
    length_B = torch.tensor([0, 16, 17, 18, 20, 21, 100])
    expected = [0.0, 0.0, -0.25, -0.5, -1.0, -1.0, -1.0]
    assert dapo_overlong_penalty(length_B, max_length=20, cache_length=4).tolist() == expected


def test_dapo_overlong_penalty_paper_values() -> None:
    # DAPO run: L_max 20,480, L_cache 4,096 -> 16,384 is free, 18,432 is halfway (-0.5).
    out = dapo_overlong_penalty(torch.tensor([16_384, 18_432, 20_480, 20_481]), 20_480, 4_096)
    assert out.tolist() == [0.0, -0.5, -1.0, -1.0]


def test_dapo_overlong_penalty_rejects_bad_cache() -> None:
    with pytest.raises(ValueError):
        dapo_overlong_penalty(torch.tensor([1]), max_length=4, cache_length=5)


def _build_batch() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    reward_B = torch.tensor([1.0, 1.0, 0.0])
    truncated_B = torch.tensor([False, True, True])
    mask_BT = torch.tensor([[1.0, 1.0, 0.0, 0.0], [1.0, 1.0, 1.0, 1.0], [0.0, 1.0, 1.0, 1.0]])
    return reward_B, truncated_B, mask_BT


def test_truncation_policy_mask_drops_truncated_rows() -> None:
    reward_B, truncated_B, mask_BT = _build_batch()
    r, m = apply_truncation_policy(reward_B, truncated_B, mask_BT, "mask")
    assert r.tolist() == [1.0, 1.0, 0.0]
    assert m.tolist() == [[1.0, 1.0, 0.0, 0.0], [0.0] * 4, [0.0] * 4]
    assert mask_BT[1].sum().item() == 4  # input untouched


def test_truncation_policy_zero_reward_keeps_tokens() -> None:
    reward_B, truncated_B, mask_BT = _build_batch()
    r, m = apply_truncation_policy(reward_B, truncated_B, mask_BT, "zero_reward")
    assert r.tolist() == [1.0, 0.0, 0.0]
    assert torch.equal(m, mask_BT)


def test_truncation_policy_dapo_soft_uses_masked_length() -> None:
    # masked lengths [2, 4, 3]; L_max 4, L_cache 2 -> free up to 2:
    # row0: 1 + 0 = 1 ; row1: 1 + (2-4)/2 = 0 ; row2: 0 + (2-3)/2 = -0.5
    reward_B, truncated_B, mask_BT = _build_batch()
    r, m = apply_truncation_policy(reward_B, truncated_B, mask_BT, "dapo_soft", max_length=4, cache_length=2)
    assert r.tolist() == [1.0, 0.0, -0.5]
    assert torch.equal(m, mask_BT)
    # explicit lengths (multi-turn): 5 > L_max -> -1
    r, _ = apply_truncation_policy(reward_B, truncated_B, mask_BT, "dapo_soft", length_B=torch.tensor([5, 0, 0]),
                                   max_length=4, cache_length=2)
    assert r.tolist() == [0.0, 1.0, 0.0]
    with pytest.raises(ValueError):
        apply_truncation_policy(reward_B, truncated_B, mask_BT, "dapo_soft")


def test_magic_controller_follows_report_equation() -> None:
    # H* = 0.2, Δ = 0.005, c0 = 0. alpha_k = c_k·1{H_k <= H*}, then c moves by ±Δ.
    # k  H     alpha_k   c_{k+1}
    # 0  0.1   0         0.005
    # 1  0.1   0.005     0.010
    # 2  0.3   0         0.005
    # 3  0.2   0.005     0.005   (H = H*: indicator on, state unchanged)
    # 4  0.1   0.005     0.010
    ctl = MagicEntropyController(target_entropy=0.2, delta=0.005)
    alphas = [ctl.update(h) for h in (0.1, 0.1, 0.3, 0.2, 0.1)]
    assert alphas == pytest.approx([0.0, 0.005, 0.0, 0.005, 0.005])
    assert ctl.coef == pytest.approx(0.010)
    assert ctl.steps == 5


def test_magic_controller_clamps() -> None:
    # Default min_coef 0: high entropy from c = 0 keeps c at 0 (the unclipped equation gives -0.005).
    ctl = MagicEntropyController()
    ctl.update(0.5)
    assert ctl.coef == 0.0
    raw = MagicEntropyController(min_coef=None)
    raw.update(0.5)
    assert raw.coef == pytest.approx(-0.005)
    # Script-style cap: Δ = 1e-4, max 0.005 -> 60 low-entropy steps stop at 0.005.
    capped = MagicEntropyController(delta=1e-4, max_coef=0.005)
    for _ in range(60):
        capped.update(0.0)
    assert capped.coef == 0.005


def test_magic_controller_state_dict_round_trip() -> None:
    ctl = MagicEntropyController(delta=0.01)
    for h in (0.1, 0.05, 0.3, 0.1):
        ctl.update(h)
    state = json.loads(json.dumps(ctl.state_dict()))  # survives a JSON checkpoint
    restored = MagicEntropyController(delta=0.01)
    restored.load_state_dict(state)
    assert restored.state_dict() == ctl.state_dict()
    for h in (0.1, 0.25, 0.15):
        assert restored.update(h) == ctl.update(h)
    assert restored.coef == ctl.coef
    with pytest.raises(ValueError):
        MagicEntropyController(delta=0.02).load_state_dict(state)
