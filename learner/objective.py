"""The learner's policy loss: decoupled PPO with behavior correction (docs/DESIGN.md §4, survey §2.3–2.4, §7.3).

Three policies per action token t (log-probs of the sampled token, shape _BT):

* ``behavior_logp_BT`` — π_beh, stored by the rollout engine that sampled the token;
* ``prox_logp_BT``     — π_prox, recomputed without grad by the weights before this learner step;
* ``logp_BT``          — π_θ, the current weights (the only input that carries grad).

Per token: ``w = π_prox/π_beh`` (behavior correction, no grad), ``r = π_θ/π_prox`` and

    L_t = −w · min(r·Â, clip(r, 1−ε_low, 1+ε_high)·Â)
    L_t = min(L_t_ppo, c·|Â|)  for Â < 0 when dual clip c is set (AReaL / verl), before w.

The loss is ``Σ_t m_t·L_t / D`` (or the per-sequence form), with D from ``ObjectiveConfig``
(`trajmesh.config.ObjectiveConfig`, the config's `learner.objective` type, used here as is):

* ``token_global``  — D = N, the number of eligible tokens in the WHOLE batch. Pass
  ``global_token_count`` when the call sees one micro-batch or one data-parallel shard; then the
  shard losses (and gradients) SUM to the full-batch loss. Default N = Σ mask of this call.
* ``sequence_mean`` — ``(1/S) Σ_i (Σ_t m_it L_it / Σ_t m_it)``; S = sequences with ≥ 1 eligible
  token, ``global_sequence_count`` across shards. A sequence is a trajectory: when one is split
  into rows (its segments, learner/step.py ``build_batch``), ``sequence_weight_B`` gives each row
  its share N_row/N_trajectory of the trajectory's eligible tokens, so its rows' terms add up to the
  trajectory's token mean and S counts it once (the shares sum to 1).
* ``constant``      — Dr.GRPO: ``Σ_{i,t} m_it L_it / (C · S)`` with C = ``constant_denominator``
  (typically the maximum response length) and S as above, i.e. the per-sequence token SUM
  divided by the constant, averaged over sequences (verl's ``seq-mean-token-sum-norm`` with the
  batch-size division that verl #3741 forgot).

The KL-to-reference term (:func:`reference_kl_loss`, `learner.reference`) adds
``β · Σ_t m_t·k(y_t) / D`` with ``y_t = log π_ref − log π_θ`` and one of Schulman's estimators
k (:func:`kl_penalty`), reduced with the same denominators (the objective's, or one named by
``learner.reference.aggregation``); it is not behavior-weighted and MIS-rejected tokens keep it.

"Eligible" means ``mask_BT`` (the loss mask). Tokens that MIS rejects contribute 0 but stay in D,
so D depends only on the loss masks and can be counted when the batch is assembled, before any
forward pass. ``mask_BT`` may be bool or 0/1 float; it is read as ``mask > 0``.
"""

from __future__ import annotations

import torch
from torch import Tensor

from trajmesh.config import ObjectiveConfig

__all__ = ["ObjectiveConfig", "behavior_weight", "decoupled_ppo_loss", "implicit_prm_loss", "kl_penalty",
           "ppo_clip_loss", "reference_kl_loss"]

_LOG_RATIO_LIMIT = 20.0  # |log r| is clamped here before exp (as verl) so garbage cannot overflow


def behavior_weight(
    prox_logp_BT: Tensor, behavior_logp_BT: Tensor, mask_BT: Tensor, cfg: ObjectiveConfig
) -> tuple[Tensor, Tensor, Tensor]:
    """Behavior correction ``w = exp(prox − beh)``, without grad.

    Returns ``(w_BT, w_raw_BT, kept_mask_BT)``: the weight the loss uses (capped for TIS, 0 where
    MIS rejects, 1 for ``none``), the uncorrected weight, and the bool mask of tokens the loss
    keeps (= mask for TIS/none; mask ∩ [mis_low, mis_high] for MIS). All are 0/False off the mask.
    """
    with torch.no_grad():
        on_BT = mask_BT > 0
        zero = torch.zeros((), dtype=prox_logp_BT.dtype)
        log_w_BT = torch.where(on_BT, prox_logp_BT - behavior_logp_BT, zero)
        w_raw_BT = torch.where(on_BT, log_w_BT.clamp(-_LOG_RATIO_LIMIT, _LOG_RATIO_LIMIT).exp(), zero)
        if cfg.behavior_correction == "tis":
            kept_BT = on_BT
            w_BT = w_raw_BT.clamp(max=cfg.tis_cap)
        elif cfg.behavior_correction == "mis":
            kept_BT = on_BT & (w_raw_BT >= cfg.mis_low) & (w_raw_BT <= cfg.mis_high)
            w_BT = torch.where(kept_BT, w_raw_BT, zero)
        elif cfg.behavior_correction == "none":
            kept_BT = on_BT
            w_BT = on_BT.to(prox_logp_BT.dtype)
        else:
            raise ValueError(f"unknown behavior_correction {cfg.behavior_correction!r}")
    return w_BT, w_raw_BT, kept_BT


def _clipped_token_loss(
    logp_BT: Tensor, anchor_logp_BT: Tensor, adv_BT: Tensor, on_BT: Tensor, cfg: ObjectiveConfig
) -> tuple[Tensor, dict[str, Tensor]]:
    """Per-token (dual-)clipped PPO loss around ``anchor`` and detached clip indicators."""
    zero = torch.zeros((), dtype=logp_BT.dtype)
    # torch.where (not multiplication) so that masked-out tokens get exactly zero gradient even
    # when their log-probs are garbage (−inf, nan) on padding.
    log_r_BT = torch.where(on_BT, logp_BT - anchor_logp_BT.detach(), zero)
    r_BT = log_r_BT.clamp(-_LOG_RATIO_LIMIT, _LOG_RATIO_LIMIT).exp()
    adv_BT = torch.where(on_BT, adv_BT.detach(), zero)
    loss_unclipped_BT = -r_BT * adv_BT
    loss_clipped_BT = -r_BT.clamp(1.0 - cfg.eps_low, 1.0 + cfg.eps_high) * adv_BT
    loss_BT = torch.maximum(loss_unclipped_BT, loss_clipped_BT)
    neg_BT = adv_BT < 0
    dual_BT = torch.zeros_like(on_BT)
    if cfg.dual_clip is not None:
        bound_BT = -cfg.dual_clip * adv_BT  # = c·|Â| where Â < 0
        dual_BT = neg_BT & (loss_BT > bound_BT) & on_BT
        loss_BT = torch.where(neg_BT, torch.minimum(loss_BT, bound_BT), loss_BT)
    with torch.no_grad():
        r = r_BT.detach()
        flags = {
            "clip_low": on_BT & neg_BT & (r < 1.0 - cfg.eps_low),
            "clip_high": on_BT & (adv_BT > 0) & (r > 1.0 + cfg.eps_high),
            "dual_clip": dual_BT,
            "ratio_outside": on_BT & ((r < 1.0 - cfg.eps_low) | (r > 1.0 + cfg.eps_high)),
        }
    return loss_BT, flags


def _aggregate(
    token_loss_BT: Tensor,
    on_BT: Tensor,
    cfg: ObjectiveConfig,
    global_token_count: float | None,
    global_sequence_count: float | None,
    sequence_weight_B: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """Reduce masked per-token losses to a scalar with the configured denominator → (loss, D)."""
    m_BT = on_BT.to(token_loss_BT.dtype)
    masked_BT = torch.where(on_BT, token_loss_BT, torch.zeros((), dtype=token_loss_BT.dtype))
    tokens_B = m_BT.sum(-1)
    weight_B = (torch.ones_like(tokens_B) if sequence_weight_B is None
                else sequence_weight_B.to(device=tokens_B.device, dtype=tokens_B.dtype))
    n_seq = (float(global_sequence_count) if global_sequence_count is not None
             else float(torch.where(tokens_B > 0, weight_B, torch.zeros_like(weight_B)).sum()))
    if cfg.denominator == "token_global":
        n_tok = float(global_token_count) if global_token_count is not None else float(m_BT.sum())
        denom = torch.tensor(max(n_tok, 1.0), dtype=token_loss_BT.dtype)
        return masked_BT.sum() / denom, denom
    if cfg.denominator == "sequence_mean":
        denom = torch.tensor(max(n_seq, 1.0), dtype=token_loss_BT.dtype)
        per_seq_B = masked_BT.sum(-1) / tokens_B.clamp_min(1.0) * weight_B
        return per_seq_B.sum() / denom, denom
    if cfg.denominator == "constant":
        denom = torch.tensor(cfg.constant_denominator * max(n_seq, 1.0), dtype=token_loss_BT.dtype)
        return masked_BT.sum() / denom, denom
    raise ValueError(f"unknown denominator {cfg.denominator!r}")


def _stats(
    loss: Tensor, denom: Tensor, on_BT: Tensor, r_source: tuple[Tensor, Tensor], flags: dict[str, Tensor]
) -> dict[str, Tensor]:
    n = on_BT.sum().clamp_min(1).to(loss.dtype)
    logp_BT, anchor_BT = r_source
    zero = torch.zeros((), dtype=loss.dtype)
    log_r_BT = torch.where(on_BT, logp_BT.detach() - anchor_BT.detach(), zero)
    stats = {f"{k}_frac": v.sum().to(loss.dtype) / n for k, v in flags.items()}
    stats["ratio_mean"] = torch.where(on_BT, log_r_BT.clamp(max=_LOG_RATIO_LIMIT).exp(), zero).sum() / n
    stats["loss"] = loss.detach()
    stats["denominator"] = denom.detach()
    stats["num_tokens"] = on_BT.sum().to(loss.dtype)
    return stats


def decoupled_ppo_loss(
    logp_BT: Tensor,
    prox_logp_BT: Tensor,
    behavior_logp_BT: Tensor,
    adv_BT: Tensor,
    mask_BT: Tensor,
    cfg: ObjectiveConfig,
    *,
    global_token_count: float | None = None,
    global_sequence_count: float | None = None,
    sequence_weight_B: Tensor | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """Decoupled PPO loss (AReaL) with behavior correction; see the module docstring
    (``sequence_weight_B``: each row's share of its trajectory, for the per-sequence forms).

    Returns ``(loss, stats)``; stats are detached scalars: ``clip_low_frac`` (Â<0, r<1−ε_low),
    ``clip_high_frac`` (Â>0, r>1+ε_high), ``dual_clip_frac`` (dual bound active),
    ``ratio_outside_frac`` (r ∉ [1−ε_low, 1+ε_high], survey §11.3 f_clip), ``ratio_mean``,
    ``weight_mean``, ``mis_rejected_frac``, ``loss``, ``denominator``, ``num_tokens`` — fractions
    over this call's eligible tokens.
    """
    on_BT = mask_BT > 0
    w_BT, _, kept_BT = behavior_weight(prox_logp_BT, behavior_logp_BT, mask_BT, cfg)
    token_loss_BT, flags = _clipped_token_loss(logp_BT, prox_logp_BT, adv_BT, on_BT, cfg)
    # w is exactly 0 where MIS rejects, so those tokens add 0 (and get 0 grad) but stay in D.
    loss, denom = _aggregate(w_BT * token_loss_BT, on_BT, cfg, global_token_count, global_sequence_count,
                             sequence_weight_B)
    stats = _stats(loss, denom, on_BT, (logp_BT, prox_logp_BT), flags)
    n = on_BT.sum().clamp_min(1).to(loss.dtype)
    stats["weight_mean"] = w_BT.sum() / n
    stats["mis_rejected_frac"] = (on_BT & ~kept_BT).sum().to(loss.dtype) / n
    return loss, stats


def ppo_clip_loss(
    logp_BT: Tensor,
    old_logp_BT: Tensor,
    adv_BT: Tensor,
    mask_BT: Tensor,
    cfg: ObjectiveConfig,
    *,
    global_token_count: float | None = None,
    global_sequence_count: float | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """Plain (dual-)clipped PPO around ``old_logp_BT`` with no behavior weight
    (``cfg.behavior_correction`` is ignored). Same aggregation and stats as the decoupled loss."""
    on_BT = mask_BT > 0
    token_loss_BT, flags = _clipped_token_loss(logp_BT, old_logp_BT, adv_BT, on_BT, cfg)
    loss, denom = _aggregate(token_loss_BT, on_BT, cfg, global_token_count, global_sequence_count)
    return loss, _stats(loss, denom, on_BT, (logp_BT, old_logp_BT), flags)


def kl_penalty(logp_BT: Tensor, ref_logp_BT: Tensor, estimator: str) -> Tensor:
    """Per-token estimate of KL(π_θ ‖ π_ref) from tokens sampled by (about) π_θ, with
    ``y = log π_ref − log π_θ`` clamped to ±20 (grad flows through ``logp_BT`` only):

        k1 = −y             (unbiased, can be negative; grad ∂/∂logp = 1)
        k2 = y² / 2         (biased, low variance; grad −y)
        k3 = eʸ − 1 − y     (unbiased, ≥ 0, low variance; grad 1 − eʸ)
    """
    y_BT = (ref_logp_BT.detach() - logp_BT).clamp(-_LOG_RATIO_LIMIT, _LOG_RATIO_LIMIT)
    if estimator == "k1":
        return -y_BT
    if estimator == "k2":
        return 0.5 * y_BT * y_BT
    if estimator == "k3":
        return torch.expm1(y_BT) - y_BT
    raise ValueError(f"unknown KL estimator {estimator!r}")


def reference_kl_loss(
    logp_BT: Tensor,
    ref_logp_BT: Tensor,
    mask_BT: Tensor,
    cfg: ObjectiveConfig,
    *,
    estimator: str,
    coef: float,
    aggregation: str = "objective",
    global_token_count: float | None = None,
    global_sequence_count: float | None = None,
    sequence_weight_B: Tensor | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """The KL-to-reference term ``coef · Σ m·k / D`` (see the module docstring): D is the
    objective's denominator (``aggregation="objective"``) or the one named (``token_global``,
    ``sequence_mean``), with the same global counts as the policy loss, so micro-batch and rank
    shares sum to the full batch's term. Off the mask the term and its gradient are exactly 0.

    Returns ``(term, stats)``: ``reference_kl`` (the token mean of the estimator over this call's
    eligible tokens, detached) and ``reference_kl_loss`` (the term, detached).
    """
    on_BT = mask_BT > 0
    zero = torch.zeros((), dtype=logp_BT.dtype)
    safe_logp_BT = torch.where(on_BT, logp_BT, ref_logp_BT.detach().to(logp_BT.dtype))
    k_BT = torch.where(on_BT, kl_penalty(safe_logp_BT, ref_logp_BT, estimator), zero)
    agg_cfg = cfg if aggregation == "objective" else cfg.model_copy(update={"denominator": aggregation})
    term, _ = _aggregate(k_BT, on_BT, agg_cfg, global_token_count, global_sequence_count, sequence_weight_B)
    n = on_BT.sum().clamp_min(1).to(logp_BT.dtype)
    stats = {"reference_kl": (k_BT.detach().sum() / n), "reference_kl_loss": (coef * term).detach()}
    return coef * term, stats


def implicit_prm_loss(
    prm_logp_BT: Tensor,
    ref_logp_BT: Tensor,
    mask_BT: Tensor,
    label_J: Tensor,
    *,
    beta: float,
    trajectory_index_B: Tensor | None = None,
    global_trajectory_count: float | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """PRIME's PRM loss (survey §7.4): binary cross-entropy on each trajectory's implicit-reward
    logit ``ℓ_j = β · Σ_t m_t (log πφ(y_t) − log π_ref(y_t))`` (its rows' tokens summed, rows mapped
    to 0..J−1 by ``trajectory_index_B``) against its outcome label ``y_j`` ∈ {0, 1}:

        L = (1/J) Σ_j −[y_j log σ(ℓ_j) + (1 − y_j) log(1 − σ(ℓ_j))]

    Not next-token cross-entropy: the gradient pushes the whole sequence's log-likelihood ratio up
    for a correct trajectory (∂L/∂ℓ_j = (σ(ℓ_j) − y_j)/J < 0) and down for an incorrect one. J is
    ``global_trajectory_count`` when the call sees one micro-batch of whole trajectories (the
    micro-batch losses then sum to the batch's). Grad flows through ``prm_logp_BT`` only.

    Returns ``(loss, stats)``: ``prm_loss`` (detached), ``prm_correct`` (trajectories whose
    prediction ℓ_j > 0 matches y_j), ``prm_trajectories`` and ``prm_logit_mean``."""
    on_BT = mask_BT > 0
    zero = torch.zeros((), dtype=prm_logp_BT.dtype)
    diff_BT = torch.where(on_BT, prm_logp_BT - ref_logp_BT.detach().to(prm_logp_BT.dtype), zero)
    rows_B = (torch.arange(diff_BT.shape[0], device=diff_BT.device) if trajectory_index_B is None
              else trajectory_index_B.to(diff_BT.device).long())
    J = int(label_J.shape[0])
    logit_J = beta * torch.zeros(J, dtype=diff_BT.dtype, device=diff_BT.device).index_add(0, rows_B, diff_BT.sum(-1))
    label_J = label_J.to(device=diff_BT.device, dtype=diff_BT.dtype)
    count = float(global_trajectory_count) if global_trajectory_count is not None else float(max(J, 1))
    loss = torch.nn.functional.binary_cross_entropy_with_logits(logit_J, label_J, reduction="sum") / count
    with torch.no_grad():
        correct = ((logit_J > 0) == (label_J > 0.5)).sum().to(diff_BT.dtype)
        stats = {"prm_loss": loss.detach(), "prm_correct": correct, "prm_trajectories": torch.tensor(float(J)),
                 "prm_logit_mean": logit_J.detach().mean() if J else zero}
    return loss, stats
