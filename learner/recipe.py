"""The training recipe: what one learner step trains on, from the batch the store handed out.
A pure function of the trajectories, the learner's version and the run's config: no model, no
I/O, no service (the learner service calls it, then runs the update and does the I/O).

::

    trajectories ─▶ split_stale (v − u ≤ η per token; the rest quarantined `stale`)
                    batch_health (reward, verifier agreement, truncation: every trajectory)
                 ─▶ kept: response lengths ─▶ build_batch ─▶ truncation (learner.truncation)
                 ─▶ (prime: the implicit PRM's step on the batch → token rewards, `process_rewards`)
                 ─▶ advantages (learner.advantage: grpo, dr_grpo, rloo, reinforce_pp, gigpo, prime)
                    + what they are (advantage_metrics) ─▶ distillation's per-token term (distill)
                 ─▶ Recipe(keep, stale, batch, adv_BT, metrics)
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from torch import Tensor

from trajmesh.config import RunConfig
from trajmesh.contract import Trajectory
from trajmesh.learner.advantages import advantage_metrics, advantages_BT, distill_advantages_BT
from trajmesh.learner.step import Batch, apply_truncation, build_batch, response_length_metrics, split_stale
from trajmesh.stoprules import batch_health


@dataclass
class Recipe:
    """What a step trains on. `batch` and `adv_BT` are None when every trajectory was stale (the
    step still advances the version)."""

    keep: list[Trajectory]
    stale: list[Trajectory]
    batch: Batch | None = None
    adv_BT: Tensor | None = None
    metrics: dict[str, Any] = field(default_factory=dict)
    """The batch's health, response lengths, and what its advantages are (metrics.jsonl)."""


ProcessRewards = Callable[[Batch], tuple[Tensor, dict[str, float]]]
"""PRIME's implicit PRM as the recipe sees it: a batch → its token rewards r_BT and the PRM step's
metrics (learner/prm.py ``ImplicitPRM.step``; the PRM trains on the batch as it scores it)."""


def prepare(trajs: list[Trajectory], cfg: RunConfig, *, version: int, eta: int, pad_id: int,
            process_rewards: ProcessRewards | None = None) -> Recipe:
    """The recipe of one step at learner `version` with staleness bound `eta`; advantage ``prime``
    needs `process_rewards`."""
    lc = cfg.learner
    keep, stale = split_stale(trajs, version, eta)
    recipe = Recipe(keep, stale, metrics=batch_health(trajs, lc.stop_rules.verifier_components))
    if not keep:
        return recipe
    recipe.metrics.update(response_length_metrics(keep))
    max_length, cache_length = lc.truncation.lengths(cfg.tasks.sampling)
    batch = apply_truncation(build_batch(keep, pad_id), keep, lc.truncation.policy,
                             max_length=max_length, cache_length=cache_length)
    a = lc.advantage
    process_BT = None
    if a.type == "prime":
        if process_rewards is None:
            raise ValueError("learner.advantage prime needs the implicit PRM (process_rewards)")
        process_BT, prm_metrics = process_rewards(batch)
        recipe.metrics.update(prm_metrics)
    adv_BT = advantages_BT(batch, a.type, scale_by_std=a.scale_by_std, eps=a.eps, trajs=keep,
                           omega=a.gigpo_omega, gamma=a.gigpo_gamma, process_reward_BT=process_BT,
                           prime_gamma=lc.prime.gamma)
    recipe.metrics.update(advantage_metrics(batch, adv_BT, a.type, keep, scale_by_std=a.scale_by_std, eps=a.eps))
    if cfg.distill.teachers:
        adv_BT, distill_metrics = distill_advantages_BT(adv_BT, batch, keep, coef=cfg.distill.coef,
                                                        reward_weight=cfg.distill.reward_weight)
        recipe.metrics.update(distill_metrics)
    recipe.batch, recipe.adv_BT = batch, adv_BT
    return recipe
