"""Engine-consistency probe (survey §8.5): does the learner implement the rollout engine's policy?

Staleness and training–inference mismatch are different axes. To see the second alone, compare
log-probs of the *same* weights in both engines. The survey's recipe runs a fixed prefix through both
engines; in this mesh each rollout process owns its engine on a private port the learner does not
know, so the probe uses the prefixes the engine has just run instead:

    batch from the store ──▶ tokens whose behavior version u == learner version v (before the step)
                                 │ their behavior log-prob was computed by the rollout engine with
                                 │ weights v; the learner now holds exactly weights v
                                 ▼
        no-grad forward of the learner on ≤ K of those trajectories (pre-update weights, same
        temperature) ──▶ |log π_learner − log π_engine| per token ──▶ max and mean

On version-matched tokens π_beh and π_prox are nominally identical, so any difference is engine
numerics (kernels, precision, reduction order, a wrong weight load, a tokenizer or template
mismatch) and not staleness. Every weight update is covered: the first batch that holds tokens of a
new version probes it. Steps whose batch has no version-matched token export nothing new (the
gauges keep the last value; ``..._tokens`` is 0 for that step).

Exported by the learner as ``trajmesh_learner_engine_consistency_max_abs_logprob_diff`` and
``..._mean_abs_logprob_diff`` (nats), and ``trajmesh_learner_engine_consistency_tokens``; the stop
gate ``engine_consistency_max_abs_logprob_diff_max`` applies to the max.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from trajmesh.contract import Trajectory
from trajmesh.learner.step import build_batch, token_logprobs

MAX_ABS = "trajmesh_learner_engine_consistency_max_abs_logprob_diff"
MEAN_ABS = "trajmesh_learner_engine_consistency_mean_abs_logprob_diff"
TOKENS = "trajmesh_learner_engine_consistency_tokens"
NAMES = (MAX_ABS, MEAN_ABS, TOKENS)


def version_matched_diff(
    learner_logp_BT: Tensor, behavior_logp_BT: Tensor, mask_BT: Tensor, versions_BT: Tensor, version: int
) -> dict[str, float]:
    """Max and mean |learner − behavior| log-prob over loss-masked tokens sampled by `version`.

    Always returns the token count; max/mean only when at least one token matches.
    """
    on_BT = (mask_BT > 0) & (versions_BT == version)
    n = int(on_BT.sum())
    if n == 0:
        return {TOKENS: 0.0}
    diff = (learner_logp_BT.detach().double() - behavior_logp_BT.double()).abs()[on_BT]
    return {MAX_ABS: float(diff.max()), MEAN_ABS: float(diff.mean()), TOKENS: float(n)}


def select_probe(trajs: list[Trajectory], version: int, max_trajectories: int) -> list[Trajectory]:
    """The first `max_trajectories` trajectories (batch order) with a sampled token of `version`."""
    out: list[Trajectory] = []
    for t in trajs:
        if len(out) >= max_trajectories:
            break
        if ((t.behavior_versions_T == version) & (t.loss_mask_T == 1)).any():
            out.append(t)
    return out


def probe(model: Any, trajs: list[Trajectory], *, version: int, pad_id: int, temperature: float,
          max_trajectories: int) -> dict[str, float]:
    """Runs the probe with `model` holding weights `version` (call it before the optimizer step)."""
    chosen = select_probe(trajs, version, max_trajectories)
    if not chosen:
        return {TOKENS: 0.0}
    batch = build_batch(chosen, pad_id)
    was_training = model.training
    model.eval()
    with torch.no_grad():
        logp_BT, _ = token_logprobs(model, batch, temperature)  # on the model's device
    model.train(was_training)
    logp_BT = logp_BT.float().cpu()
    return version_matched_diff(logp_BT, batch.behavior_logp_BT, batch.mask_BT, batch.versions_BT, version)
