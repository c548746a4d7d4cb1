"""PRIME (survey §7.4; `learner.advantage.type: prime`, learner/prm.py): an online implicit PRM.

The math against values worked out by hand in each test: the implicit token reward, the PRM's BCE on
the sequence's implicit-reward logit and its gradient's sign, the leave-one-out baselines of the
process and outcome components, and their sum. Then the learner service: the PRM learns the outcome
label of a fixed batch (its loss falls, its accuracy rises), the advantage is not RLOO's, the PRM is
checkpointed (a resumed learner continues bitwise), and the config refuses what is not built.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest
import torch
from learner_batches import two_groups_of_four
from tiny_llama import tiny_llama_dir

from trajmesh.config import load_config
from trajmesh.learner.advantages import (
    implicit_process_rewards,
    prime_advantages_BT,
    prime_process_advantages,
)
from trajmesh.learner.metrics import PRIME_METRIC_NAMES
from trajmesh.learner.objective import implicit_prm_loss
from trajmesh.learner.step import Batch

# ------------------------------------------------------------------ the math, by hand


def test_the_implicit_reward_is_beta_times_the_log_ratio_on_action_tokens_only() -> None:
    prm = torch.tensor([[-1.0, -2.0, -0.5, 0.0]])
    ref = torch.tensor([[-1.25, -1.0, -0.5, -3.0]])
    mask = torch.tensor([[0.0, 1.0, 1.0, 0.0]])
    # r = 0.5·(prm − ref) where the mask is 1: 0.5·(−2 + 1) = −0.5 and 0.5·0 = 0; 0 on the rest
    # (positions 0 and 3 have log ratios 0.25 and 3, which must not show).
    assert implicit_process_rewards(prm, ref, mask, 0.5).tolist() == [[0.0, -0.5, 0.0, 0.0]]


# Three trajectories, β = 0.5, two action tokens and one padding position each (the padding's log
# ratio is 5, which must not count). Log ratios on the action tokens:
#   A: (−1 + 2) + (−1 + 2) = 2  → ℓ = 1, label 1
#   B: (−1 + 2) + (−3 + 2) = 0  → ℓ = 0, label 0
#   C: (−3 + 2) + (−3 + 2) = −2 → ℓ = −1, label 1
PRM = [[-1.0, -1.0, 0.0], [-1.0, -3.0, 0.0], [-3.0, -3.0, 0.0]]
REF = [[-2.0, -2.0, -5.0]] * 3
MASK = [[1.0, 1.0, 0.0]] * 3
LABEL = [1.0, 0.0, 1.0]


def _sigmoid(x: float) -> float:
    return 1.0 / (1.0 + math.exp(-x))


def test_the_prm_loss_is_bce_on_the_sequence_logit_and_its_gradient_follows_the_label() -> None:
    prm = torch.tensor(PRM, dtype=torch.float64, requires_grad=True)
    loss, stats = implicit_prm_loss(prm, torch.tensor(REF, dtype=torch.float64), torch.tensor(MASK),
                                    torch.tensor(LABEL), beta=0.5)
    # BCE(ℓ, 1) = log(1 + e^−ℓ), BCE(ℓ, 0) = log(1 + e^ℓ); the mean over the three trajectories.
    expected = (math.log(1 + math.exp(-1.0)) + math.log(2.0) + math.log(1 + math.exp(1.0))) / 3
    assert float(loss.detach()) == pytest.approx(expected, rel=1e-12)
    # Prediction ℓ > 0: A right (1 > 0, label 1), B right (0 is not > 0, label 0), C wrong.
    assert float(stats["prm_correct"]) == 2.0 and float(stats["prm_trajectories"]) == 3.0
    loss.backward()
    assert prm.grad is not None
    # ∂L/∂log πφ(y_t) = β·(σ(ℓ) − y)/J on every action token of the trajectory, 0 on padding.
    grads = [0.5 * (_sigmoid(1.0) - 1) / 3, 0.5 * (_sigmoid(0.0) - 0) / 3, 0.5 * (_sigmoid(-1.0) - 1) / 3]
    for row, g in enumerate(grads):
        assert prm.grad[row].tolist() == pytest.approx([g, g, 0.0], rel=1e-12)
    # Descent raises a correct trajectory's likelihood ratio and lowers an incorrect one's.
    assert prm.grad[0, 0] < 0 and prm.grad[1, 0] > 0 and prm.grad[2, 0] < 0


def test_the_prm_loss_sums_a_trajectorys_rows_and_splits_over_micro_batches() -> None:
    ref, mask, label = torch.tensor(REF), torch.tensor(MASK), torch.tensor(LABEL)
    whole, _ = implicit_prm_loss(torch.tensor(PRM), ref, mask, label, beta=0.5)
    # A as two rows of one token each (log ratios 1 and 1): the same logit ℓ = 1, the same loss.
    rows = torch.tensor([[-1.0, 0.0, 0.0], [-1.0, 0.0, 0.0], *PRM[1:]])
    seg_mask = torch.tensor([[1.0, 0.0, 0.0], [1.0, 0.0, 0.0], *MASK[1:]])
    seg, _ = implicit_prm_loss(rows, torch.tensor([REF[0]] * 4), seg_mask, label, beta=0.5,
                               trajectory_index_B=torch.tensor([0, 0, 1, 2]))
    assert float(seg) == pytest.approx(float(whole), rel=1e-12)
    # Micro-batches of whole trajectories with the batch's count J = 3 add up to the batch's loss.
    parts = [implicit_prm_loss(torch.tensor(PRM[i:i + 1]), ref[i:i + 1], mask[i:i + 1], label[i:i + 1], beta=0.5,
                               global_trajectory_count=3.0)[0] for i in range(3)]
    assert float(sum(parts)) == pytest.approx(float(whole), rel=1e-6)


# Token rewards of one group of three trajectories and one trajectory alone in its group. Row 1
# has an observation token (mask 0, reward 5 there must not count). Means over action tokens:
#   t0: (0.2 + 0.4)/2 = 0.3;  t1: (0.9 + 0.3 + 0.6)/3 = 0.6;  t2: 0.0
# Leave-one-out baselines: b0 = (0.6 + 0.0)/2 = 0.3, b1 = (0.3 + 0.0)/2 = 0.15, b2 = (0.3 + 0.6)/2 = 0.45.
REWARD_BT = [[0.2, 0.4, 0.0, 0.0], [0.9, 5.0, 0.3, 0.6], [0.0, 0.0, 0.0, 0.0], [0.7, 0.0, 0.0, 0.0]]
MASK_BT = [[1.0, 1.0, 0.0, 0.0], [1.0, 0.0, 1.0, 1.0], [1.0, 0.0, 0.0, 0.0], [1.0, 0.0, 0.0, 0.0]]
GROUP_B = [7, 7, 7, 9]


def test_the_process_component_has_its_own_leave_one_out_baseline() -> None:
    adv = prime_process_advantages(torch.tensor(REWARD_BT), torch.tensor(MASK_BT), torch.tensor(GROUP_B), gamma=1.0)
    # γ = 1, deltas r − b: t0 [−0.1, 0.1]; t1 [0.75, ·, 0.15, 0.45]; t2 [−0.45]; returns summed
    # from the end over action tokens; the group of one (row 3) gets 0.
    expected = [[0.0, 0.1, 0.0, 0.0], [1.35, 0.0, 0.6, 0.45], [-0.45, 0.0, 0.0, 0.0], [0.0, 0.0, 0.0, 0.0]]
    for got, want in zip(adv.tolist(), expected, strict=True):
        assert got == pytest.approx(want, abs=1e-6)
    # γ = 0.5: t0: 0.1, −0.1 + 0.05 = −0.05; t1: 0.45, 0.15 + 0.225 = 0.375, and the observation is
    # no time step: 0.75 + 0.5·0.375 = 0.9375.
    adv = prime_process_advantages(torch.tensor(REWARD_BT), torch.tensor(MASK_BT), torch.tensor(GROUP_B), gamma=0.5)
    expected = [[-0.05, 0.1, 0.0, 0.0], [0.9375, 0.0, 0.375, 0.45], [-0.45, 0.0, 0.0, 0.0], [0.0] * 4]
    for got, want in zip(adv.tolist(), expected, strict=True):
        assert got == pytest.approx(want, abs=1e-6)


def test_a_segmented_trajectorys_mean_and_return_run_over_its_rows() -> None:
    """Trajectory 0 is two rows, [0.2, 0.4] then [0.0, 0.8] (mean 0.35 over all four tokens);
    trajectory 1 is [0.1, 0.3] (mean 0.2). Baselines: b0 = 0.2, b1 = 0.35."""
    reward = torch.tensor([[0.2, 0.4], [0.0, 0.8], [0.1, 0.3]])
    mask = torch.ones(3, 2)
    rows = torch.tensor([0, 0, 1])
    adv = prime_process_advantages(reward, mask, torch.tensor([0, 0, 0]), gamma=1.0, trajectory_index_B=rows)
    # Deltas: row 0 [0.0, 0.2], row 1 [−0.2, 0.6], row 2 [−0.25, −0.05]. Row 1's returns [0.4, 0.6];
    # row 0 continues into row 1: [0.0 + 0.2 + 0.4, 0.2 + 0.4] = [0.6, 0.6].
    assert adv.tolist() == [pytest.approx([0.6, 0.6]), pytest.approx([0.4, 0.6]), pytest.approx([-0.3, -0.05])]
    adv = prime_process_advantages(reward, mask, torch.tensor([0, 0, 0]), gamma=0.5, trajectory_index_B=rows)
    # γ = 0.5: row 1 [−0.2 + 0.3, 0.6] = [0.1, 0.6]; row 0 [0.5·0.25, 0.2 + 0.5·0.1] = [0.125, 0.25].
    assert adv[:2].tolist() == [pytest.approx([0.125, 0.25]), pytest.approx([0.1, 0.6])]


def _batch(reward_B: list[float], mask_BT: list[list[float]], group_B: list[int]) -> Batch:
    mask = torch.tensor(mask_BT)
    B, T = mask.shape
    return Batch(torch.ones(B, T, dtype=torch.long), torch.ones(B, T, dtype=torch.long), mask, torch.zeros(B, T),
                 torch.zeros(B, T, dtype=torch.long), torch.tensor(reward_B), torch.tensor(group_B),
                 [f"t{i}" for i in range(B)], torch.zeros(B, T, dtype=torch.long))


def test_the_prime_advantage_adds_the_outcome_and_process_components() -> None:
    """Outcome rewards [1, 0, 0] in the group of three: RLOO R_i − mean_{j≠i} R_j = [1, −0.5, −0.5];
    the lone trajectory 0. Added to the process component of the γ = 1 case above."""
    batch = _batch([1.0, 0.0, 0.0, 1.0], MASK_BT, GROUP_B)
    adv = prime_advantages_BT(batch, torch.tensor(REWARD_BT), gamma=1.0)
    expected = [[1.0, 1.1, 0.0, 0.0], [0.85, 0.0, 0.1, -0.05], [-0.95, 0.0, 0.0, 0.0], [0.0] * 4]
    for got, want in zip(adv.tolist(), expected, strict=True):
        assert got == pytest.approx(want, abs=1e-6)


# ------------------------------------------------------------------ the learner service


def _service(tmp_path: Path, model: str, run: str, **over: Any) -> Any:
    from trajmesh.services.learner import LearnerService

    cfg = load_config(None, {"run_dir": str(tmp_path / run), "model.path": model, "learner.engine.type": "torch",
                             "learner.consistency_probe_trajectories": 0, "learner.warmup_steps": 0,
                             "tasks.group_size": 4, "learner.advantage.type": "prime",
                             "learner.prime.lr": 3e-2, "learner.prime.beta": 0.5, **over})
    svc = LearnerService(cfg)
    svc._build_trainer()
    return svc


def _steps(svc: Any, first: int, last: int) -> list[dict[str, Any]]:
    return [svc._train_step(two_groups_of_four(s), eta=100, temperature=1.0).metrics for s in range(first, last)]


def test_the_learner_trains_the_prm_on_the_outcome_label(tmp_path: Path) -> None:
    svc = _service(tmp_path, tiny_llama_dir(tmp_path), "run")
    metrics = _steps(svc, 0, 8)
    loss = [m["trajmesh_learner_prm_loss"] for m in metrics]
    acc = [m["trajmesh_learner_prm_accuracy_ratio"] for m in metrics]
    # At the start πφ = π_ref: every logit is 0, the loss log 2, and "ℓ > 0" predicts 0 for all:
    # right on the four incorrect trajectories of eight.
    assert loss[0] == pytest.approx(math.log(2.0), rel=1e-6) and acc[0] == 0.5
    assert loss[-1] < 0.5 * loss[0] and acc[-1] == 1.0, (loss, acc)
    for m in metrics:
        assert set(PRIME_METRIC_NAMES) <= set(m)  # what the service exports from its start
        assert m["trajmesh_learner_prm_step_seconds"] > 0 and m["trajmesh_learner_policy_update_seconds"] > 0
        assert m["trajmesh_learner_prm_positive_label_ratio"] == 0.5
    # The advantage carries the process component, so it is not RLOO's (update "before": even the
    # first step's token rewards come from a PRM that has taken a step).
    assert all(m["advantage_minus_rloo_max_abs"] > 1e-4 for m in metrics), metrics
    # The PRM's weights moved; the policy's start, its reference, did not.
    prm = dict(svc.prm.engine.model.named_parameters())
    ref = dict(svc.prm.reference._inner.named_parameters())
    assert any(not torch.equal(prm[k], ref[k]) for k in ref)


def test_a_resumed_learner_continues_the_prm_bitwise(tmp_path: Path) -> None:
    model = tiny_llama_dir(tmp_path)
    a = _service(tmp_path, model, "a")
    whole = _steps(a, 0, 4)
    b = _service(tmp_path, model, "b")
    _steps(b, 0, 2)
    b._checkpoint()
    assert (b.ckpt_dir / "latest" / "prm").is_dir()
    c = _service(tmp_path, model, "b")
    c._load_checkpoint()
    resumed = _steps(c, 2, 4)
    keys = [k for k in whole[0] if k.startswith("trajmesh_learner_prm_") and not k.endswith("_seconds")]
    for x, y in zip(whole[2:], resumed, strict=True):
        assert {k: x[k] for k in keys} == {k: y[k] for k in keys}
    pa, pc = a.prm.engine.full_state_dict(), c.prm.engine.full_state_dict()
    assert all(torch.equal(pa[k], pc[k]) for k in pa)


@pytest.mark.parametrize("over,message", [
    ({"tasks.group_size": 1}, "group_size >= 2"),
    ({"learner.engine.type": "deepspeed", "learner.engine.zero_stage": 3}, "ZeRO-3"),
])
def test_the_config_refuses_what_prime_cannot_run(over: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        load_config(None, {"learner.advantage.type": "prime", "tasks.group_size": 4, **over})


def test_the_prm_shares_a_reference_that_never_resets(tmp_path: Path) -> None:
    """`learner.reference` on without resets holds the same start: the PRM uses it rather than a
    third copy; with resets it keeps its own (the learner's moves with the policy)."""
    model = tiny_llama_dir(tmp_path)
    shared = _service(tmp_path, model, "shared", **{"learner.reference.enabled": True})
    assert shared.prm.reference is shared.reference
    metrics = _steps(shared, 0, 2)
    assert metrics[0]["trajmesh_learner_prm_loss"] == pytest.approx(math.log(2.0), rel=1e-6)
    own = _service(tmp_path, model, "own", **{"learner.reference.enabled": True, "learner.reference.reset_every": 2})
    assert own.prm.reference is not own.reference
