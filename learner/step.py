"""One learner step over a batch of trajectories: staleness check, tensors, loss, metrics.

Pure functions over the model and tensors, so the learner service stays wiring and this stays
testable on its own.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

import numpy as np
import torch
from torch import Tensor

from trajmesh.contract import Trajectory
from trajmesh.learner import advantages as adv
from trajmesh.learner.logprobs import DEFAULT_CHUNK_TOKENS, PolicyLogprobs, policy_of
from trajmesh.learner.metrics import kl_estimates, step_metrics, trust_region_metrics
from trajmesh.learner.microbatch import (
    GlobalCounts,
    balanced_split,
    data_parallel,
    global_counts,
    max_over_ranks,
    pack_micro_batches,
    sum_over_ranks,
    sum_tensor_over_ranks,
)
from trajmesh.learner.objective import ObjectiveConfig, behavior_weight, decoupled_ppo_loss, reference_kl_loss
from trajmesh.learner.shaping import TruncationPolicy, apply_truncation_policy
from trajmesh.v1 import trajectory_pb2


def split_stale(trajs: list[Trajectory], version: int, eta: int) -> tuple[list[Trajectory], list[Trajectory]]:
    """(trainable, stale): a trajectory is stale if any action token has lag v − u > η (docs/DESIGN.md §3)."""
    keep: list[Trajectory] = []
    stale: list[Trajectory] = []
    for t in trajs:
        v_T, m_T = t.behavior_versions_T, t.loss_mask_T
        lag = (version - v_T[m_T == 1]) if len(v_T) else v_T
        (stale if lag.size and int(lag.max()) > eta else keep).append(t)
    return keep, stale


@dataclass
class Batch:
    """One row per sequence. A trajectory holding several segments (``sequence_starts``: an external
    agent's session whose history changed) gives one row per segment; the rows share its reward,
    group and id, its advantage is computed once per trajectory (:func:`advantages_B`), and
    ``row_share_B`` makes it weigh as ONE sequence in the sequence-mean and constant denominators."""

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
    trajectory_index_B: Tensor | None = None
    """Per row, the index of its trajectory in the trajectories the batch was built from (None:
    row i is trajectory i)."""
    row_share_B: Tensor | None = None
    """Per row, its share of its trajectory's loss-mask tokens (1.0 for a one-row trajectory): the
    weight of the row's token mean in the sequence-mean loss and its count in S (None: all 1)."""

    def lengths(self) -> list[int]:
        """Unpadded length of each row."""
        return [int(n) for n in self.attention_BT.sum(-1).tolist()]

    def select(self, rows: list[int]) -> Batch:
        """The given rows, in that order, cut to their longest length (right padding)."""
        idx = torch.tensor(rows, dtype=torch.long)
        width = max(int(self.attention_BT.index_select(0, idx.to(self.attention_BT.device)).sum(-1).max()), 1)

        def take(x_BT: Tensor) -> Tensor:
            return x_BT.index_select(0, idx.to(x_BT.device))[:, :width]

        def rows_of(x_B: Tensor | None) -> Tensor | None:
            return None if x_B is None else x_B.index_select(0, idx.to(x_B.device))

        return Batch(take(self.input_ids_BT), take(self.attention_BT), take(self.mask_BT),
                     take(self.behavior_logp_BT), take(self.versions_BT),
                     self.reward_B.index_select(0, idx.to(self.reward_B.device)),
                     self.group_index_B.index_select(0, idx.to(self.group_index_B.device)),
                     [self.trajectory_ids[i] for i in rows], take(self.action_type_BT),
                     rows_of(self.trajectory_index_B), rows_of(self.row_share_B))

    def trajectory_rows(self) -> Tensor:
        """Per row, its trajectory as 0..J−1 in order of first appearance ([B], long, CPU)."""
        if self.trajectory_index_B is None:
            return torch.arange(self.reward_B.shape[0])
        first: dict[int, int] = {}
        return torch.tensor([first.setdefault(int(j), len(first)) for j in self.trajectory_index_B.tolist()],
                            dtype=torch.long)

    def trajectory_rewards(self) -> Tensor:
        """Each trajectory's reward once ([J], order of first appearance)."""
        return adv.per_trajectory(self.reward_B, self.trajectory_rows())

    def unique_trajectory_ids(self) -> list[str]:
        """Each trajectory's id once, in row order (what the store is told was trained)."""
        return list(dict.fromkeys(self.trajectory_ids))

    def to(self, device: torch.device | str) -> Batch:
        """Every tensor on `device` (the model's: DeepSpeed moved the model to cuda:LOCAL_RANK)."""
        if self.input_ids_BT.device == torch.device(device):
            return self
        return Batch(*(getattr(self, f).to(device) if isinstance(getattr(self, f), Tensor) else getattr(self, f)
                       for f in self.__dataclass_fields__))


def build_batch(trajs: list[Trajectory], pad_id: int) -> Batch:
    """Right-padded tensors, one row per sequence: a trajectory is one row, or one row per segment
    when ``sequence_starts`` splits it (each segment its own context: its prompt, mask 0, then its
    turns; rows keep the trajectory's order). Padding has mask 0, log-prob 0, version −1 and action
    type ACTION_TYPE_UNSPECIFIED (0). Each span's action type fills its tokens (clipped to the row;
    a later span wins where spans overlap)."""
    rows = [(i, a, e) for i, t in enumerate(trajs) for a, e in (t.segment_bounds() or [(0, len(t))])]
    width = max(max(e - a for _, a, e in rows), 1)
    b = len(rows)
    # Filled in numpy straight from each trajectory's block views (one copy per row and array, the
    # dtype converted on the way), then handed to torch without another copy.
    ids = np.full((b, width), pad_id, dtype=np.int64)
    att = np.zeros((b, width), dtype=np.int64)
    mask = np.zeros((b, width), dtype=np.float32)
    blogp = np.zeros((b, width), dtype=np.float32)
    vers = np.full((b, width), -1, dtype=np.int64)
    atype = np.full((b, width), trajectory_pb2.ACTION_TYPE_UNSPECIFIED, dtype=np.int64)
    groups: dict[str, int] = {}
    gidx = torch.zeros(b, dtype=torch.long)
    share = torch.ones(b, dtype=torch.float32)
    arrays = [(t.token_ids_T, t.loss_mask_T, t.behavior_logprobs_T, t.behavior_versions_T) for t in trajs]
    for r, (i, a, e) in enumerate(rows):
        t, n = trajs[i], e - a
        tok_T, m_T, lp_T, v_T = (x[a:e] for x in arrays[i])
        ids[r, :n] = tok_T
        att[r, :n] = 1
        mask[r, :n] = m_T
        blogp[r, :n] = lp_T
        vers[r, :n] = v_T
        for span in t.pb.spans:
            lo, hi = max(span.token_start, a), min(span.token_end, e)
            if lo < hi:
                atype[r, lo - a:hi - a] = span.action_type
        gidx[r] = groups.setdefault(t.group_id, len(groups))
        total = int((arrays[i][1] == 1).sum())
        if total and (a, e) != (0, len(t)):
            share[r] = float((m_T == 1).sum()) / total
    reward = torch.tensor([trajs[i].reward for i, _, _ in rows], dtype=torch.float32)
    return Batch(torch.from_numpy(ids), torch.from_numpy(att), torch.from_numpy(mask), torch.from_numpy(blogp),
                 torch.from_numpy(vers), reward, gidx, [trajs[i].trajectory_id for i, _, _ in rows],
                 torch.from_numpy(atype),
                 torch.tensor([i for i, _, _ in rows], dtype=torch.long), share)


def apply_truncation(batch: Batch, trajs: list[Trajectory], policy: TruncationPolicy, *,
                     max_length: int | None = None, cache_length: int | None = None) -> Batch:
    """`batch` (built from `trajs`) with `learner.truncation.policy` applied (learner/shaping.py):
    a truncated trajectory's rows are masked out (``mask``) or rewarded 0 (``zero_reward``), or every
    trajectory's reward gets DAPO's soft overlong penalty on its response length, the loss-masked
    tokens over all its rows (``dapo_soft``). Every row of a trajectory ends with the same reward."""
    if policy == "keep":
        return batch
    rows_B = batch.trajectory_index_B if batch.trajectory_index_B is not None else torch.arange(len(trajs))
    truncated_B = torch.tensor([trajs[int(i)].truncated for i in rows_B.tolist()], dtype=torch.bool)
    length_J = torch.tensor([int((t.loss_mask_T == 1).sum()) for t in trajs], dtype=torch.long)
    reward_B, mask_BT = apply_truncation_policy(batch.reward_B, truncated_B, batch.mask_BT, policy,
                                                length_B=length_J[rows_B], max_length=max_length,
                                                cache_length=cache_length)
    return replace(batch, reward_B=reward_B, mask_BT=mask_BT)


def response_length_metrics(trajs: list[Trajectory]) -> dict[str, Any]:
    """Response lengths (loss-masked tokens per trajectory) of a batch: mean, p50, p90 and max, the
    means of correct (reward > 0) and incorrect trajectories, and the mean per task source. The
    length bias of a normalisation (survey §2.3) shows here first."""
    if not trajs:
        return {}
    n_J = torch.tensor([float((t.loss_mask_T == 1).sum()) for t in trajs], dtype=torch.float64)
    correct_J = torch.tensor([t.reward > 0 for t in trajs], dtype=torch.bool)
    out: dict[str, Any] = {
        "trajmesh_learner_response_length_mean_tokens": float(n_J.mean()),
        "trajmesh_learner_response_length_p50_tokens": float(torch.quantile(n_J, 0.5)),
        "trajmesh_learner_response_length_p90_tokens": float(torch.quantile(n_J, 0.9)),
        "trajmesh_learner_response_length_max_tokens": float(n_J.max()),
    }
    for name, sel in (("correct", correct_J), ("incorrect", ~correct_J)):
        if bool(sel.any()):
            out[f"trajmesh_learner_response_length_{name}_mean_tokens"] = float(n_J[sel].mean())
    by_source: dict[str, list[float]] = {}
    for t, n in zip(trajs, n_J.tolist(), strict=True):
        by_source.setdefault(t.pb.task_source or "-", []).append(n)
    out["response_length_mean_tokens_by_source"] = {k: sum(v) / len(v) for k, v in sorted(by_source.items())}
    return out


def token_logprobs(model: Any, batch: Batch, temperature: float,
                   chunk_tokens: int = DEFAULT_CHUNK_TOKENS) -> tuple[Tensor, Tensor]:
    """(logp_BT, entropy_BT) of each token under `model` at the sampling temperature, on the
    model's device, computed in chunks (learner/logprobs.py: no fp32 [B, T, V] tensor).

    `model` is a train engine's module wrapping a :class:`PolicyLogprobs`, a ``PolicyLogprobs``,
    or a plain HF causal LM. Position t is predicted by the logits at t−1; position 0 gets 0.
    """
    net = model if isinstance(getattr(model, "module", model), PolicyLogprobs) else PolicyLogprobs(model, chunk_tokens)
    batch = batch.to(model_device(model))
    return net(input_ids=batch.input_ids_BT, attention_mask=batch.attention_BT, temperature=temperature)


def model_device(model: Any) -> torch.device:
    """The device of the model's parameters (under ZeRO-3 the placeholders sit on it too)."""
    for p in model.parameters():
        return p.device
    return torch.device("cpu")


def is_deterministic(model: Any) -> bool:
    """Whether a training-mode forward equals an eval-mode one: no dropout anywhere (modules with
    p > 0 or a config `*dropout*` / `*pdrop*` value > 0, as HF attention reads its rate from config)."""
    for m in model.modules():
        if isinstance(m, torch.nn.modules.dropout._DropoutNd) and m.p > 0:
            return False
    to_dict = getattr(getattr(policy_of(model), "config", None), "to_dict", None)
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
    """One forward over the whole batch and its decoupled loss (one update, no micro-batches):
    π_prox is this forward detached when the model is deterministic, else a separate no-grad pass.

    `adv_B` is per sequence ([B]) or per token ([B, T]). `entropy_coef` α adds −α·H (token-mean
    entropy over action tokens) to the loss. The service trains through :func:`train_batch`.
    """
    adv_BT = adv_B if adv_B.dim() == 2 else adv.expand_to_tokens(adv_B, batch.mask_BT)
    prox_BT = None if is_deterministic(model) else proximal_logprobs(model, batch, temperature, 2**62)
    counts = global_counts(batch.mask_BT, row_share_B=batch.row_share_B)
    loss, part = _micro_batch_loss(model, batch, adv_BT, prox_BT, cfg, counts, temperature, entropy_coef)
    metrics = _metrics(batch, adv_BT, part.logp_BT, part.prox_BT, part.entropy_BT, part.stats, cfg,
                       version, max_lag)
    return loss, metrics


def proximal_logprobs(model: Any, batch: Batch | None, temperature: float, micro_batch_tokens: int,
                      group: Any = None, filler: Batch | None = None) -> Tensor:
    """π_prox: log-probs of the current (pre-update) weights, eval mode, no grad, in micro-batches
    → [B, T] float32 on the CPU. With several ranks every rank runs as many forwards (ZeRO-3): a
    rank with fewer micro-batches (or no rows: `batch` None) runs forwards of `filler`."""
    was_training = model.training
    model.eval()
    out_BT = torch.zeros(batch.mask_BT.shape if batch is not None else (0, 1), dtype=torch.float32)
    micro = pack_micro_batches(batch.lengths(), micro_batch_tokens) if batch is not None else []
    with torch.no_grad():
        for j in range(max_over_ranks(len(micro), group)):
            mb = batch.select(micro[j]) if j < len(micro) else filler  # type: ignore[union-attr]
            assert mb is not None, "a rank without micro-batches needs a filler"
            logp_BT, _ = token_logprobs(model, mb, temperature)
            if j < len(micro):
                _scatter(out_BT, micro[j], logp_BT)
    model.train(was_training)
    return out_BT


def _scatter(full_BT: Tensor, rows: list[int], part_BT: Tensor) -> None:
    full_BT[torch.tensor(rows, dtype=torch.long), : part_BT.shape[1]] = part_BT.detach().float().cpu()


def _take(x_BT: Tensor, rows: list[int], width: int) -> Tensor:
    return x_BT.index_select(0, torch.tensor(rows, dtype=torch.long))[:, :width]


@dataclass
class _Part:
    """Detached results of one forward (CPU): π_θ and entropy of its rows, π_prox, loss stats."""

    logp_BT: Tensor
    prox_BT: Tensor
    entropy_BT: Tensor
    stats: dict[str, Tensor]


def _micro_batch_loss(model: Any, mb: Batch, adv_BT: Tensor, prox_BT: Tensor | None, cfg: ObjectiveConfig,
                      counts: GlobalCounts, temperature: float, entropy_coef: float,
                      ref_BT: Tensor | None = None, kl: Any = None) -> tuple[Tensor, _Part]:
    """The decoupled loss of one micro-batch scaled by the update's global counts, so the
    micro-batch losses (and gradients) of an update sum to the full update's. π_prox is this
    forward, detached, when `prox_BT` is None (one update per batch, no dropout). With `ref_BT`
    (π_ref's log-probs) and `kl` (`learner.reference`) whose ``kl_coef`` is above 0 the
    KL-to-reference term is added, scaled by the same counts."""
    device = model_device(model)
    logp_BT, entropy_BT = token_logprobs(model, mb, temperature)
    dev = mb.to(device)
    prox = logp_BT.detach() if prox_BT is None else prox_BT.to(device)
    loss, stats = decoupled_ppo_loss(logp_BT, prox, dev.behavior_logp_BT, adv_BT.to(device), dev.mask_BT, cfg,
                                     global_token_count=counts.tokens, global_sequence_count=counts.sequences,
                                     sequence_weight_B=dev.row_share_B)
    if entropy_coef:
        loss = loss - entropy_coef * (entropy_BT * dev.mask_BT).sum() / max(counts.tokens, 1.0)
    if ref_BT is not None and kl is not None and kl.kl_coef > 0:
        term, _ = reference_kl_loss(logp_BT, ref_BT.to(device), dev.mask_BT, cfg, estimator=kl.estimator,
                                    coef=kl.kl_coef, aggregation=kl.aggregation,
                                    global_token_count=counts.tokens, global_sequence_count=counts.sequences,
                                    sequence_weight_B=dev.row_share_B)
        loss = loss + term
    stats = {k: v.detach().cpu() for k, v in stats.items()}
    return loss, _Part(logp_BT.detach().float().cpu(), prox.detach().float().cpu(),
                       entropy_BT.detach().float().cpu(), stats)


def _metrics(batch: Batch, adv_BT: Tensor, logp_BT: Tensor, prox_BT: Tensor, entropy_BT: Tensor,
             stats: dict[str, Tensor], cfg: ObjectiveConfig, version: int, max_lag: int) -> dict[str, float]:
    _, w_raw_BT, kept_BT = behavior_weight(prox_BT, batch.behavior_logp_BT, batch.mask_BT, cfg)
    return step_metrics(
        logp_BT=logp_BT, prox_logp_BT=prox_BT, behavior_logp_BT=batch.behavior_logp_BT,
        adv_BT=adv_BT, mask_BT=batch.mask_BT, w_raw_BT=w_raw_BT, kept_mask_BT=kept_BT, loss_stats=stats,
        cfg=cfg, entropy_BT=entropy_BT, action_type_BT=batch.action_type_BT, current_version=version,
        versions_BT=batch.versions_BT, max_lag=max_lag,
    )


# ------------------------------------------------------------------ the learner step: K × E updates

_WEIGHTED_STATS = ("clip_low_frac", "clip_high_frac", "dual_clip_frac", "ratio_outside_frac", "ratio_mean",
                   "weight_mean", "mis_rejected_frac")


def _merge_stats(parts: list[dict[str, Tensor]]) -> dict[str, Tensor]:
    """Stats of several loss calls as one: losses add (each was scaled by the global count),
    fractions are token-weighted means."""
    n = sum(float(p["num_tokens"]) for p in parts)
    out = {"loss": sum((p["loss"] for p in parts), torch.zeros(())), "num_tokens": torch.tensor(n),
           "denominator": parts[-1]["denominator"]}
    for key in _WEIGHTED_STATS:
        out[key] = torch.tensor(sum(float(p[key]) * float(p["num_tokens"]) for p in parts) / max(n, 1.0))
    return out


def _merge_stats_over_ranks(parts: list[dict[str, Tensor]], group: Any) -> dict[str, Tensor]:
    """:func:`_merge_stats` over the loss calls of every rank in `group` (a rank with none adds nothing)."""
    sums = [sum(float(p["num_tokens"]) for p in parts), sum(float(p["loss"]) for p in parts),
            *(sum(float(p[key]) * float(p["num_tokens"]) for p in parts) for key in _WEIGHTED_STATS)]
    sums = sum_over_ranks(sums, group)
    n = sums[0]
    out = {"loss": torch.tensor(sums[1]), "num_tokens": torch.tensor(n),
           "denominator": parts[-1]["denominator"] if parts else torch.zeros(())}
    for key, total in zip(_WEIGHTED_STATS, sums[2:], strict=True):
        out[key] = torch.tensor(total / max(n, 1.0))
    return out


@dataclass(frozen=True)
class StepPlan:
    """How one learner step spends its batch (from ``learner.*``; see trajmesh/config.py)."""

    micro_batch_tokens: int
    minibatches: int = 1
    epochs: int = 1

    @property
    def updates(self) -> int:
        return self.minibatches * self.epochs


def accumulate_update(engine: Any, batch: Batch | None, adv_BT: Tensor, prox_BT: Tensor | None,
                      cfg: ObjectiveConfig, *, temperature: float, entropy_coef: float, micro_batch_tokens: int,
                      group: Any = None, filler: Batch | None = None,
                      loss_scale: float = 1.0, ref_BT: Tensor | None = None,
                      kl: Any = None) -> list[tuple[list[int], _Part]]:
    """Forward + backward of every micro-batch of `batch` (gradients accumulate; the caller steps).

    The losses are scaled by `batch`'s global counts (all-reduced over `group`), so the accumulated
    gradient is the gradient of one forward over the whole batch (on all ranks). With several ranks,
    `loss_scale` = world size undoes the engine's gradient averaging, and a rank with fewer
    micro-batches (or none: `batch` None) runs zero-loss forwards of `filler` so that every rank
    runs as many forwards and backwards (ZeRO's collectives). `ref_BT` and `kl`: the reference's
    log-probs of `batch` and `learner.reference` (the KL-to-reference term; None: none)."""
    mask_BT = batch.mask_BT if batch is not None else torch.zeros((0, 1))
    counts = global_counts(mask_BT, group, batch.row_share_B if batch is not None else None)
    micro = pack_micro_batches(batch.lengths(), micro_batch_tokens) if batch is not None else []
    n = max_over_ranks(len(micro), group)
    parts = []
    for j in range(n):
        if j >= len(micro):
            assert filler is not None, "a rank without micro-batches needs a filler"
            logp_BT, entropy_BT = token_logprobs(engine.module, filler, temperature)
            engine.backward((logp_BT.sum() + entropy_BT.sum()) * 0.0, boundary=j == n - 1)
            continue
        rows = micro[j]
        mb = batch.select(rows)  # type: ignore[union-attr]
        width = mb.input_ids_BT.shape[1]
        prox = None if prox_BT is None else _take(prox_BT, rows, width)
        ref = None if ref_BT is None else _take(ref_BT, rows, width)
        loss, part = _micro_batch_loss(engine.module, mb, _take(adv_BT, rows, width), prox, cfg, counts,
                                       temperature, entropy_coef, ref, kl)
        engine.backward(loss * loss_scale if loss_scale != 1.0 else loss, boundary=j == n - 1)
        parts.append((rows, part))
    return parts


def train_batch(engine: Any, batch: Batch, adv_BT: Tensor, cfg: ObjectiveConfig, plan: StepPlan, *,
                temperature: float, version: int, max_lag: int, entropy_coef: float = 0.0,
                group: Any = None, reference: Any = None, kl: Any = None) -> dict[str, Any]:
    """One learner step: K minibatches × E epochs of optimizer updates over `batch` (docs/DESIGN.md §4).

    With K·E > 1, π_prox comes from one no-grad pass before the first update and every update uses
    it, so r = π_θ/π_prox moves away from 1 and the clip binds. With K·E = 1 and no dropout, π_prox
    is the training forward detached (r ≡ 1: the clip is inert). Returns the step metrics (over
    the tokens of each minibatch's first epoch), the optimizer stats of the last update, and
    ``ppo_updates``: per update its loss, clip fractions, ratio spread, KL(π_prox ‖ π_θ), grad norm
    and the lr it stepped with.

    With several ranks in `group` every rank passes the same whole `batch` and `adv_BT`; each
    minibatch is split over the ranks balanced by tokens (so an update sees the same rows as with
    one rank) and the denominators are global. The step metrics are over the whole batch (each
    rank's rows and loss stats all-reduced: every rank reports what one rank would); in
    ``ppo_updates`` each update's figures are over its whole minibatch too.

    `reference` (a :class:`~trajmesh.learner.reference.ReferencePolicy`) and `kl`
    (`learner.reference`): π_ref's log-probs come from one no-grad pass before the first update;
    the KL-to-reference term joins every update's loss when ``kl.kl_coef`` > 0, and the step
    reports KL(π_θ ‖ π_ref) (``trajmesh_learner_reference_kl_k1/k2/k3``, at the first epoch's
    forwards) and the term's value (``trajmesh_learner_reference_kl_loss``) either way.
    """
    world = _check_ranks(engine, batch, group)
    shares = _rank_shares(batch, plan.minibatches, group)
    minibatch_rows = balanced_split(batch.lengths(), plan.minibatches)  # every rank's rows of each update
    mine = sorted({i for rows in shares for i in rows})
    filler = batch.select([0])
    model = engine.module
    prox_BT = None
    if not (plan.updates == 1 and is_deterministic(model)):
        prox_mine = proximal_logprobs(model, batch.select(mine) if mine else None, temperature,
                                      plan.micro_batch_tokens, group, filler)
        prox_BT = torch.zeros(batch.mask_BT.shape)
        if mine:
            _scatter(prox_BT, mine, prox_mine)
    ref_BT = None
    if reference is not None:
        ref_mine = proximal_logprobs(reference.module, batch.select(mine) if mine else None, temperature,
                                     plan.micro_batch_tokens, group, filler)
        ref_BT = torch.zeros(batch.mask_BT.shape)
        if mine:
            _scatter(ref_BT, mine, ref_mine)
    logp_BT, prox_seen_BT, ent_BT = (torch.zeros(batch.mask_BT.shape) for _ in range(3))
    stats_all: list[dict[str, Tensor]] = []
    updates: list[dict[str, float]] = []
    opt: dict[str, float] = {}
    for epoch in range(plan.epochs):
        for u, rows in enumerate(shares):
            sub = batch.select(rows) if rows else None
            width = sub.input_ids_BT.shape[1] if sub is not None else 1
            parts = accumulate_update(engine, sub, _take(adv_BT, rows, width),
                                      None if prox_BT is None else _take(prox_BT, rows, width), cfg,
                                      temperature=temperature, entropy_coef=entropy_coef,
                                      micro_batch_tokens=plan.micro_batch_tokens, group=group, filler=filler,
                                      loss_scale=float(world),
                                      ref_BT=None if ref_BT is None else _take(ref_BT, rows, width), kl=kl)
            opt = engine.step()
            if world > 1:
                updates.append(_update_record_over_ranks(batch, rows, minibatch_rows[u], parts, opt, group))
            else:
                updates.append(_update_record(sub, parts, opt, group))
            stats_all.extend(p.stats for _, p in parts)
            for mrows, p in parts if epoch == 0 else []:
                full_rows = [rows[i] for i in mrows]
                _scatter(logp_BT, full_rows, p.logp_BT)
                _scatter(prox_seen_BT, full_rows, p.prox_BT)
                _scatter(ent_BT, full_rows, p.entropy_BT)
    metrics = _step_record(batch, mine, adv_BT, (logp_BT, prox_seen_BT, ent_BT), stats_all, updates, opt, cfg,
                           version, max_lag, across_ranks=world > 1, group=group)
    if ref_BT is not None:
        metrics.update(_reference_record(batch, mine, logp_BT, ref_BT, cfg, kl, across_ranks=world > 1,
                                         group=group))
    return metrics


def _reference_record(batch: Batch, mine: list[int], logp_BT: Tensor, ref_BT: Tensor, cfg: ObjectiveConfig,
                      kl: Any, *, across_ranks: bool, group: Any) -> dict[str, float]:
    """KL(π_θ ‖ π_ref) over the whole batch (k1/k2/k3 on the first epoch's π_θ; each rank's rows
    summed over the ranks first) and the KL term's value there, coefficient included."""
    if across_ranks:
        logp_BT, ref_BT = sum_tensor_over_ranks(logp_BT, group), sum_tensor_over_ranks(ref_BT, group)
        mine = list(range(len(batch.trajectory_ids)))
    local = batch.select(mine)
    width = local.input_ids_BT.shape[1]
    logp_BT, ref_BT = _take(logp_BT, mine, width), _take(ref_BT, mine, width)
    est = kl_estimates(ref_BT, logp_BT, local.mask_BT)  # x = log π_ref − log π_θ: KL(π_θ ‖ π_ref)
    coef = float(kl.kl_coef) if kl is not None else 0.0
    term, _ = reference_kl_loss(logp_BT, ref_BT, local.mask_BT, cfg, estimator=kl.estimator if kl else "k3",
                                coef=coef, aggregation=kl.aggregation if kl else "objective",
                                sequence_weight_B=local.row_share_B)
    return {"trajmesh_learner_reference_kl_k1": est["k1"], "trajmesh_learner_reference_kl_k2": est["k2"],
            "trajmesh_learner_reference_kl_k3": est["k3"], "trajmesh_learner_reference_kl_loss": float(term)}


def _step_record(batch: Batch, mine: list[int], adv_BT: Tensor, seen: tuple[Tensor, Tensor, Tensor],
                 stats_all: list[dict[str, Tensor]], updates: list[dict[str, float]], opt: dict[str, float],
                 cfg: ObjectiveConfig, version: int, max_lag: int, *, across_ranks: bool = False,
                 group: Any = None) -> dict[str, Any]:
    """The step's metrics over the whole batch, plus the optimizer and per-update records. With
    several ranks (`group`), each rank's π_θ, π_prox and entropy of its rows (disjoint, zeros
    elsewhere) and its loss stats are summed over the ranks first, so every rank reports what one
    rank would."""
    if across_ranks:
        seen = (sum_tensor_over_ranks(seen[0], group), sum_tensor_over_ranks(seen[1], group),
                sum_tensor_over_ranks(seen[2], group))
        mine = list(range(len(batch.trajectory_ids)))
    local = batch.select(mine)
    width = local.input_ids_BT.shape[1]
    logp_BT, prox_BT, ent_BT = (_take(x, mine, width) for x in seen)
    merged = _merge_stats_over_ranks(stats_all, group) if across_ranks else _merge_stats(stats_all)
    merged["loss"] = torch.tensor(sum(u["loss"] for u in updates) / len(updates))  # mean over updates
    metrics: dict[str, Any] = _metrics(local, _take(adv_BT, mine, width), logp_BT, prox_BT, ent_BT, merged, cfg,
                                       version, max_lag)
    metrics.update(opt)
    metrics.update(_trust_region_summary(updates))
    metrics["ppo_updates"] = updates
    return metrics


def _check_ranks(engine: Any, batch: Batch, group: Any) -> int:
    """The world size, after checking the engine averages gradients over ranks when there are several."""
    world = data_parallel(group)[1]
    if world > 1 and not getattr(engine, "data_parallel", False):
        raise ValueError(f"{type(engine).__name__} does not average gradients over ranks; use deepspeed")
    if len(batch.trajectory_ids) < world:
        raise ValueError(f"a batch of {len(batch.trajectory_ids)} trajectories cannot feed {world} ranks")
    return world


def _rank_shares(batch: Batch, minibatches: int, group: Any) -> list[list[int]]:
    """Per minibatch (balanced by tokens over the batch), this rank's rows (balanced by tokens over
    the ranks; possibly none). With one rank: the minibatches themselves."""
    rank, world = data_parallel(group)
    lengths = batch.lengths()
    out = []
    for rows in balanced_split(lengths, minibatches):
        share = balanced_split([lengths[i] for i in rows], world, keep_empty=True)[rank]
        out.append([rows[i] for i in share])
    return out


def _update_record(sub: Batch | None, parts: list[tuple[list[int], _Part]], opt: dict[str, float],
                   group: Any = None) -> dict[str, float]:
    """Loss, clip fractions, ratio spread and KL(π_prox ‖ π_θ) of one update, as its loss saw them
    (the loss summed over ranks, the rest over this rank's share)."""
    keys = ("clip_low_frac", "clip_high_frac", "dual_clip_frac", "ratio_outside_frac")
    if sub is None or not parts:
        record = {"loss": 0.0, **dict.fromkeys(keys, 0.0), **trust_region_metrics(*(torch.zeros(1, 1),) * 3)}
    else:
        logp_BT, prox_BT = torch.zeros(sub.mask_BT.shape), torch.zeros(sub.mask_BT.shape)
        for rows, p in parts:
            _scatter(logp_BT, rows, p.logp_BT)
            _scatter(prox_BT, rows, p.prox_BT)
        stats = _merge_stats([p.stats for _, p in parts])
        record = {"loss": float(stats["loss"]), **{k: float(stats[k]) for k in keys}}
        record.update(trust_region_metrics(logp_BT, prox_BT, sub.mask_BT))
    record["loss"] = sum_over_ranks([record["loss"]], group)[0]
    record["grad_norm"] = float(opt.get("grad_norm", 0.0))
    record["lr"] = float(opt.get("lr", 0.0))
    return record


def _update_record_over_ranks(batch: Batch, rows: list[int], minibatch_rows: list[int],
                              parts: list[tuple[list[int], _Part]], opt: dict[str, float],
                              group: Any) -> dict[str, float]:
    """:func:`_update_record` over the whole minibatch (`minibatch_rows`): this rank's π_θ and π_prox
    of its `rows` and its loss stats are summed with the other ranks' (rows are disjoint)."""
    logp_BT, prox_BT = torch.zeros(batch.mask_BT.shape), torch.zeros(batch.mask_BT.shape)
    for mrows, p in parts:
        full_rows = [rows[i] for i in mrows]
        _scatter(logp_BT, full_rows, p.logp_BT)
        _scatter(prox_BT, full_rows, p.prox_BT)
    logp_BT, prox_BT = sum_tensor_over_ranks(logp_BT, group), sum_tensor_over_ranks(prox_BT, group)
    stats = _merge_stats_over_ranks([p.stats for _, p in parts], group)
    keys = ("clip_low_frac", "clip_high_frac", "dual_clip_frac", "ratio_outside_frac")
    record = {"loss": float(stats["loss"]), **{k: float(stats[k]) for k in keys}}
    sub = batch.select(minibatch_rows)
    width = sub.input_ids_BT.shape[1]
    record.update(trust_region_metrics(_take(logp_BT, minibatch_rows, width), _take(prox_BT, minibatch_rows, width),
                                       sub.mask_BT))
    record["grad_norm"] = float(opt.get("grad_norm", 0.0))
    record["lr"] = float(opt.get("lr", 0.0))
    return record


def _trust_region_summary(updates: list[dict[str, float]]) -> dict[str, float]:
    """Step-level gauges: the number of updates and each trust-region figure at the last update
    (the one furthest from π_prox), plus the largest clip fraction of any update."""
    last = updates[-1]
    return {"trajmesh_learner_ppo_updates": float(len(updates)),
            **{k: v for k, v in last.items() if k.startswith("trajmesh_learner_")},
            "trajmesh_learner_update_ratio_outside_max_ratio": max(u["ratio_outside_frac"] for u in updates)}
