"""Two learner ranks (gloo, DeepSpeed) train the same batches to the same weights as one rank.

Each rank takes its share of every batch (balanced by tokens), the loss denominators are all-reduced,
and a rank with fewer micro-batches runs zero-loss filler forwards (ZeRO-3 gathers are collective).
Weights after 3 steps (K = 2 minibatches, tiny micro-batches, clipping on) agree within 1e-5 for
ZeRO stages 0 and 2. This file is also the rank worker (run as a script).
"""

from __future__ import annotations

import importlib.util
import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

# ZeRO-3 across 2 ranks hangs in the first step (cause not found yet): not covered, see docs/LEARNER.md.
STAGES = (0, 2)


def _worker(out_dir: str) -> None:
    import torch
    from trajmesh.learner import step
    from trajmesh.learner.logprobs import PolicyLogprobs
    from trajmesh.learner.objective import ObjectiveConfig
    from trajmesh.learner.train_engine import build_train_engine, ensure_distributed
    from transformers import LlamaConfig, LlamaForCausalLM

    from trajmesh.contract import Trajectory

    torch.set_num_threads(1)
    ensure_distributed("gloo")
    rank = torch.distributed.get_rank()
    trajs = []
    for i in range(10):
        t = Trajectory.new(trajectory_id=f"t{i}")
        t.pb.group_id = f"g{i // 5}"
        t.append_prompt([1, 4 + i % 3, 6])
        n = 1 + (i * 7) % 11
        t.append_sampled([(5 + 3 * j + i) % 28 + 1 for j in range(n)], [-3.0] * n, 0)
        t.set_reward(float(i % 2))
        trajs.append(t)
    batch = step.build_batch(trajs, 0)
    adv_BT = step.advantages_BT(batch, "grpo", scale_by_std=True, eps=1e-6)
    result = {}
    for stage in STAGES:
        torch.manual_seed(0)
        cfg = LlamaConfig(vocab_size=30, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                          num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=64,
                          tie_word_embeddings=True)
        engine = build_train_engine(PolicyLogprobs(LlamaForCausalLM(cfg).float(), chunk_tokens=7), type="deepspeed", lr=1e-2,
                                    warmup_steps=0, weight_decay=0.0, grad_clip=0.5, zero_stage=stage, seed=0)
        losses = []
        for _ in range(3):
            m = step.train_batch(engine, batch, adv_BT, ObjectiveConfig(), step.StepPlan(12, minibatches=2),
                                 temperature=1.0, version=0, max_lag=3)
            losses.append([u["loss"] for u in m["ppo_updates"]])
        state = engine.full_state_dict()
        if rank == 0:
            result[stage] = {"losses": losses, "weights": {k: v.flatten().tolist() for k, v in state.items()}}
    if rank == 0:
        Path(out_dir, "result.json").write_text(json.dumps(result))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run(world: int, out: Path) -> dict:
    out.mkdir(parents=True)
    port = str(_free_port())
    procs = []
    for rank in range(world):
        env = {**os.environ, "RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(world),
               "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port, "DS_ACCELERATOR": "cpu"}
        log = open(out / f"rank{rank}.log", "w")  # noqa: SIM115 - closed with the process
        procs.append((subprocess.Popen([sys.executable, __file__, str(out)], env=env, stdout=log, stderr=log), log))
    for p, log in procs:
        try:
            assert p.wait(timeout=900) == 0, (out / "rank0.log").read_text()[-3000:]
        finally:
            log.close()
            if p.poll() is None:
                p.kill()
    return json.loads((out / "result.json").read_text())


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("deepspeed") is None, reason="deepspeed not installed")
def test_two_ranks_train_the_same_weights_as_one(tmp_path: Path) -> None:
    one = _run(1, tmp_path / "one")
    two = _run(2, tmp_path / "two")
    for stage in map(str, STAGES):
        for a, b in zip(one[stage]["losses"], two[stage]["losses"], strict=True):
            assert a == pytest.approx(b, abs=1e-5), stage
        assert one[stage]["losses"][0] != one[stage]["losses"][-1]  # the weights moved
        for name, w1 in one[stage]["weights"].items():
            w2 = two[stage]["weights"][name]
            assert max(abs(x - y) for x, y in zip(w1, w2, strict=True)) <= 1e-5, (stage, name)


if __name__ == "__main__":
    _worker(sys.argv[1])
