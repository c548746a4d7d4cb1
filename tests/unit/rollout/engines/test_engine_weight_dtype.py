"""The torch engine loads weights in the dtype they were written (as SGLang's ``--dtype auto`` reads
a checkpoint): the learner publishes in its training dtype (learner/weights.export_policy), bf16 on
GPU, fp32 on CPU. The chart's SGLang ``--dtype`` follows learner.precision (tests/unit/deploy/test_helm_chart.py)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

from repo_paths import REPO  # noqa: E402
from tiny_llama import tiny_llama  # noqa: E402

from trajmesh.learner.weights import export_policy  # noqa: E402
from trajmesh.rollout.engines.engine_server import load_served_model, stored_dtype  # noqa: E402

DEMO = next((REPO / "examples" / "demo-start").glob("demo-model-*/sft"))


def _published(tmp_path: Path, dtype: torch.dtype) -> Path:
    out = tmp_path / str(dtype).removeprefix("torch.")
    export_policy(tiny_llama(), out, dtype=dtype)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(DEMO / name, out / name)
    return out


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_published_weights_load_in_their_dtype(tmp_path: Path, dtype: torch.dtype) -> None:
    out = _published(tmp_path, dtype)
    assert stored_dtype(out) == dtype
    model, tokenizer = load_served_model(str(out))
    assert {p.dtype for p in model.parameters()} == {dtype}
    assert not model.training and tokenizer is not None
    with torch.no_grad():  # it runs in that dtype (the sampler takes float32 logits from it)
        logits = model(input_ids=torch.tensor([[1, 2, 3]])).logits
    assert logits.dtype == dtype and torch.isfinite(logits.float()).all()


def test_dtype_from_the_config_without_a_safetensors_file(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps({"torch_dtype": "bfloat16"}))
    assert stored_dtype(tmp_path) == torch.bfloat16
    (tmp_path / "config.json").write_text(json.dumps({}))
    assert stored_dtype(tmp_path) == torch.float32


def test_sharded_checkpoint_reads_its_first_shard(tmp_path: Path) -> None:
    out = _published(tmp_path, torch.bfloat16)
    (out / "model.safetensors").rename(out / "model-00001-of-00001.safetensors")
    (out / "model.safetensors.index.json").write_text(json.dumps(
        {"weight_map": {"model.embed_tokens.weight": "model-00001-of-00001.safetensors"}}))
    (out / "config.json").write_text(json.dumps({**json.loads((out / "config.json").read_text()),
                                                 "torch_dtype": "float32", "dtype": "float32"}))
    assert stored_dtype(out) == torch.bfloat16  # the tensors, not the config, decide
