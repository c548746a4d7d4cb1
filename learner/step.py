"""One learner step over a batch of trajectories: staleness check, tensors, loss, metrics.

Pure functions over the model and tensors, so the learner service stays wiring and this stays
testable on its own.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor
from trajmesh.learner import advantages as adv
from trajmesh.learner.metrics import entropy_from_logits, step_metrics
from trajmesh.learner.objective import ObjectiveConfig, behavior_weight, decoupled_ppo_loss

from trajmesh.contract import Trajectory
from trajmesh.v1 import trajectory_pb2


def split_stale(trajs: list[Trajectory], version: int, eta: int) -> tuple[list[Trajectory], list[Trajectory]]:
    """(trainable, stale): a trajectory is stale if any action token has lag v − u > η (DESIGN.md §3)."""
    keep: list[Trajectory] = []
    stale: list[Trajectory] = []
    for t in trajs:
        v_T, m_T = t.behavior_versions_T, t.loss_mask_T
        lag = (version - v_T[m_T == 1]) if len(v_T) else v_T
        (stale if lag.size and int(lag.max()) > eta else keep).append(t)
    return keep, stale


@dataclass
class Batch:
    input_ids_BT: Tensor
    attention_BT: Tensor
    mask_BT: Tensor          # loss mask, aligned with input_ids (1 on sampled tokens)
    behavior_logp_BT: Tensor
    versions_BT: Tensor
    reward_B: Tensor
    group_index_B: Tensor
    trajectory_ids: list[str]
    # ActionType of the span covering each token (TEXT/TOOL_CALL/CODE on action tokens, PROMPT,
    # OBSERVATION); ACTION_TYPE_UNSPECIFIED (0) on padding and on tokens no span covers.
    action_type_BT: Tensor


def build_batch(trajs: list[Trajectory], pad_id: int) -> Batch:
    """Right-padded tensors; padding has mask 0, log-prob 0, version −1 and action type
    ACTION_TYPE_UNSPECIFIED (0). Each span's action type fills its tokens (clipped to the
    trajectory; a later span wins where spans overlap)."""
    width = max(len(t) for t in trajs)
    b = len(trajs)
    ids = torch.full((b, width), pad_id, dtype=torch.long)
    att = torch.zeros((b, width), dtype=torch.long)
    mask = torch.zeros((b, width), dtype=torch.float32)
    blogp = torch.zeros((b, width), dtype=torch.float32)
    vers = torch.full((b, width), -1, dtype=torch.long)
    atype = torch.full((b, width), trajectory_pb2.ACTION_TYPE_UNSPECIFIED, dtype=torch.long)
    groups: dict[str, int] = {}
    gidx = torch.zeros(b, dtype=torch.long)
    for i, t in enumerate(trajs):
        n = len(t)
        ids[i, :n] = torch.from_numpy(t.token_ids_T.astype("int64"))
        att[i, :n] = 1
        mask[i, :n] = torch.from_numpy(t.loss_mask_T.astype("float32"))
        blogp[i, :n] = torch.from_numpy(t.behavior_logprobs_T)
        vers[i, :n] = torch.from_numpy(t.behavior_versions_T)
        for span in t.pb.spans:
            atype[i, min(span.token_start, n):min(span.token_end, n)] = span.action_type
        gidx[i] = groups.setdefault(t.group_id, len(groups))
    reward = torch.tensor([t.reward for t in trajs], dtype=torch.float32)
    return Batch(ids, att, mask, blogp, vers, reward, gidx, [t.trajectory_id for t in trajs], atype)


def token_logprobs(model: Any, batch: Batch, temperature: float) -> tuple[Tensor, Tensor]:
    """(logp_BT, entropy_BT) of each token under `model` at the sampling temperature.

    Position t is predicted by the logits at t−1; position 0 (BOS/prompt) gets 0.
    """
    out = model(input_ids=batch.input_ids_BT, attention_mask=batch.attention_BT, use_cache=False)
    logits = out.logits[:, :-1].float() / max(temperature, 1e-6)
    logp_all = torch.log_softmax(logits, dim=-1)
    tok = batch.input_ids_BT[:, 1:].unsqueeze(-1)
    logp = logp_all.gather(-1, tok).squeeze(-1)
    ent = entropy_from_logits(logits)
    zeros = torch.zeros_like(logp[:, :1])
    return torch.cat([zeros, logp], dim=1), torch.cat([zeros, ent], dim=1)


def advantages_B(batch: Batch, kind: str, *, scale_by_std: bool, eps: float) -> Tensor:
    if kind == "grpo":
        return adv.grpo_advantages(batch.reward_B, batch.group_index_B, scale_by_std=scale_by_std, eps=eps)
    if kind == "dr_grpo":
        return adv.dr_grpo_advantages(batch.reward_B, batch.group_index_B)
    if kind == "rloo":
        return adv.rloo_advantages(batch.reward_B, batch.group_index_B)
    raise ValueError(f"advantage {kind!r} is not supported by the token-level learner step")


def is_deterministic(model: Any) -> bool:
    """Whether a training-mode forward equals an eval-mode one: no dropout anywhere (modules with
    p > 0 or a config `*dropout*` / `*pdrop*` value > 0, as HF attention reads its rate from config)."""
    for m in model.modules():
        if isinstance(m, torch.nn.modules.dropout._DropoutNd) and m.p > 0:
            return False
    to_dict = getattr(getattr(model, "config", None), "to_dict", None)
    for key, value in (to_dict() if callable(to_dict) else {}).items():
        if ("dropout" in key or "pdrop" in key) and isinstance(value, (int, float)) and value > 0:
            return False
    return True


def compute_loss(
    model: Any,
    batch: Batch,
    adv_B: Tensor,
    cfg: ObjectiveConfig,
    *,
    temperature: float,
    version: int,
    max_lag: int,
    entropy_coef: float = 0.0,
) -> tuple[Tensor, dict[str, float]]:
    """Proximal log-probs with the pre-update weights (no grad), then the decoupled loss.

    The learner takes one optimizer step per batch, so the pre-update weights are the weights of
    this forward; a separate no-grad pass is only needed when the forward is stochastic (dropout).

    `entropy_coef` α adds −α·H (token-mean entropy over action tokens) to the loss.
    """
    if is_deterministic(model):
        # One update per batch and no dropout: the pre-update forward would compute exactly these
        # log-probs (same weights, same ops), so π_prox is this forward, detached — a third of the
        # step's compute saved. tests/test_learner_step.py checks the two paths agree.
        logp_BT, entropy_BT = token_logprobs(model, batch, temperature)
        prox_logp_BT = logp_BT.detach()
    else:
        was_training = model.training
        model.eval()
        with torch.no_grad():
            prox_logp_BT, _ = token_logprobs(model, batch, temperature)
        model.train(was_training)
        logp_BT, entropy_BT = token_logprobs(model, batch, temperature)
    mask_BT = batch.mask_BT
    adv_BT = adv.expand_to_tokens(adv_B, mask_BT)
    loss, stats = decoupled_ppo_loss(logp_BT, prox_logp_BT, batch.behavior_logp_BT, adv_BT, mask_BT, cfg)
    if entropy_coef:
        loss = loss - entropy_coef * (entropy_BT * mask_BT).sum() / mask_BT.sum().clamp_min(1)
    _, w_raw_BT, kept_BT = behavior_weight(prox_logp_BT, batch.behavior_logp_BT, mask_BT, cfg)
    metrics = step_metrics(
        logp_BT=logp_BT.detach(), prox_logp_BT=prox_logp_BT, behavior_logp_BT=batch.behavior_logp_BT,
        adv_BT=adv_BT, mask_BT=mask_BT, w_raw_BT=w_raw_BT, kept_mask_BT=kept_BT, loss_stats=stats,
        cfg=cfg, entropy_BT=entropy_BT.detach(), action_type_BT=batch.action_type_BT, current_version=version,
        versions_BT=batch.versions_BT, max_lag=max_lag,
    )
    return loss, metrics
