"""Learner checkpoints from before the `PolicyLogprobs` wrapper: model keys without ``policy.``.

Since the train engines wrap the HF model in :class:`trajmesh.learner.logprobs.PolicyLogprobs`,
every model key of a checkpoint starts with ``policy.`` (``policy.model.embed_tokens.weight``).
Checkpoints written before have the bare HF names and fail the strict load. The optimizer state is
keyed by parameter order (torch) or by flat ZeRO partitions (DeepSpeed), which the wrapper does
not change, so renaming the model keys is all it takes. :func:`add_policy_prefix` does that in
place (each file written to a temp name, then renamed); a checkpoint already in the new form is
left as it is.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch

PREFIX = "policy."
TORCH_ENGINE_FILE = "torch_engine.pt"  # trajmesh.learner.train_engine's torch engine checkpoint
_DS_NAME_KEYS = ("param_shapes", "frozen_param_shapes", "shared_params", "buffer_names")
"""DeepSpeed model-state entries that name parameters besides ``module``."""


def _prefixed(name: Any) -> Any:
    return name if not isinstance(name, str) or name.startswith(PREFIX) else PREFIX + name


def _rename(obj: Any) -> Any:
    """Every parameter name in `obj` (dict keys, list items, dict values of shared_params) prefixed."""
    if isinstance(obj, dict):
        return type(obj)((_prefixed(k), _rename(v) if not isinstance(v, str) else _prefixed(v))
                         for k, v in obj.items())
    if isinstance(obj, list):
        return [_rename(x) if not isinstance(x, str) else _prefixed(x) for x in obj]
    return obj


def _needs(state: dict[str, Any]) -> bool:
    return any(isinstance(k, str) and not k.startswith(PREFIX) for k in state)


def _rewrite(path: Path, key: str, names: tuple[str, ...] = ()) -> bool:
    payload = torch.load(path, map_location="cpu", weights_only=False)  # our own checkpoints only
    if not isinstance(payload.get(key), dict) or not _needs(payload[key]):
        return False
    payload[key] = _rename(payload[key])
    for extra in names:
        if payload.get(extra) is not None:
            payload[extra] = _rename(payload[extra])
    tmp = path.with_name(path.name + ".compat-tmp")
    torch.save(payload, tmp)
    os.replace(tmp, path)
    return True


def add_policy_prefix(directory: str | os.PathLike[str]) -> list[Path]:
    """Rename the model keys of the learner checkpoint in `directory` (a torch engine's
    ``torch_engine.pt``, or a DeepSpeed checkpoint: its ``latest`` tag's ``mp_rank_*_model_states.pt``)
    to the ``policy.``-prefixed form; returns the files rewritten (none when already new)."""
    d = Path(directory)
    done = []
    if (d / TORCH_ENGINE_FILE).is_file() and _rewrite(d / TORCH_ENGINE_FILE, "model"):
        done.append(d / TORCH_ENGINE_FILE)
    tag_file = d / "latest"
    tags = [tag_file.read_text().strip()] if tag_file.is_file() else []
    for tag in tags:
        for path in sorted((d / tag).glob("*model_states.pt")):
            if _rewrite(path, "module", _DS_NAME_KEYS):
                done.append(path)
    return done
