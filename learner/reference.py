"""The frozen reference policy on the learner (`learner.reference`, survey §4.4 ProRL).

A :class:`ReferencePolicy` is a copy of the policy module (a :class:`~trajmesh.learner.logprobs.PolicyLogprobs`)
taken before the train engine wraps the policy, placed like the policy:

* torch engine: the module itself (under bf16 autocast when the engine trains in bf16), no grad;
* DeepSpeed engine: a second ``deepspeed.initialize`` without an optimizer, with the policy's ZeRO
  stage and bf16 setting, so under ZeRO-3 its parameters are partitioned over the ranks exactly as
  the policy's are (each rank holds the same slice of each parameter of both). Under ZeRO-3 the
  learner service builds it after the policy's engine instead
  (:meth:`ReferencePolicy.after_zero3_engine`): a skeleton created under ``deepspeed.zero.Init``,
  filled from the policy's partitions, so no rank copies the whole module.

Its log-probs come from :func:`trajmesh.learner.step.proximal_logprobs` (no grad, eval mode,
micro-batched, collective-balanced over ranks). :meth:`reset_from` copies the policy's current
parameters into it (ZeRO-3: each rank copies its own partitions, no communication).

Checkpoint: ``version`` is the policy version the reference holds (0: the initial model). A
reference at version 0 is the model the learner starts from, so nothing is written; after a reset
:meth:`save` writes ``reference.pt`` (ZeRO-3: ``reference-rank{r}.pt``, this rank's partitions)
into the checkpoint directory and :meth:`load` restores it, so a resumed learner's reference is
bitwise the one it had.
"""

from __future__ import annotations

import copy
import os
from pathlib import Path
from typing import Any

import torch
from torch import nn

from trajmesh.learner.train_engine import (
    DeepSpeedTrainEngine,
    TrainEngine,
    _Autocast,
    _zero_config,
    ensure_distributed,
)

__all__ = ["ReferencePolicy"]

_FILE = "reference.pt"


def _local(p: nn.Parameter, zero3: bool) -> torch.Tensor:
    """The tensor this rank holds of `p`: its ZeRO-3 partition (``ds_tensor``) or `p` itself."""
    return getattr(p, "ds_tensor") if zero3 else p  # noqa: B009 - DeepSpeed's attribute, untyped


def _rank() -> int:
    dist = torch.distributed
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


class ReferencePolicy:
    """A frozen copy of the policy module, placed and sharded like the policy (see the module doc)."""

    def __init__(self, policy_module: nn.Module, engine_type: str, *, zero_stage: int = 0,
                 precision: str = "fp32", built: nn.Module | None = None) -> None:
        """`policy_module`: the module the train engine is about to be built around (copied here,
        so build this first: DeepSpeed partitions the policy's parameters in place). `built`: a
        module to use instead of the copy (:meth:`after_zero3_engine`)."""
        module = built if built is not None else copy.deepcopy(policy_module)
        for p in module.parameters():
            p.requires_grad_(False)
        module.eval()
        self.version = 0
        """The policy version whose weights the reference holds (0: the initial model)."""
        self.zero3 = False
        self._engine: Any = None
        if engine_type == "deepspeed":
            import deepspeed

            ensure_distributed("gloo" if not torch.cuda.is_available() else "nccl")

            ds_stage = 1 if precision == "bf16" and zero_stage == 0 else int(zero_stage)
            world = torch.distributed.get_world_size()
            config = {"train_batch_size": world, "train_micro_batch_size_per_gpu": 1,
                      "gradient_accumulation_steps": 1, "zero_optimization": _zero_config(ds_stage, module),
                      "fp16": {"enabled": False}, "bf16": {"enabled": precision == "bf16"},
                      "steps_per_print": 2**31 - 1, "wall_clock_breakdown": False}
            if ds_stage != 3:  # no optimizer: ZeRO 1-2 partition nothing; the module is replicated
                config["zero_optimization"] = {"stage": 0}
            self.zero3 = ds_stage == 3
            self._engine, *_ = deepspeed.initialize(model=module, config=config, dist_init_required=False)
            self._engine.eval()
            self._module: nn.Module = self._engine
            self._inner: nn.Module = self._engine.module
        else:
            self._inner = module
            self._module = _Autocast(module) if precision == "bf16" else module

    @classmethod
    def after_zero3_engine(cls, engine: DeepSpeedTrainEngine, *, precision: str = "fp32") -> ReferencePolicy:
        """ZeRO-3 without a whole copy on any rank: the reference is built after the policy's engine,
        its parameters partitioned as they are created (``deepspeed.zero.Init``), then filled from
        the policy's partitions by :meth:`reset_from` (version 0, no communication). A rank then
        holds its partitions and, while the skeleton is built, one whole parameter at a time, where
        a copy taken before the engine is the whole module on every rank until DeepSpeed partitions
        it (bench/bench_learner.py builds both; on CPU its peak RSS is too noisy to tell them apart)."""
        import deepspeed

        from trajmesh.learner.logprobs import PolicyLogprobs

        policy = engine.model
        hf = policy.policy
        world = torch.distributed.get_world_size()
        config = {"train_batch_size": world, "train_micro_batch_size_per_gpu": 1,
                  "zero_optimization": _zero_config(3, policy), "bf16": {"enabled": precision == "bf16"}}
        with deepspeed.zero.Init(config_dict_or_path=config):
            skeleton = type(hf)._from_config(hf.config, dtype=hf.dtype)  # random init, partitioned as built
        ref = cls(policy, "deepspeed", zero_stage=3, precision=precision,
                  built=PolicyLogprobs(skeleton, policy.chunk_tokens))
        ref.reset_from(engine, 0)
        return ref

    @classmethod
    def for_engine(cls, policy_module: nn.Module, engine_type: str, *, zero_stage: int,
                   precision: str) -> ReferencePolicy:
        """The reference for a policy about to be wrapped by an engine of `engine_type`."""
        return cls(policy_module, engine_type, zero_stage=zero_stage, precision=precision)

    @property
    def module(self) -> nn.Module:
        """The module to call for the reference's forward (a DeepSpeed engine, or the copy)."""
        return self._module

    def _pairs(self, engine: TrainEngine) -> list[tuple[nn.Parameter, nn.Parameter]]:
        ref = dict(self._inner.named_parameters())
        pol = dict(engine.model.named_parameters())
        if ref.keys() != pol.keys():
            raise ValueError("the reference and the policy have different parameters")
        return [(ref[k], pol[k]) for k in ref]

    @torch.no_grad()
    def reset_from(self, engine: TrainEngine, version: int) -> None:
        """The reference becomes the policy's current weights (the ones of `version`)."""
        zero3 = self.zero3 and isinstance(engine, DeepSpeedTrainEngine)
        for r, p in self._pairs(engine):
            _local(r, zero3).copy_(_local(p, zero3))
        self.version = int(version)

    def _path(self, directory: str | os.PathLike[str]) -> Path:
        name = f"reference-rank{_rank()}.pt" if self.zero3 else _FILE
        return Path(directory) / name

    def _tensors(self) -> dict[str, torch.Tensor]:
        return {k: _local(p, self.zero3).detach().to("cpu", copy=True)
                for k, p in self._inner.named_parameters()}

    def save(self, directory: str | os.PathLike[str]) -> None:
        """Write the reference into a checkpoint directory (nothing at version 0, see the module doc;
        without ZeRO-3 rank 0 alone writes)."""
        if self.version == 0 or (not self.zero3 and _rank() != 0):
            return
        torch.save({"version": self.version, "parameters": self._tensors()}, self._path(directory))

    @torch.no_grad()
    def load(self, directory: str | os.PathLike[str]) -> None:
        """Restore what :meth:`save` wrote; no file: the initial model (version 0), as built."""
        path = self._path(directory)
        if not path.is_file():
            if self.version != 0:
                raise FileNotFoundError(f"no reference in {directory} for a reference at version {self.version}")
            return
        payload = torch.load(path, map_location="cpu", weights_only=True)
        for k, p in self._inner.named_parameters():
            _local(p, self.zero3).copy_(payload["parameters"][k])
        self.version = int(payload["version"])
