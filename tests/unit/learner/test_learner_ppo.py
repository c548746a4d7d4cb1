"""The PPO trust region binds with K minibatches: π_prox from a pass before the first update."""

from __future__ import annotations

import pytest
import torch
from tiny_llama import tiny_llama
from transformers import LlamaForCausalLM

from trajmesh.contract import Trajectory
from trajmesh.learner import advantages, step
from trajmesh.learner.objective import ObjectiveConfig
from trajmesh.learner.train_engine import build_train_engine


def _model() -> LlamaForCausalLM:
    return tiny_llama()


def _batch() -> step.Batch:
    """16 trajectories in 4 groups with rewards 0/1, so every group has advantages of both signs."""
    trajs = []
    for i in range(16):
        t = Trajectory.new(trajectory_id=f"t{i}")
        t.pb.group_id = f"g{i // 4}"
        t.append_prompt([1, 4 + i % 4, 6])
        n = 3 + i % 5
        t.append_sampled([(5 + 2 * j + i) % 29 + 1 for j in range(n)], [-3.0 - 0.02 * j for j in range(n)], 0)
        t.set_reward(float(i % 2))
        trajs.append(t)
    return step.build_batch(trajs, 0)


def _engine(model: torch.nn.Module, lr: float):  # type: ignore[no-untyped-def]
    return build_train_engine(model, type="torch", lr=lr, warmup_steps=0, weight_decay=0.0, grad_clip=1.0, seed=0)


def _train(model: LlamaForCausalLM, minibatches: int, lr: float, epochs: int = 1) -> dict:
    batch = _batch()
    adv_BT = advantages.advantages_BT(batch, "grpo", scale_by_std=True, eps=1e-6)
    plan = step.StepPlan(micro_batch_tokens=24, minibatches=minibatches, epochs=epochs)
    return step.train_batch(_engine(model, lr), batch, adv_BT, ObjectiveConfig(), plan, temperature=1.0,
                            version=0, max_lag=3)


def test_with_four_minibatches_later_updates_see_ratios_off_one_and_clip() -> None:
    metrics = _train(_model(), minibatches=4, lr=0.05)  # a large step: the policy moves a lot
    updates = metrics["ppo_updates"]
    assert len(updates) == 4 and metrics["trajmesh_learner_ppo_updates"] == 4.0
    first, later = updates[0], updates[1:]
    # The first update runs at the weights π_prox was taken from: r ≡ 1, nothing clips.
    assert first["trajmesh_learner_policy_ratio_std"] < 1e-6
    assert first["trajmesh_learner_proximal_kl_k3_nats"] < 1e-10
    assert first["ratio_outside_frac"] == 0.0
    for u in later:
        assert u["trajmesh_learner_policy_ratio_std"] > 1e-3
        assert u["trajmesh_learner_proximal_kl_k3_nats"] > 0.0
    assert sum(u["clip_low_frac"] + u["clip_high_frac"] for u in later) > 0.0
    assert metrics["trajmesh_learner_update_ratio_outside_max_ratio"] > 0.0


def test_two_epochs_of_one_minibatch_also_bind() -> None:
    metrics = _train(_model(), minibatches=1, epochs=2, lr=0.05)
    second = metrics["ppo_updates"][1]
    assert second["trajmesh_learner_policy_ratio_std"] > 1e-3


def test_one_update_loss_and_gradient_equal_the_single_forward_formula() -> None:
    """K = E = 1: the loss is the pre-change one. Written out: with π_prox the forward itself,
    r ≡ 1, so every clip is inert and L = −Σ m·min(π/π_beh, 2)·Â / Σ m (TIS cap 2)."""
    batch = _batch()
    adv_B = advantages.advantages_B(batch, "grpo", scale_by_std=True, eps=1e-6)
    ref_model = _model()
    logits_BTV = ref_model(input_ids=batch.input_ids_BT, attention_mask=batch.attention_BT).logits
    logp_BT = torch.log_softmax(logits_BTV[:, :-1].float(), -1).gather(-1, batch.input_ids_BT[:, 1:, None])[..., 0]
    logp_BT = torch.cat([torch.zeros(logp_BT.shape[0], 1), logp_BT], dim=1)
    m_BT = batch.mask_BT
    w_BT = torch.exp(logp_BT.detach() - batch.behavior_logp_BT).clamp(max=2.0)
    ratio_BT = torch.exp(logp_BT - logp_BT.detach())
    ref_loss = -(m_BT * w_BT * ratio_BT * adv_B[:, None]).sum() / m_BT.sum()
    ref_loss.backward()
    ref_norm = torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in ref_model.parameters()]))

    metrics = _train(_model(), minibatches=1, lr=1e-3)
    assert metrics["trajmesh_learner_loss"] == pytest.approx(float(ref_loss.detach()), abs=1e-6)
    assert metrics["grad_norm"] == pytest.approx(float(ref_norm), rel=1e-5)
    assert metrics["trajmesh_learner_clip_high_ratio"] == metrics["trajmesh_learner_clip_low_ratio"] == 0.0


def test_reinforce_pp_advantages_train() -> None:
    batch = _batch()
    adv_BT = advantages.advantages_BT(batch, "reinforce_pp", scale_by_std=True, eps=1e-6)
    plan = step.StepPlan(micro_batch_tokens=24)
    model = _model()
    before = [p.detach().clone() for p in model.parameters()]
    metrics = step.train_batch(_engine(model, 1e-2), batch, adv_BT, ObjectiveConfig(), plan, temperature=1.0,
                               version=0, max_lag=3)
    assert torch.isfinite(torch.tensor(metrics["trajmesh_learner_loss"]))
    assert metrics["grad_norm"] > 0
    assert any(not torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))
