"""Token-budget micro-batches: the accumulated loss and gradient equal one full-batch forward."""

from __future__ import annotations

import pytest
import torch
from tiny_llama import tiny_llama
from transformers import LlamaForCausalLM

from trajmesh.contract import Trajectory
from trajmesh.learner import advantages, step
from trajmesh.learner.microbatch import balanced_split, global_counts, pack_micro_batches
from trajmesh.learner.objective import ObjectiveConfig, decoupled_ppo_loss
from trajmesh.learner.train_engine import build_train_engine


def _model() -> LlamaForCausalLM:
    return tiny_llama()


def _batch() -> step.Batch:
    """8 trajectories of uneven lengths (4..16 tokens), 4 groups, behavior log-probs off π_θ."""
    trajs = []
    for i in range(8):
        t = Trajectory.new(trajectory_id=f"t{i}")
        t.pb.group_id = f"g{i // 2}"
        t.append_prompt([1, 4 + i % 5, 6])
        n = 1 + (i * 5) % 13
        t.append_sampled([(7 + 3 * j + i) % 29 + 1 for j in range(n)], [-2.0 - 0.05 * j for j in range(n)], 0)
        t.set_reward(float((i * 7) % 3))
        trajs.append(t)
    return step.build_batch(trajs, 0)


def _proximal(model: LlamaForCausalLM, batch: step.Batch) -> torch.Tensor:
    with torch.no_grad():
        return step.token_logprobs(model, batch, 1.0)[0] + 0.05 * batch.mask_BT  # r ≠ 1: clip paths active


def _full_batch_reference(model, batch, adv_BT, prox_BT, cfg) -> tuple[float, list[torch.Tensor]]:
    """One forward over the whole batch; the loss's own denominator (no global counts passed)."""
    model.zero_grad()
    logp_BT, _ = step.token_logprobs(model, batch, 1.0)
    loss, _ = decoupled_ppo_loss(logp_BT, prox_BT, batch.behavior_logp_BT, adv_BT, batch.mask_BT, cfg)
    loss.backward()
    return float(loss.detach()), [p.grad.clone() for p in model.parameters()]


@pytest.mark.parametrize("denominator", ["token_global", "sequence_mean", "constant"])
def test_micro_batched_loss_and_gradients_equal_the_full_batch(denominator: str) -> None:
    model = _model()
    batch = _batch()
    adv_BT = advantages.advantages_BT(batch, "grpo", scale_by_std=True, eps=1e-6)
    prox_BT = _proximal(model, batch)
    cfg = ObjectiveConfig(denominator=denominator, constant_denominator=16.0)
    ref_loss, ref_grads = _full_batch_reference(model, batch, adv_BT, prox_BT, cfg)

    engine = build_train_engine(model, type="torch", lr=1e-3, warmup_steps=0, weight_decay=0.0, grad_clip=1.0,
                                seed=0)
    engine.zero_grad()
    budget = 30  # the batch pads to 8 x 16 = 128 tokens: micro-batches of 1-3 rows
    assert len(pack_micro_batches(batch.lengths(), budget)) >= 4
    parts = step.accumulate_update(engine, batch, adv_BT, prox_BT, cfg, temperature=1.0, entropy_coef=0.0,
                                   micro_batch_tokens=budget)
    loss = sum(float(p.stats["loss"]) for _, p in parts)
    assert loss == pytest.approx(ref_loss, abs=1e-6)
    assert abs(ref_loss) > 1e-3  # a loss that is not trivially 0
    for got, ref in zip([p.grad for p in model.parameters()], ref_grads, strict=True):
        torch.testing.assert_close(got, ref, rtol=0, atol=1e-6)


def test_pack_micro_batches_respects_the_budget_and_covers_every_row_once() -> None:
    lengths = [5, 19, 7, 12, 12, 3, 30, 1]
    micro = pack_micro_batches(lengths, 24)
    assert sorted(i for rows in micro for i in rows) == list(range(8))
    for rows in micro:
        assert len(rows) * max(lengths[i] for i in rows) <= 24 or len(rows) == 1
    assert [6] in micro  # 30 tokens > budget: alone
    assert pack_micro_batches(lengths, 10**6) == [[6, 1, 3, 4, 2, 0, 5, 7]]  # one micro-batch, longest first


def test_balanced_split_balances_tokens() -> None:
    lengths = [10, 1, 9, 2, 8, 3, 7, 4]
    parts = balanced_split(lengths, 4)
    assert sorted(i for p in parts for i in p) == list(range(8))
    assert [sum(lengths[i] for i in p) for p in parts] == [11, 11, 11, 11]
    assert len(balanced_split([3, 4], 4)) == 2  # never an empty minibatch


def test_global_counts_without_a_process_group() -> None:
    mask_BT = torch.tensor([[0, 1, 1, 0], [0, 0, 0, 0], [1, 1, 1, 1]], dtype=torch.float32)
    counts = global_counts(mask_BT)
    assert (counts.tokens, counts.sequences) == (6.0, 2.0)
