"""Hand-computed fixtures for trajmesh.learner.metrics (survey §11.3)."""

from __future__ import annotations

import math

import pytest
import torch

from trajmesh.contract import Trajectory
from trajmesh.learner.metrics import (
    ENTROPY_BY_ACTION_TYPE_NAMES,
    STEP_METRIC_NAMES,
    effective_sample_size,
    entropy_by_action_type,
    entropy_by_advantage_sign,
    entropy_from_logits,
    kl_estimates,
    lag_histogram,
    step_metrics,
    weight_fractions,
    weight_quantiles,
)
from trajmesh.learner.objective import ObjectiveConfig, behavior_weight, decoupled_ppo_loss
from trajmesh.learner.step import build_batch
from trajmesh.v1 import trajectory_pb2

F64 = torch.float64


def test_kl_estimators_zero_when_policies_equal() -> None:
    logp_BT = -torch.rand(3, 5, dtype=F64)
    kl = kl_estimates(logp_BT, logp_BT.clone(), torch.ones(3, 5))
    assert kl == {"k1": 0.0, "k2": 0.0, "k3": 0.0}


def test_kl_estimators_hand_values() -> None:
    # one eligible token with x = log pi - log beh = ln 2 (second token is padding garbage):
    # k1 = -ln2 = -0.693147 ; k2 = (ln2)^2/2 = 0.240227 ; k3 = (2 - 1) - ln2 = 0.306853
    logp_BT = torch.tensor([[math.log(2.0), math.nan]], dtype=F64)
    beh_BT = torch.tensor([[0.0, -math.inf]], dtype=F64)
    kl = kl_estimates(logp_BT, beh_BT, torch.tensor([[1, 0]]))
    ln2 = math.log(2.0)
    assert kl["k1"] == pytest.approx(-ln2)
    assert kl["k2"] == pytest.approx(ln2 * ln2 / 2)
    assert kl["k3"] == pytest.approx(1 - ln2)


def test_effective_sample_size_hand_values() -> None:
    # w = [1,1,1,1]: (4)^2 / 4 = 4, fraction 1
    assert effective_sample_size(torch.ones(1, 4), torch.ones(1, 4)) == (4.0, 1.0)
    # w = [2,0,0,0]: (2)^2 / 4 = 1, fraction 1/4
    assert effective_sample_size(torch.tensor([[2.0, 0.0, 0.0, 0.0]]), torch.ones(1, 4)) == (1.0, 0.25)
    # w = [1,2,3] (+ a masked 100): 36 / 14 = 2.571429, fraction 6/7
    ess, frac = effective_sample_size(torch.tensor([[1.0, 2.0, 3.0, 100.0]]), torch.tensor([[1, 1, 1, 0]]))
    assert ess == pytest.approx(36 / 14) and frac == pytest.approx(36 / 14 / 3)
    assert effective_sample_size(torch.ones(1, 2), torch.zeros(1, 2)) == (0.0, 0.0)


def test_weight_quantiles_hand_values() -> None:
    # sorted [1..5], linear interpolation at (n-1)q: p50 -> idx 2 = 3 ; p90 -> 3.6 = 4.6 ; p99 -> 3.96 = 4.96
    w_BT = torch.tensor([[5.0, 1.0, 3.0], [2.0, 4.0, 999.0]])
    mask_BT = torch.tensor([[1, 1, 1], [1, 1, 0]])
    q = weight_quantiles(w_BT, mask_BT)
    assert q == pytest.approx({"p50": 3.0, "p90": 4.6, "p99": 4.96, "max": 5.0})


def test_weight_fractions() -> None:
    # w_raw [0.3, 1, 3] (+ padding): above the TIS cap 2 -> 1/3 ; MIS [0.5,2] drops 0.3 and 3 -> 2/3
    prox_BT = torch.zeros(1, 4, dtype=F64)
    beh_BT = torch.tensor([[-math.log(0.3), 0.0, -math.log(3.0), 0.0]], dtype=F64)
    mask_BT = torch.tensor([[1, 1, 1, 0]])
    cfg = ObjectiveConfig(behavior_correction="mis")
    _, w_raw, kept = behavior_weight(prox_BT, beh_BT, mask_BT, cfg)
    assert weight_fractions(w_raw, kept, mask_BT, cfg) == pytest.approx({"truncated": 1 / 3, "masked": 2 / 3})


def test_entropy_from_logits_hand_values() -> None:
    # uniform over 4 -> ln 4 ; logits [0,0,ln2] -> p [0.25,0.25,0.5] -> H = 0.5 ln4 + 0.5 ln2 = 1.039721
    uniform = entropy_from_logits(torch.zeros(1, 1, 4, dtype=F64))
    assert uniform.item() == pytest.approx(math.log(4))
    skew = entropy_from_logits(torch.tensor([[[0.0, 0.0, math.log(2.0)]]], dtype=F64))
    assert skew.item() == pytest.approx(0.5 * math.log(4) + 0.5 * math.log(2))
    assert entropy_from_logits(torch.randn(2, 3, 5)).shape == (2, 3)


def test_entropy_by_advantage_sign() -> None:
    # eligible: (H=1, A>0), (H=3, A>0), (H=2, A<0), (H=5, A=0); masked (H=100) ignored
    ent_BT = torch.tensor([[1.0, 3.0, 100.0], [2.0, 5.0, 100.0]])
    adv_BT = torch.tensor([[1.0, 0.5, 1.0], [-1.0, 0.0, -1.0]])
    mask_BT = torch.tensor([[1, 1, 0], [1, 1, 0]])
    out = entropy_by_advantage_sign(ent_BT, adv_BT, mask_BT)
    assert out == pytest.approx({"all": 11 / 4, "positive": 2.0, "negative": 2.0, "zero": 5.0})


def _mixed_action_batch() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Two trajectories with PROMPT / TEXT / TOOL_CALL / OBSERVATION / CODE spans (via build_batch)
    and hand-set entropies: (entropy_BT, action_type_BT, mask_BT). Every token that must not count
    (prompt, observation, padding) has entropy 100."""
    a = Trajectory.new(trajectory_id="a")
    a.append_prompt([1, 2])
    a.append_sampled([3, 4], [-1.0, -1.0], 0)                                   # TEXT
    a.append_sampled([5], [-1.0], 0, action_type=trajectory_pb2.TOOL_CALL)
    a.append_observation([6, 7])
    a.append_sampled([8, 9, 10], [-1.0] * 3, 0, action_type=trajectory_pb2.CODE)
    b = Trajectory.new(trajectory_id="b")
    b.append_prompt([1])
    b.append_sampled([3, 3, 3], [-1.0] * 3, 0)                                  # TEXT
    b.append_observation([6])
    b.append_sampled([5, 5], [-1.0] * 2, 0, action_type=trajectory_pb2.TOOL_CALL)
    batch = build_batch([a, b], 0)  # b: 7 tokens + 3 padding
    X = 100.0
    entropy_BT = torch.tensor([
        # P  P  TEXT    TOOL O  O  CODE
        [X, X, 1.0, 3.0, 2.0, X, X, 4.0, 5.0, 9.0],
        # P  TEXT           O  TOOL      pad
        [X, 2.0, 2.0, 5.0, X, 6.0, 7.0, X, X, X],
    ], dtype=F64)
    return entropy_BT, batch.action_type_BT, batch.mask_BT


def test_entropy_by_action_type_hand_values() -> None:
    # TEXT: 1,3 | 2,2,5 -> 13/5 ; TOOL_CALL: 2 | 6,7 -> 15/3 = 5 ; CODE: 4,5,9 -> 18/3 = 6
    # prompt, observation and padding tokens (entropy 100) count in no type.
    entropy_BT, action_type_BT, mask_BT = _mixed_action_batch()
    out = entropy_by_action_type(entropy_BT, action_type_BT, mask_BT)
    assert out == {"TEXT": 13 / 5, "TOOL_CALL": 5.0, "CODE": 6.0}
    # the overall entropy is over the same 11 action tokens: (13 + 15 + 18) / 11
    assert entropy_by_advantage_sign(entropy_BT, torch.ones_like(entropy_BT), mask_BT)["all"] == 46 / 11


def test_entropy_by_action_type_empty_types_are_zero_and_uncovered_tokens_count_in_none() -> None:
    text, unspecified = trajectory_pb2.TEXT, trajectory_pb2.ACTION_TYPE_UNSPECIFIED
    entropy_BT = torch.tensor([[1.0, 3.0, 7.0, 100.0]], dtype=F64)
    # token 2 has mask 1 but no span covers it (type 0): not in TEXT, still in the overall mean
    action_type_BT = torch.tensor([[text, text, unspecified, text]])
    mask_BT = torch.tensor([[1, 1, 1, 0]])
    out = entropy_by_action_type(entropy_BT, action_type_BT, mask_BT)
    assert out == {"TEXT": 2.0, "TOOL_CALL": 0.0, "CODE": 0.0}
    assert entropy_by_advantage_sign(entropy_BT, torch.ones_like(entropy_BT), mask_BT)["all"] == 11 / 3
    assert entropy_by_action_type(entropy_BT, action_type_BT, torch.zeros(1, 4)) == {
        "TEXT": 0.0, "TOOL_CALL": 0.0, "CODE": 0.0}


def test_step_metrics_report_entropy_by_action_type() -> None:
    entropy_BT, action_type_BT, mask_BT = _mixed_action_batch()
    zeros_BT = torch.zeros_like(entropy_BT)
    cfg = ObjectiveConfig()
    _, w_raw, kept = behavior_weight(zeros_BT, zeros_BT, mask_BT, cfg)
    _, stats = decoupled_ppo_loss(zeros_BT, zeros_BT, zeros_BT, zeros_BT, mask_BT, cfg)

    def metrics(entropy: torch.Tensor | None, action_type: torch.Tensor | None) -> dict[str, float]:
        return step_metrics(logp_BT=zeros_BT, prox_logp_BT=zeros_BT, behavior_logp_BT=zeros_BT, adv_BT=zeros_BT,
                            mask_BT=mask_BT, w_raw_BT=w_raw, kept_mask_BT=kept, loss_stats=stats, cfg=cfg,
                            entropy_BT=entropy, action_type_BT=action_type)

    p = "trajmesh_learner_"
    assert ENTROPY_BY_ACTION_TYPE_NAMES == {"TEXT": p + "entropy_text_action_nats",
                                            "TOOL_CALL": p + "entropy_tool_call_action_nats",
                                            "CODE": p + "entropy_code_action_nats"}
    out = metrics(entropy_BT, action_type_BT)
    assert out[p + "entropy_text_action_nats"] == 13 / 5
    assert out[p + "entropy_tool_call_action_nats"] == 5.0
    assert out[p + "entropy_code_action_nats"] == 6.0
    assert out[p + "entropy_nats"] == 46 / 11
    # without per-token action types (or without entropy) the series are still there, at 0
    for out in (metrics(entropy_BT, None), metrics(None, action_type_BT)):
        assert [out[n] for n in ENTROPY_BY_ACTION_TYPE_NAMES.values()] == [0.0, 0.0, 0.0]


def test_lag_histogram_hand_values() -> None:
    # current 10; eligible versions 10,9,9 / 7,2,10 -> lags 0,1,1,3,8,0 ; max_lag 4
    # buckets 0..4 = [2,2,0,1,0], over 4 = 1 ; masked (-1) ignored
    versions_BT = torch.tensor([[10, 9, 9, -1], [7, 2, 10, -1]])
    mask_BT = torch.tensor([[1, 1, 1, 0], [1, 1, 1, 0]])
    assert lag_histogram(10, versions_BT, mask_BT, max_lag=4).tolist() == [2, 2, 0, 1, 0, 1]
    with pytest.raises(ValueError):
        lag_histogram(8, versions_BT, mask_BT, max_lag=4)


GOLDEN_NAMES = [
    "trajmesh_learner_loss", "trajmesh_learner_tokens", "trajmesh_learner_kl_k1", "trajmesh_learner_kl_k2",
    "trajmesh_learner_kl_k3", "trajmesh_learner_logprob_mismatch_k3",
    "trajmesh_learner_logprob_mismatch_abs_mean", "trajmesh_learner_clip_low_ratio",
    "trajmesh_learner_clip_high_ratio", "trajmesh_learner_dual_clip_ratio",
    "trajmesh_learner_ratio_outside_clip_ratio", "trajmesh_learner_policy_ratio_mean",
    "trajmesh_learner_effective_sample_size_tokens", "trajmesh_learner_effective_sample_size_ratio",
    "trajmesh_learner_importance_weight_p50", "trajmesh_learner_importance_weight_p90",
    "trajmesh_learner_importance_weight_p99", "trajmesh_learner_importance_weight_max",
    "trajmesh_learner_importance_weight_truncated_ratio", "trajmesh_learner_importance_weight_masked_ratio",
    "trajmesh_learner_entropy_nats", "trajmesh_learner_entropy_positive_advantage_nats",
    "trajmesh_learner_entropy_negative_advantage_nats", "trajmesh_learner_entropy_zero_advantage_nats",
    "trajmesh_learner_advantage_mean", "trajmesh_learner_advantage_abs_mean",
    "trajmesh_learner_entropy_text_action_nats", "trajmesh_learner_entropy_tool_call_action_nats",
    "trajmesh_learner_entropy_code_action_nats",
]


def test_step_metrics_stable_names_and_values() -> None:
    # 4 eligible tokens; prox = beh = 0 except token 3 with w_raw = 4; logp = ln r.
    ln = math.log
    logp_BT = torch.tensor([[ln(1.5), ln(0.5), 0.0], [0.0, 0.0, 0.0]], dtype=F64)
    prox_BT = torch.zeros(2, 3, dtype=F64)
    beh_BT = torch.tensor([[0.0, 0.0, 0.0], [0.0, -ln(4.0), 0.0]], dtype=F64)
    adv_BT = torch.tensor([[1.0, -1.0, 0.0], [1.0, 2.0, 0.0]], dtype=F64)
    mask_BT = torch.tensor([[1, 1, 0], [1, 1, 0]], dtype=F64)
    cfg = ObjectiveConfig()
    _, w_raw, kept = behavior_weight(prox_BT, beh_BT, mask_BT, cfg)
    _, stats = decoupled_ppo_loss(logp_BT, prox_BT, beh_BT, adv_BT, mask_BT, cfg)
    out = step_metrics(
        logp_BT=logp_BT, prox_logp_BT=prox_BT, behavior_logp_BT=beh_BT, adv_BT=adv_BT, mask_BT=mask_BT,
        w_raw_BT=w_raw, kept_mask_BT=kept, loss_stats=stats, cfg=cfg,
        entropy_BT=torch.ones(2, 3), current_version=3, versions_BT=torch.tensor([[3, 2, -1], [1, 3, -1]]),
        max_lag=2,
    )
    lag_names = [f"trajmesh_learner_policy_lag_{k}_tokens" for k in range(3)] + [
        "trajmesh_learner_policy_lag_over_2_tokens"]
    assert list(STEP_METRIC_NAMES) == GOLDEN_NAMES
    assert list(out) == GOLDEN_NAMES + lag_names
    assert all(isinstance(v, float) and math.isfinite(v) for v in out.values())
    p = "trajmesh_learner_"
    # w_raw = [1,1,1,4]: ESS = 49/19 = 2.578947, fraction /4 ; max 4 ; 1 of 4 above cap 2
    assert out[p + "effective_sample_size_tokens"] == pytest.approx(49 / 19)
    assert out[p + "effective_sample_size_ratio"] == pytest.approx(49 / 76)
    assert out[p + "importance_weight_max"] == 4.0
    assert out[p + "importance_weight_truncated_ratio"] == 0.25
    # clip: r = [1.5 (A>0 high), 0.5 (A<0 low), 1, 1] -> 1/4 each
    assert out[p + "clip_high_ratio"] == 0.25 and out[p + "clip_low_ratio"] == 0.25
    # KL(beh||cur): x = logp - beh = [ln1.5, ln0.5, 0, ln4] -> k1 = -(ln1.5+ln0.5+ln4)/4 = -ln3/4
    assert out[p + "kl_k1"] == pytest.approx(-ln(3.0) / 4)
    # mismatch |prox - beh| = [0,0,0,ln4] -> ln4/4
    assert out[p + "logprob_mismatch_abs_mean"] == pytest.approx(ln(4.0) / 4)
    # lags: 0,1,2,0 -> [2,1,1], over 0
    assert [out[n] for n in lag_names] == [2.0, 1.0, 1.0, 0.0]
    assert out[p + "entropy_nats"] == 1.0 and out[p + "tokens"] == 4.0


def test_gradcheck_entropy_from_logits() -> None:
    logits_BTV = torch.randn(2, 3, 5, dtype=F64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda z: entropy_from_logits(z).sum(), (logits_BTV,))
