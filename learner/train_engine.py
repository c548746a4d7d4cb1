"""Train engines: the optimizer side of the learner behind one small interface.

Two implementations, picked by ``type`` through :data:`TRAIN_ENGINES`:

* ``"torch"``: :class:`TorchTrainEngine`, plain ``torch.optim.AdamW``; the fallback and the reference.
* ``"deepspeed"``: :class:`DeepSpeedTrainEngine`, ``deepspeed.initialize`` with the ZeRO stage from
  the config, fp32 or bf16 (fp32 master weights), the same AdamW handed in as a client optimizer, gradient clipping done by DeepSpeed.
  On a CPU-only host it runs with ``DS_ACCELERATOR=cpu`` and the ``gloo`` backend; a single process
  gets a world of size 1 (see :func:`ensure_distributed`).

Both engines share the learning-rate schedule (:func:`lr_at`: linear warmup, then constant or a
linear / cosine decay to ``min_lr_ratio`` x lr at ``decay_steps``; counted in optimizer updates), the
optimizer construction and the RNG handling, so with the same seed, model and data they produce the
same trajectory up to float reduction order (ZeRO flattens parameters, which changes the order of the
grad-norm sum).

Contract of one optimizer step::

    for i, micro_batch in enumerate(micro_batches):      # gradient accumulation
        loss = compute_loss(engine.module, micro_batch)  # scaled by the update's global counts
        engine.backward(loss, boundary=i == len(micro_batches) - 1)
    stats = engine.step()     # clip, AdamW step, advance lr schedule, zero the grads
    # stats == {"grad_norm": <total L2 norm before clipping>, "lr": <lr used for this step>}

``deepspeed`` is imported lazily, inside :class:`DeepSpeedTrainEngine` only, so that importing this
module (and using the torch engine) never needs it.
"""

from __future__ import annotations

import abc
import contextlib
import math
import os
import random
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from trajmesh.infra import free_port

__all__ = [
    "TRAIN_ENGINES",
    "DeepSpeedTrainEngine",
    "TrainSettings",
    "TorchTrainEngine",
    "TrainEngine",
    "build_train_engine",
    "deepspeed_available",
    "ensure_distributed",
    "get_rng_state",
    "lr_at",
    "register_train_engine",
    "seed_everything",
    "set_rng_state",
    "shutdown_distributed",
]

# Keys under which the DeepSpeed engine stores our own data inside DeepSpeed's client_state.
_CLIENT_KEY = "trajmesh_client_state"
_RNG_KEY = "trajmesh_rng_state"
_STEP_KEY = "trajmesh_global_step"
_TORCH_CKPT_FILE = "torch_engine.pt"


# --------------------------------------------------------------------------------------------------
# Config, schedule, RNG
# --------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class TrainSettings:
    """The optimizer settings an engine is built with, resolved from `learner` and `learner.engine`
    of the run config by `build_train_engine` (not a config type: the config's are in trajmesh/config.py)."""

    lr: float
    warmup_steps: int
    weight_decay: float
    grad_clip: float  # <= 0 disables clipping (the norm is still reported)
    seed: int
    schedule: str = "constant"  # after warmup: "constant", "linear" or "cosine" decay
    decay_steps: int = 0  # the optimizer update at which a decay reaches min_lr_ratio x lr
    min_lr_ratio: float = 0.0
    zero_stage: int = 0
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    deterministic: bool = True
    precision: str = "fp32"  # "bf16": bf16 compute with fp32 master weights (see the engines)

    def __post_init__(self) -> None:
        if self.lr <= 0:
            raise ValueError(f"lr must be > 0, got {self.lr}")
        if self.warmup_steps < 0:
            raise ValueError(f"warmup_steps must be >= 0, got {self.warmup_steps}")
        if self.schedule not in LR_SCHEDULES:
            raise ValueError(f"schedule must be one of {LR_SCHEDULES}, got {self.schedule!r}")
        if self.schedule != "constant" and self.decay_steps <= self.warmup_steps:
            raise ValueError(f"a {self.schedule} decay needs decay_steps > warmup_steps, got "
                             f"{self.decay_steps} <= {self.warmup_steps}")
        if not 0.0 <= self.min_lr_ratio <= 1.0:
            raise ValueError(f"min_lr_ratio must be in [0, 1], got {self.min_lr_ratio}")
        if self.zero_stage not in (0, 1, 2, 3):
            raise ValueError(f"zero_stage must be 0..3, got {self.zero_stage}")
        if self.precision not in ("fp32", "bf16"):
            raise ValueError(f"precision must be fp32 or bf16, got {self.precision!r}")


def warmup_factor(step: int, warmup_steps: int) -> float:
    """Multiplier of the base lr for optimizer step ``step`` (0-based).

    Linear warmup over ``warmup_steps`` steps, then constant: step ``s`` uses ``(s + 1) / warmup_steps``
    so that the first step is not wasted at lr 0 and step ``warmup_steps - 1`` is the first at full lr.
    """
    if warmup_steps <= 0:
        return 1.0
    return min(1.0, (step + 1) / warmup_steps)


LR_SCHEDULES = ("constant", "linear", "cosine")


def lr_factor(step: int, warmup_steps: int, schedule: str = "constant", decay_steps: int = 0,
              min_lr_ratio: float = 0.0) -> float:
    """Multiplier of the base lr for optimizer step ``step`` (0-based): the warmup, then constant or
    decayed from 1 at ``warmup_steps`` to ``min_lr_ratio`` at ``decay_steps`` (linear or half a cosine)
    and held there after."""
    if schedule == "constant" or step < warmup_steps:
        return warmup_factor(step, warmup_steps)
    progress = min(1.0, (step - warmup_steps) / (decay_steps - warmup_steps))
    shape = 1.0 - progress if schedule == "linear" else 0.5 * (1.0 + math.cos(math.pi * progress))
    return min_lr_ratio + (1.0 - min_lr_ratio) * shape


def lr_at(step: int, lr: float, warmup_steps: int, schedule: str = "constant", decay_steps: int = 0,
          min_lr_ratio: float = 0.0) -> float:
    """The learning rate used by optimizer step ``step`` (0-based)."""
    return lr * lr_factor(step, warmup_steps, schedule, decay_steps, min_lr_ratio)


def wants_deterministic(setting: str, *, cuda: bool) -> bool:
    """`learner.deterministic`: "on"/"off", or "auto" = on on CPU (bitwise resume), off on CUDA."""
    if setting not in ("auto", "on", "off"):
        raise ValueError(f"learner.deterministic must be auto, on or off, got {setting!r}")
    return setting == "on" or (setting == "auto" and not cuda)


def seed_everything(seed: int, *, deterministic: bool = True) -> None:
    """Seed python ``random``, numpy and torch; optionally ask torch for deterministic kernels.

    ``torch.use_deterministic_algorithms(True, warn_only=True)`` is process-global. On CPU the
    float kernels used here (matmul, reductions, AdamW) are already run-to-run deterministic for a
    fixed thread count; the flag guards against the few nondeterministic ones (index_add & co.)
    without raising on ops that have no deterministic variant.
    """
    random.seed(seed)
    np.random.seed(seed % (2**32))
    torch.manual_seed(seed)
    # The first call imports torch._inductor (~2-4 s once per process in torch 2.13); skip it when
    # already on.
    if deterministic and not (
        torch.are_deterministic_algorithms_enabled() and torch.is_deterministic_algorithms_warn_only_enabled()
    ):
        torch.use_deterministic_algorithms(True, warn_only=True)


def get_rng_state() -> dict[str, Any]:
    state: dict[str, Any] = {
        "python": random.getstate(),
        "numpy": np.random.get_state(),
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def _make_optimizer(model: nn.Module, cfg: TrainSettings) -> torch.optim.AdamW:
    params = [p for p in model.parameters() if p.requires_grad]
    if not params:
        raise ValueError("model has no trainable parameters")
    # foreach=False: the single-tensor path, the same code for per-parameter tensors (torch engine,
    # ZeRO-0) and for ZeRO's flat partitions, so the elementwise update is identical in both.
    return torch.optim.AdamW(
        params,
        lr=cfg.lr,
        betas=(cfg.betas[0], cfg.betas[1]),
        eps=cfg.eps,
        weight_decay=cfg.weight_decay,
        foreach=False,
    )


def _make_scheduler(optimizer: torch.optim.Optimizer, cfg: TrainSettings) -> torch.optim.lr_scheduler.LambdaLR:
    args = (cfg.warmup_steps, cfg.schedule, cfg.decay_steps, cfg.min_lr_ratio)
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: lr_factor(s, *args))


def _zero_optimizer_state(optimizer: torch.optim.Optimizer) -> None:
    """Every tensor of every parameter's state to 0 (AdamW: exp_avg, exp_avg_sq, step), in place,
    so the state's structure (and what a checkpoint of it holds) stays as it was."""
    with torch.no_grad():
        for state in optimizer.state.values():
            for key, value in state.items():
                if isinstance(value, torch.Tensor):
                    value.zero_()
                elif isinstance(value, (int, float)):
                    state[key] = type(value)(0)


def _total_grad_norm(params: Iterator[nn.Parameter] | list[nn.Parameter]) -> float:
    norms = [p.grad.detach().float().norm(2) for p in params if p.grad is not None]
    if not norms:
        return 0.0
    return float(torch.linalg.vector_norm(torch.stack(norms), 2))


# --------------------------------------------------------------------------------------------------
# Interface and registry
# --------------------------------------------------------------------------------------------------


class TrainEngine(abc.ABC):
    """What the learner needs from an optimizer backend."""

    config: TrainSettings
    global_step: int  # optimizer steps taken (restored by load_checkpoint)
    data_parallel: bool = False  # averages gradients over the ranks of the default process group

    @property
    @abc.abstractmethod
    def module(self) -> nn.Module:
        """The module to call for the forward pass (for DeepSpeed: the engine, which wraps the model)."""

    @property
    @abc.abstractmethod
    def model(self) -> nn.Module:
        """The unwrapped model (the one passed to :func:`build_train_engine`)."""

    @abc.abstractmethod
    def backward(self, loss: torch.Tensor, *, boundary: bool = True) -> None:
        """Accumulate the gradient of ``loss``; ``boundary=False`` on every micro-batch of an
        update but the last (DeepSpeed reduces ZeRO gradients at the boundary)."""

    @abc.abstractmethod
    def step(self) -> dict[str, float]:
        """Clip, optimizer step, advance the lr schedule, zero the grads.

        Returns ``{"grad_norm": total L2 norm before clipping, "lr": lr used by this step}``.
        """

    @abc.abstractmethod
    def zero_grad(self) -> None:
        """Drop accumulated gradients without stepping."""

    @abc.abstractmethod
    def save_checkpoint(self, directory: str | os.PathLike[str], client_state: dict | None = None) -> None:
        """Save model, optimizer, lr scheduler, RNG states (torch, numpy, random) and ``client_state``."""

    @abc.abstractmethod
    def load_checkpoint(self, directory: str | os.PathLike[str]) -> dict:
        """Restore everything :meth:`save_checkpoint` wrote; return the saved ``client_state``."""

    def reset_optimizer_state(self) -> None:
        """Zero the optimizer's moments and step counts in place (ProRL's optimizer reset): the
        next :meth:`step` updates as a fresh AdamW would. The lr schedule and the weights stay."""
        _zero_optimizer_state(self._inner_optimizer())

    def _inner_optimizer(self) -> torch.optim.Optimizer:
        """The AdamW whose state holds the moments (under ZeRO: of this rank's flat partitions)."""
        raise NotImplementedError(f"{type(self).__name__} cannot reset its optimizer")

    @property
    def lr(self) -> float:
        """The lr the next :meth:`step` will use."""
        c = self.config
        return lr_at(self.global_step, c.lr, c.warmup_steps, c.schedule, c.decay_steps, c.min_lr_ratio)

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """Detached CPU copies of all model parameters and buffers (gathered under ZeRO-3)."""
        return {k: v.detach().to("cpu", copy=True) for k, v in self.model.state_dict().items()}


TRAIN_ENGINES: dict[str, type[TrainEngine]] = {}


def register_train_engine(name: str) -> Callable[[type[TrainEngine]], type[TrainEngine]]:
    def deco(cls: type[TrainEngine]) -> type[TrainEngine]:
        if name in TRAIN_ENGINES and TRAIN_ENGINES[name] is not cls:
            raise ValueError(f"train engine {name!r} already registered")
        TRAIN_ENGINES[name] = cls
        return cls

    return deco


def build_train_engine(
    model: nn.Module,
    *,
    type: str,  # noqa: A002 - the config key is called "type"
    lr: float,
    warmup_steps: int,
    weight_decay: float,
    grad_clip: float,
    zero_stage: int = 0,
    betas: tuple[float, float] = (0.9, 0.999),
    seed: int,
    eps: float = 1e-8,
    deterministic: bool = True,
    precision: str = "fp32",
    schedule: str = "constant",
    decay_steps: int = 0,
    min_lr_ratio: float = 0.0,
) -> TrainEngine:
    """Build the engine registered under ``type`` (``"torch"`` or ``"deepspeed"``).

    Seeds python/numpy/torch with ``seed`` before building (the model itself is already built, so
    seed it yourself before constructing it if its init must be reproducible).
    """
    try:
        cls = TRAIN_ENGINES[type]
    except KeyError:
        raise ValueError(f"unknown train engine type {type!r}; known: {sorted(TRAIN_ENGINES)}") from None
    cfg = TrainSettings(
        lr=lr,
        warmup_steps=warmup_steps,
        weight_decay=weight_decay,
        grad_clip=grad_clip,
        seed=seed,
        zero_stage=zero_stage,
        betas=(float(betas[0]), float(betas[1])),
        eps=eps,
        deterministic=deterministic,
        precision=precision,
        schedule=schedule,
        decay_steps=decay_steps,
        min_lr_ratio=min_lr_ratio,
    )
    return cls(model, cfg)  # type: ignore[call-arg]


# --------------------------------------------------------------------------------------------------
# Torch engine
# --------------------------------------------------------------------------------------------------


class _Autocast(nn.Module):
    """Runs ``module`` under bf16 autocast: bf16 matmuls, fp32 parameters (the master weights)."""

    def __init__(self, module: nn.Module) -> None:
        super().__init__()
        self.module = module

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        device = next(self.module.parameters()).device.type
        with torch.autocast(device_type=device, dtype=torch.bfloat16):
            return self.module(*args, **kwargs)


@register_train_engine("torch")
class TorchTrainEngine(TrainEngine):
    """Plain ``torch.optim.AdamW`` + ``clip_grad_norm_`` + LambdaLR warmup. ``zero_stage`` is ignored.
    ``precision="bf16"``: forward under bf16 autocast, parameters and optimizer state in fp32."""

    def __init__(self, model: nn.Module, config: TrainSettings) -> None:
        self.config = config
        seed_everything(config.seed, deterministic=config.deterministic)
        self._model = model
        self._module: nn.Module = _Autocast(model) if config.precision == "bf16" else model
        self.optimizer = _make_optimizer(model, config)
        self.scheduler = _make_scheduler(self.optimizer, config)
        self._params = [p for g in self.optimizer.param_groups for p in g["params"]]
        self.global_step = 0

    @property
    def module(self) -> nn.Module:
        return self._module

    @property
    def model(self) -> nn.Module:
        return self._model

    def backward(self, loss: torch.Tensor, *, boundary: bool = True) -> None:
        loss.backward()

    def step(self) -> dict[str, float]:
        clip = self.config.grad_clip
        if clip > 0:
            grad_norm = float(torch.nn.utils.clip_grad_norm_(self._params, clip, foreach=False))
        else:
            grad_norm = _total_grad_norm(self._params)
        lr = float(self.optimizer.param_groups[0]["lr"])
        self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.global_step += 1
        return {"grad_norm": grad_norm, "lr": lr}

    def zero_grad(self) -> None:
        self.optimizer.zero_grad(set_to_none=True)

    def _inner_optimizer(self) -> torch.optim.Optimizer:
        return self.optimizer

    def save_checkpoint(self, directory: str | os.PathLike[str], client_state: dict | None = None) -> None:
        d = Path(directory)
        d.mkdir(parents=True, exist_ok=True)
        payload = {
            "model": self._model.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "scheduler": self.scheduler.state_dict(),
            "global_step": self.global_step,
            _RNG_KEY: get_rng_state(),
            _CLIENT_KEY: dict(client_state or {}),
        }
        tmp = d / (_TORCH_CKPT_FILE + ".tmp")
        torch.save(payload, tmp)
        os.replace(tmp, d / _TORCH_CKPT_FILE)

    def load_checkpoint(self, directory: str | os.PathLike[str]) -> dict:
        path = Path(directory) / _TORCH_CKPT_FILE
        if not path.is_file():
            raise FileNotFoundError(f"no torch engine checkpoint at {path}")
        # weights_only=False: the payload holds numpy/python RNG states. Only load our own checkpoints.
        payload = torch.load(path, map_location="cpu", weights_only=False)
        self._model.load_state_dict(payload["model"])
        self.optimizer.load_state_dict(payload["optimizer"])
        self.scheduler.load_state_dict(payload["scheduler"])
        self.global_step = int(payload["global_step"])
        set_rng_state(payload[_RNG_KEY])
        return payload[_CLIENT_KEY]


# --------------------------------------------------------------------------------------------------
# DeepSpeed engine
# --------------------------------------------------------------------------------------------------


def deepspeed_available() -> bool:
    """True when ``deepspeed`` can be imported (imports it, ~2 s the first time)."""
    _prepare_deepspeed_env()
    try:
        import deepspeed  # noqa: F401
    except Exception:  # ImportError, or a broken build raising at import
        return False
    return True


def _prepare_deepspeed_env() -> None:
    # Must happen before deepspeed picks its accelerator (at first get_accelerator()).
    if "DS_ACCELERATOR" not in os.environ and not torch.cuda.is_available():
        os.environ["DS_ACCELERATOR"] = "cpu"


@contextlib.contextmanager
def _no_shm_comm_op() -> Iterator[None]:
    """Skip DeepSpeed's CPU shared-memory allreduce op while the backend is created.

    On the CPU accelerator ``deepspeed.comm.torch.TorchBackend`` JIT-compiles the
    ``deepspeed_shm_comm`` C++ op (ninja + a C++ compiler, ~35 s cold; cached under
    ``TORCH_EXTENSIONS_DIR``). It only speeds up intra-node allreduce between several ranks; with a
    world of size 1 it is useless, and when it is None DeepSpeed falls back to torch.distributed.
    """
    mod = sys.modules.get("deepspeed.comm.torch")
    if mod is None or not hasattr(mod, "build_shm_op"):
        yield
        return
    original = getattr(mod, "build_shm_op")  # noqa: B009
    setattr(mod, "build_shm_op", lambda: None)  # noqa: B010
    try:
        yield
    finally:
        setattr(mod, "build_shm_op", original)  # noqa: B010


def ensure_distributed(backend: str = "gloo") -> bool:
    """Make sure a torch.distributed world exists for DeepSpeed; return True if this call created it.

    * Already initialized (by us, a launcher or the caller): reused as is.
    * Launched by a launcher (``WORLD_SIZE`` etc. in the environment): ``init_distributed`` with them.
    * Otherwise, a single process: sets ``MASTER_ADDR=127.0.0.1``, ``MASTER_PORT=<free port>``,
      ``RANK=0``, ``LOCAL_RANK=0``, ``WORLD_SIZE=1`` in ``os.environ`` (process-global, left set because
      DeepSpeed reads ``LOCAL_RANK`` later) and initializes a world of size 1.

    Undo with :func:`shutdown_distributed`.
    """
    _prepare_deepspeed_env()
    import deepspeed
    import deepspeed.comm  # noqa: F401  (makes sure deepspeed.comm.torch is in sys.modules)

    if torch.distributed.is_available() and torch.distributed.is_initialized():
        # Wrap the existing group in DeepSpeed's comm backend (no-op if it already is).
        ctx = (_no_shm_comm_op() if torch.distributed.get_world_size() == 1 or not torch.cuda.is_available()
               else contextlib.nullcontext())
        with ctx:
            deepspeed.init_distributed(dist_backend=backend)
        return False
    if "WORLD_SIZE" not in os.environ:
        os.environ.update(
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(free_port()),
            RANK="0",
            LOCAL_RANK="0",
            WORLD_SIZE="1",
        )
    # CPU: no shared-memory allreduce op at all (a JIT build; gloo does the job for the CPU tests).
    single = os.environ.get("WORLD_SIZE") == "1" or not torch.cuda.is_available()
    ctx = _no_shm_comm_op() if single else contextlib.nullcontext()
    with ctx:
        deepspeed.init_distributed(dist_backend=backend, auto_mpi_discovery=False)
    return True


def shutdown_distributed() -> None:
    """Destroy the default process group (and DeepSpeed's references to it), if any.

    DeepSpeed keeps its comm backend object; a later :func:`ensure_distributed` re-initializes it.
    """
    if not (torch.distributed.is_available() and torch.distributed.is_initialized()):
        return
    dscomm = sys.modules.get("deepspeed.comm")
    if dscomm is not None and getattr(sys.modules.get("deepspeed.comm.comm"), "cdb", None) is not None:
        dscomm.destroy_process_group()
    else:
        torch.distributed.destroy_process_group()


def _zero_config(stage: int, model: nn.Module) -> dict[str, Any]:
    """ZeRO section with bucket sizes fitted to the model.

    DeepSpeed's default buckets are 5e8 elements (2 GB in fp32); ZeRO-2 allocates its reduce bucket
    on every backward, which on CPU costs ~0.8 s per step for any model size. Buckets no larger than
    the model (at least 2**20 elements, at most the default) remove that cost.
    """
    numel = sum(p.numel() for p in model.parameters() if p.requires_grad)
    bucket = int(min(max(numel, 2**20), 500_000_000))
    zero: dict[str, Any] = {"stage": stage}
    if stage in (1, 2):
        zero.update(reduce_bucket_size=bucket, allgather_bucket_size=bucket)
    elif stage == 3:
        zero.update(reduce_bucket_size=bucket, stage3_prefetch_bucket_size=bucket)
    return zero


@register_train_engine("deepspeed")
class DeepSpeedTrainEngine(TrainEngine):
    """``deepspeed.initialize`` around the same AdamW + LambdaLR as the torch engine.

    DeepSpeed config (one micro-batch per step in DeepSpeed's bookkeeping; the caller decides what a
    batch is and accumulates micro-batches itself, marking the last with ``backward(boundary=True)``)::

        {"train_batch_size": W, "train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1,
         "gradient_clipping": grad_clip,
         "zero_optimization": {"stage": ds_stage, <bucket sizes fitted to the model, see _zero_config>},
         "zero_allow_untested_optimizer": True, "fp16": {"enabled": False}, "bf16": {"enabled": precision == "bf16"},
         "data_types": {"grad_accum_dtype": "fp32"},  # bf16 only
         "steps_per_print": 2**31 - 1, "wall_clock_breakdown": False}

    bf16: DeepSpeed ≥ 0.18 accumulates gradients in the model's dtype (bf16: the small gradients of
    later micro-batches round away) unless ``data_types.grad_accum_dtype`` is fp32, and it takes bf16
    weights with fp32 accumulation only in its bf16 optimizer at ZeRO stage 1 (stage 0 refuses the mix
    with NotImplementedError). So ``zero_stage=0`` in bf16 runs as stage 1 (``ds_stage``): fp32 master
    weights, optimizer state and gradient accumulation, the optimizer state partitioned over ranks.
    """

    data_parallel = True

    def __init__(self, model: nn.Module, config: TrainSettings) -> None:
        self.config = config
        ensure_distributed("gloo" if not torch.cuda.is_available() else "nccl")
        import deepspeed

        seed_everything(config.seed, deterministic=config.deterministic)
        world = torch.distributed.get_world_size()
        bf16 = config.precision == "bf16"
        self.ds_stage = 1 if bf16 and config.zero_stage == 0 else int(config.zero_stage)
        """The ZeRO stage DeepSpeed runs: ``zero_stage``, but 1 for 0 in bf16 (see the class doc)."""
        self.ds_config: dict[str, Any] = {
            "train_batch_size": world,
            "train_micro_batch_size_per_gpu": 1,
            "gradient_accumulation_steps": 1,
            "gradient_clipping": float(config.grad_clip) if config.grad_clip > 0 else 0.0,
            "zero_optimization": _zero_config(self.ds_stage, model),
            "zero_allow_untested_optimizer": True,
            "fp16": {"enabled": False},
            # bf16: the module in bf16, fp32 master weights, optimizer state and gradient
            # accumulation in DeepSpeed's bf16 optimizer (ZeRO-1, also for zero_stage 0) or ZeRO's
            # fp32 partitions (ZeRO 2-3).
            "bf16": {"enabled": bf16},
            **({"data_types": {"grad_accum_dtype": "fp32"}} if bf16 else {}),
            "steps_per_print": 2**31 - 1,
            "wall_clock_breakdown": False,
        }
        optimizer = _make_optimizer(model, config)
        scheduler = _make_scheduler(optimizer, config)
        engine, _, _, _ = deepspeed.initialize(
            model=model,
            optimizer=optimizer,
            lr_scheduler=scheduler,
            config=self.ds_config,
            dist_init_required=False,
        )
        self._engine = engine
        self._model = model
        self._base_optimizer = optimizer
        self.scheduler = scheduler
        self.global_step = 0

    @property
    def engine(self) -> Any:
        """The ``deepspeed.DeepSpeedEngine``."""
        return self._engine

    @property
    def module(self) -> nn.Module:
        return self._engine

    @property
    def model(self) -> nn.Module:
        return self._engine.module

    def backward(self, loss: torch.Tensor, *, boundary: bool = True) -> None:
        self._engine.set_gradient_accumulation_boundary(boundary)
        self._engine.backward(loss)

    def step(self) -> dict[str, float]:
        lr = float(self._base_optimizer.param_groups[0]["lr"])
        pre_norm = None
        if self.ds_stage == 0:  # fp32 (bf16 never runs stage 0)
            # DeepSpeed clips plain fp32 grads itself but does not keep the norm; measure it first.
            pre_norm = _total_grad_norm(list(self._engine.module.parameters()))
        self._engine.step()
        if pre_norm is None:
            gn = self._engine.get_global_grad_norm()
            grad_norm = float(gn) if gn is not None else math.nan
        else:
            grad_norm = pre_norm
        self.global_step += 1
        return {"grad_norm": grad_norm, "lr": lr}

    def zero_grad(self) -> None:
        self._engine.zero_grad()
        if self.ds_stage > 0:
            self._engine.optimizer.zero_grad()

    def _inner_optimizer(self) -> torch.optim.Optimizer:
        # The client AdamW: ZeRO 1-3 and the bf16 optimizer step it over their fp32 partitions.
        return self._base_optimizer

    def save_checkpoint(self, directory: str | os.PathLike[str], client_state: dict | None = None) -> None:
        Path(directory).mkdir(parents=True, exist_ok=True)
        state = {
            _CLIENT_KEY: dict(client_state or {}),
            _RNG_KEY: get_rng_state(),
            _STEP_KEY: self.global_step,
        }
        self._engine.save_checkpoint(str(directory), client_state=state)

    def load_checkpoint(self, directory: str | os.PathLike[str]) -> dict:
        path, state = self._engine.load_checkpoint(
            str(directory), load_optimizer_states=True, load_lr_scheduler_states=True
        )
        if path is None or state is None or _CLIENT_KEY not in state:
            raise FileNotFoundError(f"no DeepSpeed engine checkpoint in {directory}")
        self.global_step = int(state[_STEP_KEY])
        set_rng_state(state[_RNG_KEY])
        return state[_CLIENT_KEY]

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        if self.ds_stage < 3:
            return super().full_state_dict()
        import deepspeed

        model = self._engine.module
        with deepspeed.zero.GatheredParameters(list(model.parameters()), modifier_rank=None):
            return {k: v.detach().to("cpu", copy=True) for k, v in model.state_dict().items()}
