"""Weights out: streamed safetensors in the training dtype, hashed while written, tied weights once,
ZeRO-3 gathered module by module (the same bytes as the unpartitioned model)."""

from __future__ import annotations

import hashlib
import importlib.util
import json
import struct
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from tiny_llama import tiny_llama
from transformers import AutoModelForCausalLM, LlamaForCausalLM

from trajmesh.learner.logprobs import PolicyLogprobs, policy_of
from trajmesh.learner.train_engine import build_train_engine, ensure_distributed, shutdown_distributed
from trajmesh.learner.weights import export_policy

HAS_DEEPSPEED = importlib.util.find_spec("deepspeed") is not None


def _model() -> LlamaForCausalLM:
    return tiny_llama()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_export_is_loadable_hashed_in_dtype_and_tied_once(tmp_path: Path, dtype: torch.dtype) -> None:
    model = _model()
    sha = export_policy(model, tmp_path, dtype=dtype)
    raw = (tmp_path / "model.safetensors").read_bytes()
    assert sha == hashlib.sha256(raw).hexdigest()
    header = json.loads(raw[8:8 + struct.unpack("<Q", raw[:8])[0]])
    assert "lm_head.weight" not in header and "model.embed_tokens.weight" in header
    tensors = load_file(str(tmp_path / "model.safetensors"))
    assert {t.dtype for t in tensors.values()} == {dtype}
    for name, p in model.state_dict().items():
        if name != "lm_head.weight":
            assert torch.equal(tensors[name], p.to(dtype)), name
    again = AutoModelForCausalLM.from_pretrained(str(tmp_path))
    assert again.dtype == dtype  # config.json records the stored dtype
    assert again.lm_head.weight.data_ptr() == again.model.embed_tokens.weight.data_ptr()
    ids = torch.tensor([[1, 5, 7, 9]])
    torch.testing.assert_close(again.float()(ids).logits, model.to(dtype).float()(ids).logits)


@pytest.mark.skipif(not HAS_DEEPSPEED, reason="deepspeed not installed")
def test_zero3_export_gathers_each_module_and_writes_the_same_bytes(tmp_path: Path) -> None:
    reference = export_policy(_model(), tmp_path / "plain")
    created = ensure_distributed("gloo")
    try:
        engine = build_train_engine(PolicyLogprobs(_model()), type="deepspeed", lr=1e-3, warmup_steps=0,
                                    weight_decay=0.0, grad_clip=1.0, zero_stage=3, seed=0)
        policy = policy_of(engine.model)
        assert all(p.numel() == 0 for p in policy.parameters())  # partitioned: placeholders only
        sha = export_policy(policy, tmp_path / "zero3", zero3=True)
        assert all(p.numel() == 0 for p in policy.parameters())  # released again
        assert export_policy(policy, tmp_path / "other_rank", zero3=True, write=False) is None
    finally:
        if created:
            shutdown_distributed()
    assert sha == reference
    assert not (tmp_path / "other_rank").exists()
