"""On CUDA: two bf16 ZeRO-3 learner steps of a tiny model; every tensor on the model's device, a
finite loss, fp32 master weights behind bf16 parameters. Skipped without a CUDA device."""

from __future__ import annotations

import dataclasses
import importlib.util
import os

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
    pytest.mark.skipif(importlib.util.find_spec("deepspeed") is None, reason="deepspeed not installed"),
]


def test_two_bf16_zero3_steps_on_cuda() -> None:
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from trajmesh.contract import Trajectory
    from trajmesh.learner import advantages, consistency, step
    from trajmesh.learner.logprobs import PolicyLogprobs
    from trajmesh.learner.objective import ObjectiveConfig
    from trajmesh.learner.train_engine import build_train_engine, ensure_distributed, shutdown_distributed

    created = ensure_distributed("nccl")
    try:
        torch.manual_seed(0)
        cfg = Qwen2Config(vocab_size=64, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                          num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)
        model = Qwen2ForCausalLM._from_config(cfg, attn_implementation="sdpa")
        engine = build_train_engine(PolicyLogprobs(model, chunk_tokens=16), type="deepspeed", lr=1e-3,
                                    warmup_steps=0, weight_decay=0.0, grad_clip=1.0, zero_stage=3, seed=0,
                                    precision="bf16")
        trajs = []
        for i in range(8):
            t = Trajectory.new(trajectory_id=f"t{i}")
            t.pb.group_id = f"g{i // 4}"
            t.append_prompt([1, 3 + i, 5])
            t.append_sampled([7 + i, 9, 11 + i % 3], [-2.0, -2.0, -2.0], 0)
            t.set_reward(float(i % 2))
            trajs.append(t)
        batch = step.build_batch(trajs, 0)  # built on the CPU, as the service does
        adv_BT = advantages.advantages_BT(batch, "grpo", scale_by_std=True, eps=1e-6)
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        assert step.model_device(engine.module) == device  # ZeRO-3 placeholders sit on the rank's GPU
        moved = batch.to(step.model_device(engine.module))  # what every forward feeds the model
        tensors = {f.name: getattr(moved, f.name) for f in dataclasses.fields(moved)
                   if isinstance(getattr(moved, f.name), torch.Tensor)}
        assert {"input_ids_BT", "attention_BT", "mask_BT", "behavior_logp_BT"} <= tensors.keys()
        assert all(t.device == device for t in tensors.values()), {k: t.device for k, t in tensors.items()}
        logp_BT, _ = step.token_logprobs(engine.module, batch, 1.0)
        assert logp_BT.device == device
        assert consistency.probe(engine.module, trajs, version=0, pad_id=0, temperature=1.0, max_trajectories=2)
        for _ in range(2):
            metrics = step.train_batch(engine, batch, adv_BT, ObjectiveConfig(),
                                       step.StepPlan(micro_batch_tokens=16, minibatches=2), temperature=1.0,
                                       version=0, max_lag=3)
            assert torch.isfinite(torch.tensor([metrics["trajmesh_learner_loss"], metrics["grad_norm"]])).all()
        assert next(engine.model.parameters()).device == device
        assert next(engine.model.parameters()).dtype == torch.bfloat16
        masters = engine.engine.optimizer.fp32_partitioned_groups_flat  # ZeRO-3's fp32 master partitions
        assert masters and all(m.dtype == torch.float32 for m in masters)
    finally:
        if created:
            shutdown_distributed()
