"""The learner step's proximal log-probs: one forward (detached) equals the separate no-grad pass."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from trajmesh.contract import Trajectory
from trajmesh.learner import advantages, step
from trajmesh.learner.objective import ObjectiveConfig


def _model(**config: float) -> LlamaForCausalLM:
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=24, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=32,
                      tie_word_embeddings=True, **config)
    return LlamaForCausalLM(cfg).float()


def _batch() -> tuple[step.Batch, torch.Tensor]:
    trajs = []
    for i in range(4):
        t = Trajectory.new(trajectory_id=f"t{i}")
        t.pb.group_id = f"g{i // 2}"
        t.append_prompt([1, 5 + i, 6])
        n = 2 + i % 3
        t.append_sampled([7 + j + i for j in range(n)], [-1.5 - 0.1 * j for j in range(n)], 3 - i % 2)
        t.set_reward(float(i % 2))
        trajs.append(t)
    batch = step.build_batch(trajs, 0)
    return batch, advantages.advantages_B(batch, "grpo", scale_by_std=True, eps=1e-6)


def _loss_and_grads(model: LlamaForCausalLM) -> tuple[torch.Tensor, dict[str, float], list[torch.Tensor]]:
    batch, adv_B = _batch()
    model.zero_grad()
    model.train()
    loss, metrics = step.compute_loss(model, batch, adv_B, ObjectiveConfig(), temperature=1.0, version=3, max_lag=3)
    loss.backward()
    return loss.detach(), metrics, [p.grad.clone() for p in model.parameters() if p.grad is not None]


def test_single_forward_matches_the_separate_proximal_pass(monkeypatch: pytest.MonkeyPatch) -> None:
    model = _model()
    assert step.is_deterministic(model)
    loss_one, metrics_one, grads_one = _loss_and_grads(model)
    monkeypatch.setattr(step, "is_deterministic", lambda m: False)  # force the two-pass path
    loss_two, metrics_two, grads_two = _loss_and_grads(model)
    assert torch.allclose(loss_one, loss_two, rtol=0, atol=1e-6)
    assert len(grads_one) == len(grads_two) > 0
    for a, b in zip(grads_one, grads_two, strict=True):
        assert torch.allclose(a, b, rtol=1e-5, atol=1e-7)
    for key in ("trajmesh_learner_effective_sample_size_ratio", "trajmesh_learner_kl_k3",
                "trajmesh_learner_policy_ratio_mean", "trajmesh_learner_logprob_mismatch_abs_mean"):
        assert metrics_one[key] == pytest.approx(metrics_two[key], abs=1e-6), key


def test_dropout_needs_the_separate_pass() -> None:
    assert not step.is_deterministic(_model(attention_dropout=0.1))
    model = _model()
    model.model.layers[0].mlp.add_module("drop", torch.nn.Dropout(0.2))
    assert not step.is_deterministic(model)
    assert step.is_deterministic(torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Dropout(0.0)))
