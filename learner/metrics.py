"""Per-step learner metrics that reveal mechanism (docs/DESIGN.md §4, survey §11.3).

Every function reduces over the loss-masked (eligible) tokens only. ``step_metrics`` returns one
flat ``dict[str, float]`` with the stable names in ``STEP_METRIC_NAMES`` (Prometheus style,
``trajmesh_learner_<name>_<unit>``, ratios in 0–1) plus one ``..._policy_lag_<k>_tokens`` entry per
lag bucket.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import Tensor

from trajmesh.contract import SAMPLED_ACTION_TYPES, ActionType
from trajmesh.learner.objective import ObjectiveConfig

__all__ = [
    "ENTROPY_ACTION_TYPES",
    "ENTROPY_BY_ACTION_TYPE_NAMES",
    "DISTILL_METRIC_NAMES",
    "PRIME_METRIC_NAMES",
    "REFERENCE_METRIC_NAMES",
    "STEP_METRIC_NAMES",
    "effective_sample_size",
    "entropy_by_action_type",
    "entropy_by_advantage_sign",
    "entropy_from_logits",
    "kl_estimates",
    "lag_histogram",
    "step_metrics",
    "weight_fractions",
    "weight_quantiles",
]

_P = "trajmesh_learner_"


def _masked_mean(x_BT: Tensor, on_BT: Tensor) -> float:
    n = int(on_BT.sum())
    if n == 0:
        return 0.0
    return float(torch.where(on_BT, x_BT, torch.zeros((), dtype=x_BT.dtype)).sum()) / n


def kl_estimates(logp_BT: Tensor, behavior_logp_BT: Tensor, mask_BT: Tensor) -> dict[str, float]:
    """Schulman's estimators of KL(π_beh ‖ π_θ) from tokens sampled by π_beh, with
    ``x = log π_θ − log π_beh`` (log-ratio clamped to ±20):

        k1 = −x            (unbiased, can be negative)
        k2 = x² / 2        (biased, low variance)
        k3 = (eˣ − 1) − x  (unbiased, ≥ 0, low variance)

    Averaged over eligible tokens; all three are 0 when the policies agree.
    """
    on_BT = mask_BT > 0
    with torch.no_grad():
        x_BT = torch.where(on_BT, logp_BT - behavior_logp_BT, torch.zeros((), dtype=logp_BT.dtype))
        x_BT = x_BT.clamp(-20.0, 20.0)
        return {
            "k1": _masked_mean(-x_BT, on_BT),
            "k2": _masked_mean(0.5 * x_BT * x_BT, on_BT),
            "k3": _masked_mean(torch.expm1(x_BT) - x_BT, on_BT),
        }


def effective_sample_size(w_BT: Tensor, mask_BT: Tensor) -> tuple[float, float]:
    """``ESS = (Σw)² / Σw²`` over eligible tokens → ``(ess_count, ess_count / N)``; (0, 0) if
    there are no eligible tokens or all weights are 0."""
    on_BT = mask_BT > 0
    w = w_BT.detach()[on_BT].to(torch.float64)
    n = w.numel()
    sq = float((w * w).sum())
    if n == 0 or sq == 0.0:
        return 0.0, 0.0
    ess = float(w.sum()) ** 2 / sq
    return ess, ess / n


def weight_quantiles(w_BT: Tensor, mask_BT: Tensor) -> dict[str, float]:
    """p50, p90, p99 (linear interpolation) and max of the weights over eligible tokens."""
    w = w_BT.detach()[mask_BT > 0].to(torch.float64)
    if w.numel() == 0:
        return {"p50": 0.0, "p90": 0.0, "p99": 0.0, "max": 0.0}
    q = torch.quantile(w, torch.tensor([0.5, 0.9, 0.99], dtype=torch.float64))
    return {"p50": float(q[0]), "p90": float(q[1]), "p99": float(q[2]), "max": float(w.max())}


def weight_fractions(
    w_raw_BT: Tensor, kept_mask_BT: Tensor, mask_BT: Tensor, cfg: ObjectiveConfig
) -> dict[str, float]:
    """Fractions of eligible tokens whose raw weight exceeds the TIS cap (``truncated``, reported
    whatever the correction mode) and that the loss dropped (``masked``, MIS)."""
    on_BT = mask_BT > 0
    n = int(on_BT.sum())
    if n == 0:
        return {"truncated": 0.0, "masked": 0.0}
    return {
        "truncated": int((on_BT & (w_raw_BT > cfg.tis_cap)).sum()) / n,
        "masked": int((on_BT & ~(kept_mask_BT > 0)).sum()) / n,
    }


def entropy_from_logits(logits_BTV: Tensor) -> Tensor:
    """Entropy (nats) of the softmax over the last dim: ``logsumexp(z) − Σ softmax(z)·z`` → _BT.

    Differentiable (the MAGIC entropy term needs the gradient); detach it for metrics."""
    p_BTV = torch.softmax(logits_BTV, dim=-1)
    return torch.logsumexp(logits_BTV, dim=-1) - (p_BTV * logits_BTV).sum(-1)


def entropy_by_advantage_sign(entropy_BT: Tensor, adv_BT: Tensor, mask_BT: Tensor) -> dict[str, float]:
    """Mean token entropy overall and over tokens with Â > 0, Â < 0, Â = 0 (0 when empty)."""
    on_BT = mask_BT > 0
    return {
        "all": _masked_mean(entropy_BT, on_BT),
        "positive": _masked_mean(entropy_BT, on_BT & (adv_BT > 0)),
        "negative": _masked_mean(entropy_BT, on_BT & (adv_BT < 0)),
        "zero": _masked_mean(entropy_BT, on_BT & (adv_BT == 0)),
    }


# The sampled (loss-mask 1) action types, by enum value: TEXT, TOOL_CALL, CODE.
ENTROPY_ACTION_TYPES: tuple[str, ...] = tuple(ActionType.Name(t) for t in sorted(SAMPLED_ACTION_TYPES))


def entropy_by_action_type(entropy_BT: Tensor, action_type_BT: Tensor, mask_BT: Tensor) -> dict[str, float]:
    """Mean token entropy over the eligible tokens of each sampled action type, keyed by the enum
    name (``ENTROPY_ACTION_TYPES``: "TEXT", "TOOL_CALL", "CODE"); every key is always present and
    is 0 when the batch has no such token (as ``entropy_by_advantage_sign`` treats empty sets).

    ``action_type_BT`` holds the ``ActionType`` value of the span covering each token (``Batch``);
    eligible tokens that no sampled-type span covers count in no type (they still count in the
    overall entropy).
    """
    on_BT = mask_BT > 0
    return {
        name: _masked_mean(entropy_BT, on_BT & (action_type_BT == ActionType.Value(name)))
        for name in ENTROPY_ACTION_TYPES
    }


def lag_histogram(current_version: int, versions_BT: Tensor, mask_BT: Tensor, max_lag: int) -> Tensor:
    """Token counts by policy lag ``current_version − behavior_version`` over eligible tokens.

    Returns int64 counts of length ``max_lag + 2``: buckets 0..max_lag, and a last bucket for
    lag > max_lag (tokens the consume-time bound must quarantine, docs/DESIGN.md §3). A version newer than
    the learner violates the contract and raises ``ValueError``.
    """
    on_BT = mask_BT > 0
    lag = current_version - versions_BT[on_BT].long()
    if lag.numel() and int(lag.min()) < 0:
        raise ValueError(f"behavior version newer than learner version {current_version}")
    return torch.bincount(lag.clamp(max=max_lag + 1), minlength=max_lag + 2)


# Step-metric name of each entropy_by_action_type key: "TEXT" -> trajmesh_learner_entropy_text_action_nats.
ENTROPY_BY_ACTION_TYPE_NAMES: dict[str, str] = {
    name: f"{_P}entropy_{name.lower()}_action_nats" for name in ENTROPY_ACTION_TYPES
}

REFERENCE_METRIC_NAMES: tuple[str, ...] = tuple(
    _P + name for name in ("reference_kl_k1", "reference_kl_k2", "reference_kl_k3", "reference_kl_loss",
                           "reference_version"))
"""With `learner.reference.enabled`: KL(π_θ ‖ π_ref) by k1/k2/k3 at the step's first-epoch forwards,
the KL term's value (coefficient included), and the policy version the reference holds."""

PRIME_METRIC_NAMES: tuple[str, ...] = tuple(
    _P + name for name in ("prm_loss", "prm_accuracy_ratio", "prm_positive_label_ratio", "prm_grad_norm",
                           "prm_token_reward_mean", "prm_step_seconds", "policy_update_seconds"))
"""With `learner.advantage.type: prime` (learner/prm.py): the implicit PRM's BCE loss and its accuracy
on the outcome label (both on the batch before the PRM's update), the batch's rate of correct
trajectories, the PRM update's grad norm, the mean token reward r_t, and the seconds of the PRM step
and of the policy's update."""

DISTILL_METRIC_NAMES: tuple[str, ...] = (_P + "distill_reverse_kl_nats", _P + "distill_tokens")
"""With `distill.teachers`: the student's reverse KL to its teachers, KL(π_behavior ‖ π_T), as the
mean of log π_behavior − log π_T over the step's teacher-scored action tokens, and their count
(learner/advantages.py distill_advantages_BT)."""

STEP_METRIC_NAMES: tuple[str, ...] = tuple(
    _P + name
    for name in (
        "loss",
        "tokens",
        "kl_k1",
        "kl_k2",
        "kl_k3",
        "logprob_mismatch_k3",
        "logprob_mismatch_abs_mean",
        "clip_low_ratio",
        "clip_high_ratio",
        "dual_clip_ratio",
        "ratio_outside_clip_ratio",
        "policy_ratio_mean",
        "effective_sample_size_tokens",
        "effective_sample_size_ratio",
        "importance_weight_p50",
        "importance_weight_p90",
        "importance_weight_p99",
        "importance_weight_max",
        "importance_weight_truncated_ratio",
        "importance_weight_masked_ratio",
        "entropy_nats",
        "entropy_positive_advantage_nats",
        "entropy_negative_advantage_nats",
        "entropy_zero_advantage_nats",
        "advantage_mean",
        "advantage_abs_mean",
    )
) + tuple(ENTROPY_BY_ACTION_TYPE_NAMES.values())


def step_metrics(
    *,
    logp_BT: Tensor,
    prox_logp_BT: Tensor,
    behavior_logp_BT: Tensor,
    adv_BT: Tensor,
    mask_BT: Tensor,
    w_raw_BT: Tensor,
    kept_mask_BT: Tensor,
    loss_stats: Mapping[str, Tensor],
    cfg: ObjectiveConfig,
    entropy_BT: Tensor | None = None,
    action_type_BT: Tensor | None = None,
    current_version: int | None = None,
    versions_BT: Tensor | None = None,
    max_lag: int = 8,
) -> dict[str, float]:
    """All per-step learner metrics as one flat dict with the stable ``STEP_METRIC_NAMES``.

    ESS and weight quantiles are of the RAW behavior weight ``π_prox/π_beh`` (before the TIS cap or
    MIS mask), which is what measures how stale/mismatched the batch is. ``kl_*`` is
    KL(π_beh ‖ π_θ); ``logprob_mismatch_*`` compares the learner's proximal recomputation with the
    rollout engine's log-probs. Entropy metrics need ``entropy_BT`` (e.g. from
    ``entropy_from_logits``) and are 0 without it; the per-action-type entropies
    (``ENTROPY_BY_ACTION_TYPE_NAMES``) also need ``action_type_BT`` (``Batch.action_type_BT``) and
    are 0 without it. Lag buckets are added when ``versions_BT`` and
    ``current_version`` are given: ``trajmesh_learner_policy_lag_<k>_tokens`` for k = 0..max_lag and
    ``..._policy_lag_over_<max_lag>_tokens``.
    """
    on_BT = mask_BT > 0
    kl = kl_estimates(logp_BT, behavior_logp_BT, mask_BT)
    mismatch = kl_estimates(prox_logp_BT, behavior_logp_BT, mask_BT)
    ess, ess_frac = effective_sample_size(w_raw_BT, mask_BT)
    q = weight_quantiles(w_raw_BT, mask_BT)
    frac = weight_fractions(w_raw_BT, kept_mask_BT, mask_BT, cfg)
    ent = (
        entropy_by_advantage_sign(entropy_BT, adv_BT, mask_BT)
        if entropy_BT is not None
        else {"all": 0.0, "positive": 0.0, "negative": 0.0, "zero": 0.0}
    )
    ent_type = (
        entropy_by_action_type(entropy_BT, action_type_BT, mask_BT)
        if entropy_BT is not None and action_type_BT is not None
        else dict.fromkeys(ENTROPY_ACTION_TYPES, 0.0)
    )
    diff_BT = (prox_logp_BT - behavior_logp_BT).detach().abs()
    adv_BT = adv_BT.detach()
    values = [
        float(loss_stats["loss"]),
        float(on_BT.sum()),
        kl["k1"],
        kl["k2"],
        kl["k3"],
        mismatch["k3"],
        _masked_mean(diff_BT, on_BT),
        float(loss_stats["clip_low_frac"]),
        float(loss_stats["clip_high_frac"]),
        float(loss_stats["dual_clip_frac"]),
        float(loss_stats["ratio_outside_frac"]),
        float(loss_stats["ratio_mean"]),
        ess,
        ess_frac,
        q["p50"],
        q["p90"],
        q["p99"],
        q["max"],
        frac["truncated"],
        frac["masked"],
        ent["all"],
        ent["positive"],
        ent["negative"],
        ent["zero"],
        _masked_mean(adv_BT, on_BT),
        _masked_mean(adv_BT.abs(), on_BT),
        *(ent_type[name] for name in ENTROPY_BY_ACTION_TYPE_NAMES),
    ]
    out = dict(zip(STEP_METRIC_NAMES, values, strict=True))
    if versions_BT is not None and current_version is not None:
        counts = lag_histogram(current_version, versions_BT, mask_BT, max_lag).tolist()
        for k in range(max_lag + 1):
            out[f"{_P}policy_lag_{k}_tokens"] = float(counts[k])
        out[f"{_P}policy_lag_over_{max_lag}_tokens"] = float(counts[max_lag + 1])
    return out


TRUST_REGION_NAMES: tuple[str, ...] = (
    f"{_P}proximal_kl_k3_nats",
    f"{_P}policy_ratio_std",
    f"{_P}policy_ratio_min",
    f"{_P}policy_ratio_max",
)


def trust_region_metrics(logp_BT: Tensor, prox_logp_BT: Tensor, mask_BT: Tensor) -> dict[str, float]:
    """How far one PPO update's weights have moved from π_prox, over eligible tokens: the spread
    of r = π_θ/π_prox (std, min, max; all 1 at the first update) and KL(π_prox ‖ π_θ) by the k3
    estimator with x = log π_θ − log π_prox. The tokens were sampled by π_beh, not π_prox, so the
    KL is the estimate on the behavior samples (exact in expectation when π_beh = π_prox)."""
    on_BT = mask_BT > 0
    names = TRUST_REGION_NAMES
    if not bool(on_BT.any()):
        return dict.fromkeys(names, 0.0)
    with torch.no_grad():
        x = (logp_BT.detach().double() - prox_logp_BT.detach().double())[on_BT].clamp(-20.0, 20.0)
        r = x.exp()
        return {names[0]: float((torch.expm1(x) - x).mean()), names[1]: float(r.std(unbiased=False)),
                names[2]: float(r.min()), names[3]: float(r.max())}
