"""Token-budget micro-batches, PPO minibatches and the global loss denominators (docs/DESIGN.md §4, §4b).

A learner step's batch is cut twice:

* into K **minibatches** (``learner.ppo.minibatches``), one optimizer update each, balanced by
  token count (longest sequence first onto the lightest minibatch);
* each minibatch into **micro-batches** whose padded size (rows × longest row) fits
  ``learner.micro_batch_tokens``; their gradients accumulate before the update.

Every micro-batch's loss is divided by the denominator of the WHOLE minibatch (token-global Σm,
the count of sequences with an eligible token for the sequence-mean and constant forms), so the
accumulated gradient equals the gradient of one forward over the minibatch. :func:`global_counts`
sums those counts over the data-parallel ranks when a process group is given (or the default group
is initialized with more than one rank), so the same holds across ranks.

NCCL collectives run on this rank's GPU, ``cuda:LOCAL_RANK`` (:func:`local_cuda_device`), named
explicitly: the learner trains in ``asyncio.to_thread`` workers, and CUDA's current device is per
thread (0 in a new thread), so ``torch.cuda.current_device()`` there is cuda:0 on every local rank.
:func:`worker_executor` gives the learner threads that start with ``torch.cuda.set_device`` to it.
"""

from __future__ import annotations

import os
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor

__all__ = ["GlobalCounts", "balanced_split", "bind_local_cuda_device", "collective_device", "data_parallel",
           "global_counts", "local_cuda_device", "max_over_ranks", "pack_micro_batches", "sum_over_ranks",
           "sum_tensor_over_ranks", "thread_cuda_device", "worker_executor"]

_thread = threading.local()


def local_cuda_device() -> torch.device:
    """This process's GPU: ``cuda:LOCAL_RANK`` (the launcher's and DeepSpeed's convention; 0 unset)."""
    return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))


def bind_local_cuda_device() -> None:
    """Makes :func:`local_cuda_device` this thread's current CUDA device (``torch.cuda.set_device``;
    only recorded where CUDA is absent) — run first in every thread that trains or communicates."""
    device = local_cuda_device()
    if torch.cuda.is_available():
        torch.cuda.set_device(device)
    _thread.device = device


def thread_cuda_device() -> torch.device | None:
    """The device :func:`bind_local_cuda_device` bound in this thread (None: not bound here)."""
    return getattr(_thread, "device", None)


def worker_executor(max_workers: int | None = None) -> ThreadPoolExecutor:
    """Threads for ``asyncio.to_thread`` (set as the loop's default executor) that each bind
    :func:`local_cuda_device` before running anything."""
    return ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix="learner",
                              initializer=bind_local_cuda_device)


def collective_device(backend: str) -> torch.device:
    """Where a collective's tensors go: this rank's GPU under NCCL, the CPU otherwise (gloo)."""
    return local_cuda_device() if backend == "nccl" else torch.device("cpu")


@dataclass(frozen=True)
class GlobalCounts:
    """Denominator inputs of one optimizer update, summed over micro-batches and ranks."""

    tokens: float
    """Eligible (loss-mask 1) tokens: D of the token-global loss."""
    sequences: float
    """Sequences with at least one eligible token: S of the sequence-mean and constant losses."""


def data_parallel(group: dist.ProcessGroup | None = None) -> tuple[int, int]:
    """(rank, world size) in ``group``; (0, 1) without torch.distributed."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(group), dist.get_world_size(group)
    return 0, 1


def _all_reduce(values: list[float], op: dist.ReduceOp.RedOpType, group: dist.ProcessGroup | None) -> list[float]:
    if data_parallel(group)[1] == 1:
        return values
    device = collective_device(str(dist.get_backend(group)))
    t = torch.tensor(values, dtype=torch.float64, device=device)
    dist.all_reduce(t, op=op, group=group)
    return [float(v) for v in t.cpu()]


def sum_over_ranks(values: list[float], group: dist.ProcessGroup | None = None) -> list[float]:
    """Element-wise sum over the ranks of ``group`` (the values themselves with one rank)."""
    return _all_reduce(values, dist.ReduceOp.SUM, group)


def sum_tensor_over_ranks(t: Tensor, group: dist.ProcessGroup | None = None) -> Tensor:
    """Element-wise sum of ``t`` over the ranks of ``group`` (``t`` itself with one rank), on
    ``t``'s device and dtype. Rows that each rank fills for its own share (zeros elsewhere) come back
    as the whole batch's."""
    if data_parallel(group)[1] == 1:
        return t
    device = collective_device(str(dist.get_backend(group)))
    x = t.detach().to(device).clone()
    dist.all_reduce(x, op=dist.ReduceOp.SUM, group=group)
    return x.to(t.device)


def max_over_ranks(value: int, group: dist.ProcessGroup | None = None) -> int:
    """The largest ``value`` of any rank (e.g. micro-batches per update: every rank must run as many
    forwards and backwards, or ZeRO's collectives hang)."""
    return int(_all_reduce([float(value)], dist.ReduceOp.MAX, group)[0])


def global_counts(mask_BT: Tensor, group: dist.ProcessGroup | None = None,
                  row_share_B: Tensor | None = None) -> GlobalCounts:
    """Eligible tokens and sequences of ``mask_BT`` (this rank's share), all-reduced (sum) over
    ``group`` when torch.distributed is initialized with more than one rank in it. With
    ``row_share_B`` (rows that are segments of one trajectory, learner/step.py) a row with eligible
    tokens counts as its share of its trajectory, so a trajectory counts once however its rows are
    split over micro-batches and ranks."""
    on_B = (mask_BT > 0).sum(-1) > 0
    seqs = float(on_B.sum()) if row_share_B is None else float(row_share_B.to(on_B.device)[on_B].sum())
    tokens, sequences = sum_over_ranks([float((mask_BT > 0).sum()), seqs], group)
    return GlobalCounts(tokens=tokens, sequences=sequences)


def pack_micro_batches(lengths: list[int], budget_tokens: int) -> list[list[int]]:
    """Row indices grouped into micro-batches whose padded size ``len(rows) × max length`` is at
    most ``budget_tokens`` (a single longer row gets a micro-batch of its own).

    Rows are taken longest first (ties by index), so each micro-batch holds rows of similar length
    and little padding; the result is deterministic.
    """
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    out: list[list[int]] = []
    current: list[int] = []
    for i in order:
        width = lengths[current[0]] if current else lengths[i]  # longest first: the first row is the widest
        if current and (len(current) + 1) * width > budget_tokens:
            out.append(current)
            current = []
        current.append(i)
    if current:
        out.append(current)
    return out


def balanced_split(lengths: list[int], parts: int, *, keep_empty: bool = False) -> list[list[int]]:
    """``parts`` groups of row indices with near-equal token sums (longest row onto the lightest
    group; ties by index). Each group keeps ascending index order. Empty groups are dropped unless
    ``keep_empty`` (ranks: group k is rank k's share)."""
    loads = [0] * parts
    groups: list[list[int]] = [[] for _ in range(parts)]
    for i in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        k = min(range(parts), key=lambda j: (loads[j], j))
        groups[k].append(i)
        loads[k] += lengths[i]
    return [sorted(g) for g in groups if g or keep_empty]
