"""Hand-computed fixtures for trajmesh.learner.metrics (survey §11.3)."""

from __future__ import annotations

import math

import pytest
import torch
from trajmesh.learner.metrics import (
    STEP_METRIC_NAMES,
    effective_sample_size,
    entropy_by_advantage_sign,
    entropy_from_logits,
    kl_estimates,
    lag_histogram,
    step_metrics,
    weight_fractions,
    weight_quantiles,
)
from trajmesh.learner.objective import ObjectiveConfig, behavior_weight, decoupled_ppo_loss

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
