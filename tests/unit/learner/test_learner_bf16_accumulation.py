"""bf16 learner updates accumulate their micro-batches' gradients in fp32 (learner/train_engine.py):
from DeepSpeed 0.18 a bf16 model at ZeRO-0 accumulates in bf16, where the small gradients of later
micro-batches round away. Run on CPU with DeepSpeed's gloo world of one rank."""

from __future__ import annotations

import importlib.util

import pytest
import torch
from torch import nn

from trajmesh.learner.train_engine import build_train_engine, ensure_distributed, shutdown_distributed

pytestmark = pytest.mark.skipif(importlib.util.find_spec("deepspeed") is None, reason="deepspeed not installed")


@pytest.fixture(scope="module")
def ds_world():
    created = ensure_distributed("gloo")
    yield
    if created:
        shutdown_distributed()


@pytest.mark.parametrize("stage", [0, 2])
def test_bf16_micro_batch_gradients_accumulate_in_fp32(ds_world, stage: int):
    from deepspeed.utils import safe_get_full_grad

    model = nn.Linear(4, 1, bias=False)
    with torch.no_grad():
        model.weight.fill_(1.0)
    engine = build_train_engine(model, type="deepspeed", lr=1e-3, warmup_steps=0, weight_decay=0.0, grad_clip=0.0,
                                zero_stage=stage, seed=0, precision="bf16")
    assert engine.ds_config["data_types"] == {"grad_accum_dtype": "fp32"}  # type: ignore[attr-defined]
    x = torch.ones(1, 4, dtype=torch.bfloat16)
    scales = [1.0] + [2.0**-10] * 256  # d loss / d w = scale per micro-batch (x is ones)
    for i, scale in enumerate(scales):
        engine.backward(engine.module(x).sum() * scale, boundary=i == len(scales) - 1)
    grad = safe_get_full_grad(model.weight)
    # fp32 sum 1 + 256 / 1024 = 1.25; in bf16 each 2**-10 added to 1.0 rounds away (spacing 2**-7)
    assert grad is not None and torch.allclose(grad.float(), torch.full((1, 4), 1.25), atol=1e-6), grad
    engine.step()
    engine.zero_grad()
