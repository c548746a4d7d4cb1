"""PRIME's online implicit process reward model on the learner (`learner.prime`, survey §7.4).

::

    batch ─▶ π_ref log-probs (frozen start, no grad)
          ─▶ πφ forward with grad, micro-batches of whole trajectories
             ─▶ BCE on β·Σ_t(log πφ − log π_ref) vs the outcome label (learner/objective.py)
             ─▶ backward, one optimizer step of the PRM's own engine
          ─▶ token rewards r_t = β(log πφ − log π_ref)  (update "before": a second no-grad forward
             of the updated PRM; "after": the update's own forward)
          ─▶ the recipe's PRIME advantage (learner/advantages.py ``prime_advantages_BT``)

:class:`ImplicitPRM` holds πφ (a copy of the policy module at the learner's start, in a train engine
of the policy's type) and π_ref (a :class:`~trajmesh.learner.reference.ReferencePolicy` of the same
start, or the learner's own reference when that one never resets). The learner service builds it
before the policy's engine and checkpoints it beside the policy (``prm/`` in the checkpoint), so a
resumed learner's PRM is the one it had. One rank, no ZeRO-3 (the config refuses the rest).
"""

from __future__ import annotations

import copy
import time
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from trajmesh.config import PrimeConfig
from trajmesh.learner.advantages import implicit_process_rewards
from trajmesh.learner.microbatch import pack_micro_batches
from trajmesh.learner.objective import implicit_prm_loss
from trajmesh.learner.reference import ReferencePolicy
from trajmesh.learner.step import Batch, _scatter, proximal_logprobs, token_logprobs
from trajmesh.learner.train_engine import TrainEngine, build_train_engine

__all__ = ["ImplicitPRM", "outcome_labels", "trajectory_micro_batches"]

_DIR = "prm"


def outcome_labels(batch: Batch, threshold: float) -> Tensor:
    """Each trajectory's outcome label (1.0: reward ≥ `threshold`, else 0.0), [J] in row order."""
    return (batch.trajectory_rewards() >= threshold).float()


def trajectory_micro_batches(batch: Batch, budget_tokens: int) -> list[list[int]]:
    """Row groups of whole trajectories (a sequence logit needs all its rows in one forward), packed
    by each trajectory's padded tokens (its rows × its longest row) within `budget_tokens`."""
    rows_B = batch.trajectory_rows().tolist()
    rows_of: dict[int, list[int]] = {}
    for r, j in enumerate(rows_B):
        rows_of.setdefault(j, []).append(r)
    lengths = batch.lengths()
    trajs = list(rows_of.values())
    cost = [len(rows) * max(lengths[r] for r in rows) for rows in trajs]
    return [sorted(r for j in group for r in trajs[j]) for group in pack_micro_batches(cost, budget_tokens)]


class ImplicitPRM:
    """πφ and its frozen π_ref (see the module doc)."""

    def __init__(self, policy_module: nn.Module, cfg: PrimeConfig, *, engine_type: str, zero_stage: int,
                 precision: str, seed: int, deterministic: bool, micro_batch_tokens: int,
                 reference: ReferencePolicy | None = None) -> None:
        """`policy_module`: the policy's module before its train engine is built (copied here).
        `reference`: a frozen copy of the same start to share (None: one of its own)."""
        self.cfg = cfg
        self.micro_batch_tokens = micro_batch_tokens
        self.reference = reference if reference is not None else ReferencePolicy(
            policy_module, engine_type, zero_stage=zero_stage, precision=precision)
        self.engine: TrainEngine = build_train_engine(
            copy.deepcopy(policy_module), type=engine_type, lr=cfg.lr, warmup_steps=0, weight_decay=0.0,
            grad_clip=cfg.grad_clip, zero_stage=zero_stage, seed=seed, precision=precision,
            deterministic=deterministic)

    def step(self, batch: Batch) -> tuple[Tensor, dict[str, float]]:
        """One PRM update on `batch` → (r_BT, metrics): the token rewards the advantage uses (CPU,
        0 off the mask) and the PRM's loss, accuracy on the outcome label (both before its update),
        grad norm, mean token reward and the seconds the whole PRM step took."""
        start = time.perf_counter()
        cfg = self.cfg
        label_J = outcome_labels(batch, cfg.label_threshold)
        rows_B = batch.trajectory_rows()
        ref_BT = proximal_logprobs(self.reference.module, batch, 1.0, self.micro_batch_tokens)
        model = self.engine.module
        model.train()
        prm_BT = torch.zeros(batch.mask_BT.shape)
        stats: list[dict[str, Tensor]] = []
        for rows in trajectory_micro_batches(batch, self.micro_batch_tokens):
            mb = batch.select(rows)
            width = mb.input_ids_BT.shape[1]
            mb_rows_B = rows_B[rows]
            trajs, local_B = torch.unique(mb_rows_B, return_inverse=True)
            logp_BT, _ = token_logprobs(model, mb, 1.0)
            loss, part = implicit_prm_loss(logp_BT, ref_BT[rows, :width].to(logp_BT.device), mb.mask_BT.to(logp_BT.device),
                                           label_J[trajs], beta=cfg.beta, trajectory_index_B=local_B,
                                           global_trajectory_count=float(label_J.shape[0]))
            self.engine.backward(loss)
            stats.append({k: v.detach().cpu() for k, v in part.items()})
            _scatter(prm_BT, rows, logp_BT)
        opt = self.engine.step()
        if cfg.update == "before":
            prm_BT = proximal_logprobs(model, batch, 1.0, self.micro_batch_tokens)
        r_BT = implicit_process_rewards(prm_BT, ref_BT, batch.mask_BT, cfg.beta)
        mask = batch.mask_BT > 0
        n = float(sum(float(s["prm_trajectories"]) for s in stats))
        metrics = {
            "trajmesh_learner_prm_loss": float(sum(float(s["prm_loss"]) for s in stats)),
            "trajmesh_learner_prm_accuracy_ratio": float(sum(float(s["prm_correct"]) for s in stats)) / max(n, 1.0),
            "trajmesh_learner_prm_positive_label_ratio": float(label_J.mean()) if len(label_J) else 0.0,
            "trajmesh_learner_prm_grad_norm": float(opt.get("grad_norm", 0.0)),
            "trajmesh_learner_prm_token_reward_mean": float(r_BT[mask].mean()) if bool(mask.any()) else 0.0,
            "trajmesh_learner_prm_step_seconds": time.perf_counter() - start,
        }
        return r_BT, metrics

    def save(self, directory: str | Path) -> None:
        """The PRM's weights, optimizer and step count into ``directory/prm`` (its reference is the
        run's start: nothing to write)."""
        self.engine.save_checkpoint(Path(directory) / _DIR)

    def load(self, directory: str | Path) -> None:
        """Restore what :meth:`save` wrote (a checkpoint without ``prm/`` is an error: PRIME was
        not on when it was written)."""
        path = Path(directory) / _DIR
        if not path.is_dir():
            raise FileNotFoundError(f"no PRM in {directory}: the checkpoint was written without learner.advantage prime")
        state: dict[str, Any] = self.engine.load_checkpoint(path)
        del state
