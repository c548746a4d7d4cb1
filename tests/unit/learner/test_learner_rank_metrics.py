"""Step metrics across ranks: two gloo ranks report what one rank reports for the same batch.

`train_batch` with several ranks all-reduces each rank's π_θ, π_prox and entropy of its rows and
its loss stats, so the step's metrics (entropy, clip fractions, ratios, KL, per-action-type
entropy...) are over the whole batch on every rank, not over rank 0's share: the learner service
writes rank 0's and drives the entropy controller with it. One step, K = 2 minibatches, tiny
micro-batches. Marked slow: ~90-110 s on 2 busy cores (1 and 2 ranks side by side). This file is
also the rank worker (run as a script).
"""

from __future__ import annotations

import importlib.util
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
from repo_paths import TESTS

from trajmesh.infra import free_port


def _worker(out_dir: str) -> None:
    import torch
    from tiny_llama import tiny_llama

    from trajmesh.contract import Trajectory
    from trajmesh.learner import advantages, step
    from trajmesh.learner.logprobs import PolicyLogprobs
    from trajmesh.learner.objective import ObjectiveConfig
    from trajmesh.learner.train_engine import build_train_engine, ensure_distributed

    torch.set_num_threads(1)
    ensure_distributed("gloo")
    rank = torch.distributed.get_rank()
    trajs = []
    for i in range(10):
        t = Trajectory.new(trajectory_id=f"t{i}")
        t.pb.group_id = f"g{i // 5}"
        t.append_prompt([1, 4 + i % 3, 6])
        n = 1 + (i * 7) % 11
        # behavior log-probs far from the policy's: the behavior weights and clip fractions are not trivial
        t.append_sampled([(5 + 3 * j + i) % 28 + 1 for j in range(n)], [-0.5 - 0.4 * (j % 5) for j in range(n)], 0)
        t.set_reward(float(i % 2))
        trajs.append(t)
    batch = step.build_batch(trajs, 0)
    adv_BT = advantages.advantages_BT(batch, "grpo", scale_by_std=True, eps=1e-6)
    engine = build_train_engine(PolicyLogprobs(tiny_llama(0), chunk_tokens=7), type="deepspeed", lr=5e-2,
                                warmup_steps=0, weight_decay=0.0, grad_clip=1.0, zero_stage=0, seed=0)
    m = step.train_batch(engine, batch, adv_BT, ObjectiveConfig(), step.StepPlan(12, minibatches=2),
                         temperature=1.0, version=0, max_lag=3)
    numbers = {k: float(v) for k, v in m.items() if isinstance(v, (int, float))}
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(numbers))


def _start(world: int, out: Path) -> list[tuple[subprocess.Popen[bytes], object]]:
    out.mkdir(parents=True)
    port = str(free_port())
    procs = []
    for rank in range(world):
        env = {**os.environ, "RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(world),
               "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port, "DS_ACCELERATOR": "cpu",
               "PYTHONPATH": os.pathsep.join([str(TESTS), os.environ.get("PYTHONPATH", "")])}
        log = open(out / f"rank{rank}.log", "w")  # noqa: SIM115 - closed with the process
        procs.append((subprocess.Popen([sys.executable, __file__, str(out)], env=env, stdout=log, stderr=log), log))
    return procs


def _results(procs: list[tuple[subprocess.Popen[bytes], object]], out: Path) -> list[dict[str, float]]:
    for rank, (p, log) in enumerate(procs):
        try:
            assert p.wait(timeout=600) == 0, (out / f"rank{rank}.log").read_text()[-3000:]
        finally:
            log.close()  # type: ignore[attr-defined]
            if p.poll() is None:
                p.kill()
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(len(procs))]


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("deepspeed") is None, reason="deepspeed not installed")
@pytest.mark.timeout(600)
def test_two_ranks_report_the_step_metrics_of_one(tmp_path: Path) -> None:
    started = {1: _start(1, tmp_path / "one"), 2: _start(2, tmp_path / "two")}  # side by side: one wait
    try:
        (one,) = _results(started[1], tmp_path / "one")
        two = _results(started[2], tmp_path / "two")
    finally:
        for p, _ in started[1] + started[2]:
            if p.poll() is None:
                p.kill()
                p.wait()
    skip = {"grad_norm", "lr"}  # the optimizer's, not the batch's (grad_norm is per update, compared by weights elsewhere)
    keys = [k for k in one if k not in skip and math.isfinite(one[k])]
    assert "trajmesh_learner_entropy_nats" in keys and len(keys) > 15
    # The batch moves the policy off its behavior: some figures are not trivially 0 or 1.
    assert any(one[k] not in (0.0, 1.0) for k in keys if "frac" in k or "ratio" in k)
    for rank, metrics in enumerate(two):
        for k in keys:
            assert metrics[k] == pytest.approx(one[k], rel=1e-5, abs=1e-6), (rank, k, metrics[k], one[k])


if __name__ == "__main__":
    _worker(sys.argv[1])
