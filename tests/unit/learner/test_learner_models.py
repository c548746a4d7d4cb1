"""Any Hugging Face causal LM: a tiny Qwen2 (attention biases) loads with its biases, trains through
the learner step, and the built-in torch engine serves it greedily as HF generate does; bf16 on CPU;
the from_pretrained dtype keyword per transformers version; EOS ids from generation_config.json."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import AutoTokenizer, Qwen2Config, Qwen2ForCausalLM

from trajmesh.contract import Trajectory
from trajmesh.infra import free_port
from trajmesh.learner import advantages, step
from trajmesh.learner.logprobs import PolicyLogprobs
from trajmesh.learner.models import (
    build_char_tokenizer,
    encode_prompt,
    load_model,
)
from trajmesh.learner.objective import ObjectiveConfig
from trajmesh.learner.train_engine import build_train_engine
from trajmesh.rollout.engines.hf_model import dtype_kwarg, load_causal_lm

EXTRA_EOS = 5  # an end-of-turn id only generation_config.json names


def _build_qwen2(root: Path) -> Path:
    """A random 2-layer Qwen2 with NON-zero q/k/v biases (Qwen2 initialises them to 0: a loader that
    dropped them would go unnoticed), saved with the char tokenizer and a generation config."""
    tok = build_char_tokenizer(root / "tok")
    cfg = Qwen2Config(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                      tie_word_embeddings=True, pad_token_id=tok.pad_token_id, bos_token_id=tok.bos_token_id,
                      eos_token_id=tok.eos_token_id)
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(cfg).float()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("proj.bias"):
                p.normal_(0.0, 0.5)
    model.save_pretrained(str(root / "qwen2"), safe_serialization=True)
    tok.save_pretrained(str(root / "qwen2"))
    gen = json.loads((root / "qwen2" / "generation_config.json").read_text())
    gen["eos_token_id"] = [tok.eos_token_id, EXTRA_EOS]
    (root / "qwen2" / "generation_config.json").write_text(json.dumps(gen))
    return root / "qwen2"


@pytest.fixture(scope="module")
def qwen2_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _build_qwen2(tmp_path_factory.mktemp("qwen2"))


def _batch(tok, n: int = 6) -> step.Batch:  # type: ignore[no-untyped-def]
    trajs = []
    for i in range(n):
        t = Trajectory.new(trajectory_id=f"t{i}")
        t.pb.group_id = f"g{i // 3}"
        t.append_prompt(encode_prompt(tok, f"{i}+{i + 1}="))
        ans = tok(str(2 * i + 1 + i % 2), add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
        t.append_sampled(ans, [-1.0] * len(ans), 0)
        t.set_reward(float(i % 2))
        trajs.append(t)
    return step.build_batch(trajs, tok.pad_token_id)


def test_qwen2_loads_through_auto_with_its_attention_biases(qwen2_dir: Path) -> None:
    model, _ = load_model(qwen2_dir)
    assert type(model).__name__ == "Qwen2ForCausalLM"
    bias = model.model.layers[0].self_attn.q_proj.bias
    assert bias is not None and float(bias.detach().abs().sum()) > 1.0


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_qwen2_trains_through_the_learner_step(qwen2_dir: Path, precision: str) -> None:
    model = load_causal_lm(qwen2_dir)
    tok = AutoTokenizer.from_pretrained(str(qwen2_dir))
    bias_before = model.model.layers[0].self_attn.k_proj.bias.detach().clone()
    engine = build_train_engine(PolicyLogprobs(model, chunk_tokens=7), type="torch", lr=1e-2, warmup_steps=0,
                                weight_decay=0.0, grad_clip=1.0, seed=0, precision=precision)
    batch = _batch(tok)
    adv_BT = advantages.advantages_BT(batch, "grpo", scale_by_std=True, eps=1e-6)
    metrics = step.train_batch(engine, batch, adv_BT, ObjectiveConfig(), step.StepPlan(micro_batch_tokens=30),
                               temperature=1.0, version=0, max_lag=3)
    assert torch.isfinite(torch.tensor(metrics["trajmesh_learner_loss"]))
    assert metrics["grad_norm"] > 0 and torch.isfinite(torch.tensor(metrics["grad_norm"]))
    assert next(model.parameters()).dtype == torch.float32  # fp32 master weights under bf16 autocast
    assert not torch.equal(model.model.layers[0].self_attn.k_proj.bias, bias_before)  # biases train


def test_bf16_deepspeed_step_on_cpu_has_a_finite_loss(qwen2_dir: Path) -> None:
    pytest.importorskip("deepspeed")
    from trajmesh.learner.train_engine import ensure_distributed, shutdown_distributed

    created = ensure_distributed("gloo")
    try:
        engine = build_train_engine(PolicyLogprobs(load_causal_lm(qwen2_dir)), type="deepspeed", lr=1e-3,
                                    warmup_steps=0, weight_decay=0.0, grad_clip=1.0, zero_stage=0, seed=0,
                                    precision="bf16")
        batch = _batch(AutoTokenizer.from_pretrained(str(qwen2_dir)))
        adv_BT = advantages.advantages_BT(batch, "grpo", scale_by_std=True, eps=1e-6)
        for _ in range(2):
            metrics = step.train_batch(engine, batch, adv_BT, ObjectiveConfig(),
                                       step.StepPlan(micro_batch_tokens=30), temperature=1.0, version=0, max_lag=3)
            assert torch.isfinite(torch.tensor([metrics["trajmesh_learner_loss"], metrics["grad_norm"]])).all()
        assert next(engine.model.parameters()).dtype == torch.bfloat16
    finally:
        if created:
            shutdown_distributed()


def test_from_pretrained_dtype_keyword_by_transformers_version() -> None:
    assert dtype_kwarg(torch.bfloat16, "4.45.2") == {"torch_dtype": torch.bfloat16}
    assert dtype_kwarg(torch.bfloat16, "4.55.4") == {"torch_dtype": torch.bfloat16}
    assert dtype_kwarg(torch.bfloat16, "4.56.0") == {"dtype": torch.bfloat16}
    assert dtype_kwarg(torch.float32, "5.1.0.dev0") == {"dtype": torch.float32}


def test_eos_ids_include_generation_config(qwen2_dir: Path) -> None:
    from trajmesh.rollout.agents.chat_format import model_stop_ids
    from trajmesh.rollout.engines.engine_server import model_eos_ids

    tok = AutoTokenizer.from_pretrained(str(qwen2_dir))
    assert EXTRA_EOS != tok.eos_token_id
    assert model_stop_ids(qwen2_dir, tok.eos_token_id) >= {tok.eos_token_id, EXTRA_EOS}  # the rollout's stops
    assert model_eos_ids(load_causal_lm(qwen2_dir), tok.eos_token_id) >= {tok.eos_token_id, EXTRA_EOS}  # the engine's


def _serve_greedy(model_dir: Path, prompts: list[list[int]], max_new: int, log: Path) -> list[list[int]]:
    from trajmesh.rollout.engines.engine_client import EngineClient

    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "trajmesh.rollout.engines.engine_server", "--model", str(model_dir),
                             "--port", str(port), "--host", "127.0.0.1", "--version", "0", "--threads", "1"],
                            stdout=subprocess.DEVNULL, stderr=open(log, "w"))  # noqa: SIM115

    async def go() -> list[list[int]]:
        async with EngineClient(f"http://127.0.0.1:{port}") as client:
            for _ in range(600):
                assert proc.poll() is None, log.read_text()
                if await client.health():
                    break
                await asyncio.sleep(0.1)
            sp = {"temperature": 0, "max_new_tokens": max_new, "ignore_eos": True}
            return [r.output_ids for r in await asyncio.gather(*(client.generate(p, sp) for p in prompts))]

    try:
        return asyncio.run(go())
    finally:
        os.kill(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            os.kill(proc.pid, signal.SIGKILL)
            proc.wait()


def test_torch_engine_serves_qwen2_greedy_as_hf_generate(qwen2_dir: Path, tmp_path: Path) -> None:
    model, tok = load_model(qwen2_dir)
    prompts = [encode_prompt(tok, p) for p in ("12+7=", "3-40+5=")]
    served = _serve_greedy(qwen2_dir, prompts, 8, tmp_path / "server.log")
    for prompt, out in zip(prompts, served, strict=True):
        with torch.no_grad():
            ref = model.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=8, min_new_tokens=8,
                                 pad_token_id=tok.pad_token_id)
        assert out == ref[0, len(prompt):].tolist()
