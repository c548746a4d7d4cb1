"""Golden learner loss: a fixed tiny batch and fixed weights in fp32; the step's losses must equal the
checked-in values in tests/golden/learner_loss.json. A change to the learner's math changes them:
update the file on purpose (the file says how) and say why in the commit."""

from __future__ import annotations

import json
import math
import os

import pytest
import torch
from repo_paths import TESTS
from transformers import LlamaConfig, LlamaForCausalLM

from trajmesh.contract import Trajectory
from trajmesh.learner import advantages, step
from trajmesh.learner.logprobs import PolicyLogprobs
from trajmesh.learner.objective import ObjectiveConfig
from trajmesh.learner.train_engine import build_train_engine

GOLDEN = TESTS / "golden" / "learner_loss.json"
REGENERATE = "TRAJMESH_REGENERATE_GOLDEN=1 .venv/bin/python -m pytest tests/unit/learner/test_learner_golden.py"
CASES = {
    "grpo_token_global_K1": ("grpo", "token_global", 1),
    "grpo_sequence_mean_K1": ("grpo", "sequence_mean", 1),
    "dr_grpo_constant_K1": ("dr_grpo", "constant", 1),
    "rloo_token_global_K2": ("rloo", "token_global", 2),
    "reinforce_pp_token_global_K1": ("reinforce_pp", "token_global", 1),
}


def _model() -> LlamaForCausalLM:
    """Weights from a formula, not an RNG or an init scheme, so they are the same on every version."""
    cfg = LlamaConfig(vocab_size=23, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                      num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=32,
                      tie_word_embeddings=True)
    model = LlamaForCausalLM(cfg).float()
    with torch.no_grad():
        for k, (_, p) in enumerate(sorted(model.named_parameters())):
            idx = torch.arange(p.numel(), dtype=torch.float64)
            p.copy_((0.3 * torch.sin(0.37 * idx + k) + (1.0 if p.dim() == 1 else 0.0)).view_as(p).float())
    return model


def _batch() -> step.Batch:
    trajs = []
    for i in range(6):
        t = Trajectory.new(trajectory_id=f"t{i}")
        t.pb.group_id = f"g{i // 3}"
        t.append_prompt([1, 3 + i, 4])
        n = 2 + i % 3
        t.append_sampled([(5 + 3 * j + 2 * i) % 22 + 1 for j in range(n)], [-2.5 - 0.1 * j for j in range(n)], 0)
        t.set_reward(float(i % 3 == 0) + 0.5 * float(i == 4))
        trajs.append(t)
    return step.build_batch(trajs, 0)


def _losses(kind: str, denominator: str, minibatches: int) -> list[float]:
    engine = build_train_engine(PolicyLogprobs(_model(), chunk_tokens=5), type="torch", lr=1e-2, warmup_steps=0,
                                weight_decay=0.0, grad_clip=1.0, seed=0)
    batch = _batch()
    adv_BT = advantages.advantages_BT(batch, kind, scale_by_std=True, eps=1e-6)
    cfg = ObjectiveConfig(denominator=denominator, constant_denominator=8.0)
    metrics = step.train_batch(engine, batch, adv_BT, cfg, step.StepPlan(micro_batch_tokens=16,
                               minibatches=minibatches), temperature=0.9, version=0, max_lag=3)
    return [u["loss"] for u in metrics["ppo_updates"]]


def test_losses_equal_the_golden_file() -> None:
    got = {name: _losses(*case) for name, case in CASES.items()}
    if os.environ.get("TRAJMESH_REGENERATE_GOLDEN"):
        GOLDEN.parent.mkdir(exist_ok=True)
        GOLDEN.write_text(json.dumps({"how_to_regenerate": REGENERATE, "losses": got}, indent=2) + "\n")
    golden = json.loads(GOLDEN.read_text())["losses"]
    assert set(golden) == set(CASES)
    for name, values in got.items():
        assert all(math.isfinite(v) and v != 0.0 for v in values), name
        assert values == pytest.approx(golden[name], rel=1e-5, abs=1e-7), name
