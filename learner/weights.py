"""Weights out: a Hugging Face safetensors checkpoint of the policy, streamed (docs/DESIGN.md §4b, §5).

Every rank calls :func:`export_policy` (under ZeRO-3 the gathers are collective); only the writer
rank writes. The tensors are written in the training dtype, each tied tensor once (under the first
name ``named_parameters`` gives it, the one ``save_pretrained`` keeps), and the file is hashed as it
is written, so nothing is read back to announce its sha256. Under ZeRO-3 the parameters are gathered
one module at a time (``deepspeed.zero.GatheredParameters`` on that module's own parameters), so the
peak is the largest layer, never the whole model::

    header (names, dtypes, shapes, offsets: known before any gather)
    for each module: gather its parameters ─▶ bytes ─▶ file + sha256 ─▶ release

With a `trajmesh.weights.delta.DeltaWriter` (``weights.sync: delta``) the same bytes go to it instead:
it writes only what changed since the last version it committed (and a full anchor now and then),
plus a manifest; the sha256 returned is still that of the full file, hashed as the tensors go to it
(the one hash of the checkpoint on this side, as here).
"""

from __future__ import annotations

import contextlib
import copy
import hashlib
import json
import os
import struct
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from torch import nn

from trajmesh.rollout.engines.hf_model import dtype_kwarg
from trajmesh.weights.delta import DeltaWriter

__all__ = ["SAFETENSORS_NAME", "TOKENIZER_FILES", "export_policy"]

SAFETENSORS_NAME = "model.safetensors"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja")
"""Copied from the base model into every published version, so that each is a whole HF directory (an
engine that reloads its tokenizer with the weights finds it; transformers 5 keeps the chat template in
``chat_template.jinja``)."""
_DTYPES = {torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16", torch.float64: "F64",
           torch.int64: "I64", torch.int32: "I32", torch.bool: "BOOL"}


def _entries(model: nn.Module) -> list[tuple[str, nn.Module, str, torch.Tensor]]:
    """(name, owning module, attribute, tensor) per saved tensor, module order, tied tensors once,
    persistent buffers only (those in ``state_dict``)."""
    keys = set(model.state_dict(keep_vars=True).keys())
    seen: set[int] = set()
    out = []
    for prefix, module in model.named_modules():
        own = [*module.named_parameters(recurse=False), *module.named_buffers(recurse=False)]
        for attr, tensor in own:
            name = f"{prefix}.{attr}" if prefix else attr
            if tensor is None or id(tensor) in seen or name not in keys:
                continue
            seen.add(id(tensor))
            out.append((name, module, attr, tensor))
    return out


def _shape(t: torch.Tensor) -> list[int]:
    return list(getattr(t, "ds_shape", t.shape))  # a ZeRO-3 parameter is an empty placeholder


def _header(entries: list[tuple[str, nn.Module, str, torch.Tensor]], dtype: torch.dtype | None) -> bytes:
    meta: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for name, _, _, t in entries:
        dt = dtype if dtype is not None and t.is_floating_point() else t.dtype
        n = int(torch.Size(_shape(t)).numel()) * torch.empty((), dtype=dt).element_size()
        meta[name] = {"dtype": _DTYPES[dt], "shape": _shape(t), "data_offsets": [offset, offset + n]}
        offset += n
    raw = json.dumps(meta, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # 8-byte alignment of the data section
    return struct.pack("<Q", len(raw)) + raw


def _gathered(module: nn.Module, zero3: bool) -> contextlib.AbstractContextManager[Any]:
    if not zero3:
        return contextlib.nullcontext()
    import deepspeed

    return deepspeed.zero.GatheredParameters(list(module.parameters(recurse=False)), modifier_rank=None)


def _module_runs(entries: list[tuple[str, nn.Module, str, torch.Tensor]]) -> Iterator[list[Any]]:
    """Consecutive entries owned by the same module (one gather each)."""
    run: list[Any] = []
    for e in entries:
        if run and run[-1][1] is not e[1]:
            yield run
            run = []
        run.append(e)
    if run:
        yield run


def export_policy(model: nn.Module, out_dir: str | os.PathLike[str], *, dtype: torch.dtype | None = None,
                  zero3: bool = False, write: bool = True, delta: DeltaWriter | None = None,
                  version: int = 0) -> str | None:
    """Write ``model.safetensors`` + ``config.json`` (+ generation config) of the HF `model` into
    `out_dir`; returns the safetensors file's sha256 (None where ``write`` is False).

    ``dtype``: floating tensors are cast to it (the training dtype), others kept. Under ``zero3``
    every rank must call this (the per-module gathers are collective), with ``write`` on one rank.
    ``delta``: the tensors go to it (as policy `version`) instead of a full file; the caller
    commits it once `out_dir` is in place (``DeltaWriter.commit``).
    """
    entries = _entries(model)
    sha = hashlib.sha256()
    out = Path(out_dir)
    fh = None
    if write:
        out.mkdir(parents=True, exist_ok=True)
        header = _header(entries, dtype)
        if delta is not None:
            delta.begin(out, header, version)
        else:
            fh = open(out / SAFETENSORS_NAME, "wb")  # noqa: SIM115 - closed in finally
            fh.write(header)
            sha.update(header)
    try:
        for run in _module_runs(entries):
            with _gathered(run[0][1], zero3):
                for name, module, attr, _ in run:
                    t = getattr(module, attr).detach()
                    t = t.to(dtype) if dtype is not None and t.is_floating_point() else t
                    if write:
                        data = t.contiguous().cpu().reshape(-1).view(torch.uint8).numpy().tobytes()
                        if delta is not None:
                            delta.add(name, data, _DTYPES[t.dtype])
                        elif fh is not None:
                            fh.write(data)
                            sha.update(data)
    except BaseException:
        if write and delta is not None:
            delta.abort()
        raise
    finally:
        if fh is not None:
            fh.close()
    if not write:
        return None
    digest = delta.finish() if delta is not None else sha.hexdigest()
    hf_config: Any = model.config  # a PretrainedConfig (nn.Module's typing says Tensor | Module)
    config = copy.deepcopy(hf_config)
    if dtype is not None:  # the dtype the weights are stored in, as from_pretrained(dtype="auto") reads it
        setattr(config, next(iter(dtype_kwarg(dtype))), dtype)
    config.save_pretrained(str(out))
    generation_config = getattr(model, "generation_config", None)
    if generation_config is not None:
        with contextlib.suppress(Exception):  # a model without generation defaults has nothing to save
            generation_config.save_pretrained(str(out))
    return digest


