"""Hand-computed fixtures for trajmesh.learner.advantages (survey §10, level 0)."""

from __future__ import annotations

import math

import pytest
import torch

from trajmesh.learner.advantages import (
    discounted_returns,
    dr_grpo_advantages,
    expand_steps_to_tokens,
    expand_to_tokens,
    gae_advantages,
    gigpo_advantages,
    grpo_advantages,
    reinforce_pp_advantages,
    rloo_advantages,
)

F64 = torch.float64


def _t(*values: float) -> torch.Tensor:
    return torch.tensor(values, dtype=F64)


def _close(actual: torch.Tensor, expected: list[float] | list[list[float]], tol: float = 1e-12) -> None:
    torch.testing.assert_close(actual, torch.tensor(expected, dtype=actual.dtype), atol=tol, rtol=0)


def test_all_equal_group_rewards_give_exactly_zero_advantage() -> None:
    # 0.1 + 0.1 + 0.1 is not exactly 0.3 in floating point; the result must still be exactly 0.
    for dtype in (torch.float32, F64):
        reward_B = torch.tensor([0.1, 0.1, 0.1, 1.0, 1.0], dtype=dtype)
        group_B = torch.tensor([0, 0, 0, 1, 1])
        for fn in (grpo_advantages, dr_grpo_advantages, rloo_advantages):
            assert torch.equal(fn(reward_B, group_B), torch.zeros(5, dtype=dtype)), fn.__name__
        mask_BT = torch.ones(5, 3)
        assert torch.equal(reinforce_pp_advantages(reward_B, group_B, mask_BT), torch.zeros(5, 3, dtype=dtype))


def test_group_of_one_gets_zero_advantage() -> None:
    # Group 7 has one member (reward 5): no relative signal → 0 by our convention, all estimators.
    reward_B = _t(5.0, 1.0, 0.0)
    group_B = torch.tensor([7, 2, 2])
    for fn in (grpo_advantages, dr_grpo_advantages, rloo_advantages):
        assert fn(reward_B, group_B)[0].item() == 0.0, fn.__name__


def test_one_positive_group_hand_values() -> None:
    # R = [1,0,0,0]; mean = 0.25; centred = [0.75,-0.25,-0.25,-0.25]
    # unbiased var = (0.5625 + 3*0.0625)/3 = 0.25 -> std 0.5 -> GRPO = [1.5,-0.5,-0.5,-0.5]
    # RLOO: 1 - mean(0,0,0) = 1 ; 0 - mean(1,0,0) = -1/3
    reward_B, group_B = _t(1, 0, 0, 0), torch.zeros(4, dtype=torch.long)
    _close(grpo_advantages(reward_B, group_B, eps=0.0), [1.5, -0.5, -0.5, -0.5])
    _close(dr_grpo_advantages(reward_B, group_B), [0.75, -0.25, -0.25, -0.25])
    _close(rloo_advantages(reward_B, group_B), [1.0, -1 / 3, -1 / 3, -1 / 3])
    # default eps = 1e-6: 0.75 / 0.500001
    _close(grpo_advantages(reward_B, group_B), [0.75 / 0.500001, -0.25 / 0.500001, -0.25 / 0.500001,
                                                -0.25 / 0.500001])


def test_balanced_group_hand_values() -> None:
    # R = [1,1,0,0]; mean 0.5; centred ±0.5; unbiased var = 4*0.25/3 = 1/3; std = 0.577350
    # GRPO = ±0.5/0.577350 = ±sqrt(3)/2 = ±0.866025 ; RLOO: 1 - mean(1,0,0) = 2/3
    reward_B, group_B = _t(1, 1, 0, 0), torch.zeros(4, dtype=torch.long)
    h = math.sqrt(3) / 2
    _close(grpo_advantages(reward_B, group_B, eps=0.0), [h, h, -h, -h])
    _close(dr_grpo_advantages(reward_B, group_B), [0.5, 0.5, -0.5, -0.5])
    _close(rloo_advantages(reward_B, group_B), [2 / 3, 2 / 3, -2 / 3, -2 / 3])


def test_continuous_rewards_hand_values() -> None:
    # R = [0.2,0.5,0.8]; mean 0.5; centred [-0.3,0,0.3]; unbiased var = 0.18/2 = 0.09; std 0.3
    # GRPO = [-1,0,1]; RLOO: 0.2 - (0.5+0.8)/2 = -0.45, 0.5 - 0.5 = 0, 0.8 - 0.35 = 0.45
    reward_B, group_B = _t(0.2, 0.5, 0.8), torch.zeros(3, dtype=torch.long)
    _close(grpo_advantages(reward_B, group_B, eps=0.0), [-1.0, 0.0, 1.0])
    _close(dr_grpo_advantages(reward_B, group_B), [-0.3, 0.0, 0.3])
    _close(rloo_advantages(reward_B, group_B), [-0.45, 0.0, 0.45])


def test_groups_are_independent_and_ids_need_not_be_contiguous() -> None:
    # Group 3 = [1,0] (interleaved with group 9 = [0.2,0.8]); each: centred ±0.5 / ±0.3,
    # unbiased std = sqrt(2*0.25/1) = 0.707107 / sqrt(2*0.09) = 0.424264 -> ±1/sqrt(2) both.
    reward_B = _t(1.0, 0.2, 0.0, 0.8)
    group_B = torch.tensor([3, 9, 3, 9])
    s = 1 / math.sqrt(2)
    _close(grpo_advantages(reward_B, group_B, eps=0.0), [s, -s, -s, s])


def test_duplicating_a_response_changes_only_its_group() -> None:
    # Group 0 = [1,0,0]: mean 1/3, centred [2/3,-1/3,-1/3], var = (4/9+1/9+1/9)/2 = 1/3,
    #   GRPO = [2/3, -1/3, -1/3] / 0.577350 = [1.154701, -0.577350, -0.577350].
    # Duplicate response 0 -> group 0 = [1,0,0,1]: balanced, ±0.866025 (see balanced test);
    #   Dr.GRPO [2/3,-1/3,-1/3] -> [0.5,-0.5,-0.5,0.5]; RLOO [1,-0.5,-0.5] -> [2/3,-2/3,-2/3,2/3].
    # Group 1 = [0.2,0.5,0.8] must be bit-identical before and after.
    reward_B, group_B = _t(1, 0, 0, 0.2, 0.5, 0.8), torch.tensor([0, 0, 0, 1, 1, 1])
    dup_reward_B = torch.cat([reward_B, reward_B[:1]])
    dup_group_B = torch.cat([group_B, group_B[:1]])
    r3 = 1 / math.sqrt(3)
    h = math.sqrt(3) / 2
    before = grpo_advantages(reward_B, group_B, eps=0.0)
    after = grpo_advantages(dup_reward_B, dup_group_B, eps=0.0)
    _close(before[:3], [2 * r3, -r3, -r3])
    _close(after[[0, 1, 2, 6]], [h, -h, -h, h])
    assert torch.equal(before[3:], after[3:6])
    assert after[0].item() == after[6].item()  # the copy gets the original's advantage
    _close(dr_grpo_advantages(dup_reward_B, dup_group_B)[[0, 1, 2, 6]], [0.5, -0.5, -0.5, 0.5])
    assert torch.equal(dr_grpo_advantages(reward_B, group_B)[3:], dr_grpo_advantages(dup_reward_B, dup_group_B)[3:6])
    _close(rloo_advantages(reward_B, group_B)[:3], [1.0, -0.5, -0.5])
    _close(rloo_advantages(dup_reward_B, dup_group_B)[[0, 1, 2, 6]], [2 / 3, -2 / 3, -2 / 3, 2 / 3])
    assert torch.equal(rloo_advantages(reward_B, group_B)[3:], rloo_advantages(dup_reward_B, dup_group_B)[3:6])


def test_reinforce_pp_hand_values() -> None:
    # groups [0,0,1], R = [1,0,0.3] -> group-centred [0.5,-0.5,0] (group of one -> 0)
    # masked tokens: row0 two tokens of 0.5, row1 one of -0.5, row2 three of 0 -> N = 6
    # mu = (0.5+0.5-0.5)/6 = 1/12 ; deviations 5/12 (x2), -7/12, -1/12 (x3)
    # var = (2*25 + 49 + 3*1)/144/6 = 102/864 = 17/144 -> std = sqrt(17)/12
    # adv = dev/std: 5/sqrt(17) = 1.212678, -7/sqrt(17) = -1.697749, -1/sqrt(17) = -0.242536
    reward_B, group_B = _t(1.0, 0.0, 0.3), torch.tensor([0, 0, 1])
    mask_BT = torch.tensor([[1, 1, 0], [1, 0, 0], [1, 1, 1]])
    r17 = math.sqrt(17)
    adv_BT = reinforce_pp_advantages(reward_B, group_B, mask_BT, eps=0.0)
    _close(adv_BT, [[5 / r17, 5 / r17, 0.0], [-7 / r17, 0.0, 0.0], [-1 / r17, -1 / r17, -1 / r17]])
    assert adv_BT[mask_BT == 0].abs().sum().item() == 0.0


def test_expand_to_tokens_zero_off_mask() -> None:
    adv_B = _t(2.0, -1.0)
    mask_BT = torch.tensor([[1, 0, 1], [0, 1, 0]])
    _close(expand_to_tokens(adv_B, mask_BT), [[2.0, 0.0, 2.0], [0.0, -1.0, 0.0]])


def test_gae_skips_observation_gap_hand_values() -> None:
    # mask [1,1,0,0,1]: tokens 2,3 are a tool observation (values 9 must never be read).
    # gamma 0.9, lam 0.8, reward 1 on the last action token.
    # t=4: delta = 1 + 0.9*0 - 0.2 = 0.8                    A4 = 0.8
    # t=1: delta = 0 + 0.9*V4(0.2) - 0.4 = -0.22            A1 = -0.22 + 0.72*0.8 = 0.356
    # t=0: delta = 0 + 0.9*0.4 - 0.5 = -0.14                A0 = -0.14 + 0.72*0.356 = 0.11632
    # returns = A + V = [0.61632, 0.756, 0, 0, 1.0]
    reward_BT = torch.tensor([[0.0, 0.0, 0.0, 0.0, 1.0]], dtype=F64)
    value_BT = torch.tensor([[0.5, 0.4, 9.0, 9.0, 0.2]], dtype=F64)
    mask_BT = torch.tensor([[1, 1, 0, 0, 1]])
    adv_BT, ret_BT = gae_advantages(reward_BT, value_BT, mask_BT, gamma=0.9, lam=0.8)
    _close(adv_BT, [[0.11632, 0.356, 0.0, 0.0, 0.8]])
    _close(ret_BT, [[0.61632, 0.756, 0.0, 0.0, 1.0]])


def test_gae_reward_on_observation_credits_previous_action_batched() -> None:
    # Row 0: mask [1,0,1,0,0], reward 0.5 on the observation token 1, reward 1 on token 2,
    # gamma = lam = 1. t=2: A2 = 1 - 0.6 = 0.4. t=0: delta = (0 + 0.5) + 0.6 - 0.2 = 0.9,
    # A0 = 0.9 + 0.4 = 1.3 (= total reward 1.5 - V0 0.2, as gamma = lam = 1 demands).
    # Row 1: a single action token: A = 2 - 0.5 = 1.5; padding values 3 ignored.
    reward_BT = torch.tensor([[0.0, 0.5, 1.0, 0.0, 0.0], [2.0, 0.0, 0.0, 0.0, 0.0]], dtype=F64)
    value_BT = torch.tensor([[0.2, 7.0, 0.6, 3.0, 3.0], [0.5, 3.0, 3.0, 3.0, 3.0]], dtype=F64)
    mask_BT = torch.tensor([[1, 0, 1, 0, 0], [1, 0, 0, 0, 0]])
    adv_BT, ret_BT = gae_advantages(reward_BT, value_BT, mask_BT, gamma=1.0, lam=1.0)
    _close(adv_BT, [[1.3, 0.0, 0.4, 0.0, 0.0], [1.5, 0.0, 0.0, 0.0, 0.0]])
    _close(ret_BT, [[1.5, 0.0, 1.0, 0.0, 0.0], [2.0, 0.0, 0.0, 0.0, 0.0]])


def test_discounted_returns_hand_values() -> None:
    # r = [0, 0, 1], gamma 0.5 -> G = [0.25, 0.5, 1]
    assert discounted_returns([[0.0, 0.0, 1.0], []], 0.5) == [[0.25, 0.5, 1.0], []]


def _gigpo_fixture() -> tuple[torch.Tensor, torch.Tensor, list[list[str]], list[list[float]]]:
    # Group 0: ep0 succeeds (R=1) via states s0 -> sA; ep1 fails (R=0) via s0 -> sA -> sB.
    # Group 1: ep2, ep3 both visit a state ALSO hashed "s0" but belong to another prompt.
    reward_B = _t(1.0, 0.0, 0.5, 0.5)
    group_B = torch.tensor([0, 0, 1, 1])
    hashes = [["s0", "sA"], ["s0", "sA", "sB"], ["s0"], ["s0"]]
    returns = [[0.9, 1.0], [0.0, 0.0, 0.0], [0.5], [0.2]]
    return reward_B, group_B, hashes, returns


def test_gigpo_two_anchor_states_hand_values() -> None:
    # Episode level (group 0): R = [1,0] -> ±0.5 / sqrt(0.5) = ±1/sqrt2 ; group 1 all equal -> 0.
    # Anchor (0,"s0"): returns {0.9, 0.0} -> ±0.45 / sqrt(2*0.45^2) = ±1/sqrt2
    # Anchor (0,"sA"): returns {1.0, 0.0} -> ±1/sqrt2 ; (0,"sB") singleton -> 0
    # Anchor (1,"s0"): returns {0.5, 0.2} -> ±0.15 / sqrt(2*0.15^2) = ±1/sqrt2
    #   (had it been pooled with group 0's "s0", the values would differ).
    # omega = 1: ep0 = [s+s, s+s], ep1 = [-s-s, -s-s, -s+0], ep2 = [0+s], ep3 = [0-s]
    s = 1 / math.sqrt(2)
    adv_BS, step_mask_BS = gigpo_advantages(*_gigpo_fixture(), omega=1.0, eps=0.0)
    _close(adv_BS, [[2 * s, 2 * s, 0.0], [-2 * s, -2 * s, -s], [s, 0.0, 0.0], [-s, 0.0, 0.0]])
    assert step_mask_BS.tolist() == [[True, True, False], [True, True, True], [True, False, False],
                                     [True, False, False]]


def test_gigpo_without_std_scaling_and_omega_half() -> None:
    # A^E = R - mean: [0.5, -0.5, 0, 0]; A^S: s0 {0.9,0} -> ±0.45 ; sA {1,0} -> ±0.5 ; sB 0 ;
    # group 1 s0 {0.5,0.2} -> ±0.15. omega 0.5:
    # ep0 = [0.5+0.225, 0.5+0.25] ; ep1 = [-0.5-0.225, -0.5-0.25, -0.5] ; ep2 = [0.075] ; ep3 = [-0.075]
    adv_BS, _ = gigpo_advantages(*_gigpo_fixture(), omega=0.5, scale_by_std=False)
    _close(adv_BS, [[0.725, 0.75, 0.0], [-0.725, -0.75, -0.5], [0.075, 0.0, 0.0], [-0.075, 0.0, 0.0]])


def test_gigpo_without_repeated_states_is_episode_grpo() -> None:
    reward_B, group_B = _t(1.0, 0.0), torch.tensor([0, 0])
    adv_BS, _ = gigpo_advantages(reward_B, group_B, [["a", "b"], ["c"]], [[1.0, 1.0], [0.0]], eps=0.0)
    s = 1 / math.sqrt(2)
    _close(adv_BS, [[s, s], [-s, 0.0]])


def test_expand_steps_to_tokens() -> None:
    adv_BS = _t(1.0, 2.0).reshape(1, 2)
    step_index_BT = torch.tensor([[0, 0, -1, 1, -1]])
    mask_BT = torch.tensor([[1, 1, 0, 1, 0]])
    _close(expand_steps_to_tokens(adv_BS, step_index_BT, mask_BT), [[1.0, 1.0, 0.0, 2.0, 0.0]])


def test_mismatched_shapes_raise() -> None:
    with pytest.raises(ValueError):
        grpo_advantages(_t(1.0, 2.0), torch.tensor([0]))
