"""Loading a Hugging Face causal LM the way every torch consumer in the mesh does: the CPU torch
engine (rollout/engines/engine_server.py), the learner (learner/, which sits above rollout/) and the tests.
Imports torch and transformers (the core package stays torch-free)."""

from __future__ import annotations

import os
from typing import Any

import torch
import transformers
from transformers import AutoModelForCausalLM


def dtype_kwarg(dtype: torch.dtype, version: str = transformers.__version__) -> dict[str, torch.dtype]:
    """The ``from_pretrained`` keyword for the weights' dtype on this transformers version:
    ``dtype=`` from 4.56 on (``torch_dtype=`` is deprecated there), ``torch_dtype=`` before (4.45 ..
    4.55 have no ``dtype=``: it would reach the model's config and fail)."""
    major, minor = (int(x) for x in version.split(".")[:2])
    return {"dtype": dtype} if (major, minor) >= (4, 56) else {"torch_dtype": dtype}


def load_causal_lm(model_dir: str | os.PathLike, *, dtype: torch.dtype = torch.float32,
                   attn_implementation: str = "eager") -> Any:
    """Any Hugging Face causal LM (``AutoModelForCausalLM``: a Qwen2 checkpoint keeps its attention
    biases), offline, in `dtype`, on the CPU, in eval mode."""
    return AutoModelForCausalLM.from_pretrained(
        str(model_dir), attn_implementation=attn_implementation, **dtype_kwarg(dtype)
    ).eval()
