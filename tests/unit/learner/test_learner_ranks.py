"""Two learner ranks (gloo, DeepSpeed) train the same batches to the same weights as one rank.

Each rank takes its share of every batch (balanced by tokens), the loss denominators are all-reduced,
and a rank with fewer micro-batches runs zero-loss filler forwards (ZeRO-3 gathers are collective).

* fast (in ``make test``): 2 ranks under ZeRO-3, 3 steps (K = 2 minibatches, tiny micro-batches, 7-token
  log-prob chunks, clipping on): losses and every weight within 1e-5 of the torch engine (one
  process, no DeepSpeed) on the same batches. The ranks' micro-batches have different numbers of
  chunks, each a ZeRO-3 gather of the output head (PolicyLogprobs evens them out, or this hangs).
* slow: 2 ranks vs 1 rank for ZeRO 0, 2 and 3 (every weight within 1e-5 after 3 steps), with one
  log-prob chunk per forward (then ZeRO-3's module trace completes, and a filler whose backward
  differed from a real micro-batch's broke it on one rank only: a hang before PolicyLogprobs had
  one output); one micro-batched update across 2 ranks vs one forward over the whole batch (loss
  and every gradient within 1e-6); the ZeRO-3 weight export from 2 ranks (gathered layer by layer, written by rank 0
  only) byte-equal to the 1-rank and the unpartitioned export, and equal to the gathered weights
  after training.

A hung rank fails the test: every rank dumps its stack and exits after ``HANG_S`` (faulthandler),
and the parent kills what is left at its own deadline. This file is also the rank worker.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from repo_paths import TESTS

from trajmesh.infra import free_port

pytestmark = pytest.mark.skipif(importlib.util.find_spec("deepspeed") is None, reason="deepspeed not installed")

STAGES = (0, 2, 3)
LONG_CHUNK = 10**6  # one log-prob chunk per forward
HANG_S = {"fast": 300, "full": 900}  # a rank still running after this long is hung (a collective run by one rank only)


def _batch() -> Any:
    from trajmesh.contract import Trajectory
    from trajmesh.learner import step

    trajs = []
    for i in range(10):
        t = Trajectory.new(trajectory_id=f"t{i}")
        t.pb.group_id = f"g{i // 5}"
        t.append_prompt([1, 4 + i % 3, 6])
        n = 1 + (i * 7) % 11  # 1..11 sampled tokens: uneven lengths, uneven shares per rank
        t.append_sampled([(5 + 3 * j + i) % 28 + 1 for j in range(n)], [-3.0] * n, 0)
        t.set_reward(float(i % 2))
        trajs.append(t)
    return step.build_batch(trajs, 0)


def _train(engine_type: str, stage: int, batch: Any, adv_BT: Any, chunk_tokens: int,
           group: Any = None) -> tuple[Any, list[list[float]]]:
    """3 learner steps from tiny_llama(0) over the ranks of `group` (None: all); (engine, per step the
    loss of each update)."""
    from tiny_llama import tiny_llama

    from trajmesh.learner import step
    from trajmesh.learner.logprobs import PolicyLogprobs
    from trajmesh.learner.objective import ObjectiveConfig
    from trajmesh.learner.train_engine import build_train_engine

    engine = build_train_engine(PolicyLogprobs(tiny_llama(0), chunk_tokens=chunk_tokens), type=engine_type, lr=1e-2,
                                warmup_steps=0, weight_decay=0.0, grad_clip=0.5, zero_stage=stage, seed=0)
    losses = []
    for _ in range(3):
        m = step.train_batch(engine, batch, adv_BT, ObjectiveConfig(), step.StepPlan(12, minibatches=2),
                             temperature=1.0, version=0, max_lag=3, group=group)
        losses.append([u["loss"] for u in m["ppo_updates"]])
    return engine, losses


def _weights(engine: Any) -> dict[str, list[float]]:
    return {k: v.flatten().tolist() for k, v in engine.full_state_dict().items()}


def _micro_batched_update() -> dict[str, float]:
    """One update of the whole batch split over the ranks in micro-batches of <= 30 tokens (ZeRO-0,
    so the all-reduced gradients sit on the parameters) vs one forward over the whole batch."""
    import torch
    from tiny_llama import tiny_llama

    from trajmesh.learner import advantages, step
    from trajmesh.learner.logprobs import PolicyLogprobs, policy_of
    from trajmesh.learner.microbatch import balanced_split, pack_micro_batches, sum_over_ranks
    from trajmesh.learner.objective import ObjectiveConfig, decoupled_ppo_loss
    from trajmesh.learner.train_engine import build_train_engine

    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    batch = _batch()
    adv_BT = advantages.advantages_BT(batch, "grpo", scale_by_std=True, eps=1e-6)
    cfg = ObjectiveConfig(denominator="token_global")
    reference = tiny_llama(0)
    with torch.no_grad():  # π_prox ≠ π_θ: the clip paths of the loss are live
        prox_BT = step.token_logprobs(reference, batch, 1.0)[0] + 0.05 * batch.mask_BT
    logp_BT, _ = step.token_logprobs(reference, batch, 1.0)
    ref_loss, _ = decoupled_ppo_loss(logp_BT, prox_BT, batch.behavior_logp_BT, adv_BT, batch.mask_BT, cfg)
    ref_loss.backward()

    engine = build_train_engine(PolicyLogprobs(tiny_llama(0), chunk_tokens=7), type="deepspeed", lr=1e-2,
                                warmup_steps=0, weight_decay=0.0, grad_clip=0.5, zero_stage=0, seed=0)
    rows = balanced_split(batch.lengths(), world, keep_empty=True)[rank]
    sub = batch.select(rows)
    width = sub.input_ids_BT.shape[1]
    budget = 30
    micro = len(pack_micro_batches(sub.lengths(), budget))
    parts = step.accumulate_update(engine, sub, adv_BT[rows, :width], prox_BT[rows, :width], cfg, temperature=1.0,
                                   entropy_coef=0.0, micro_batch_tokens=budget, filler=batch.select([0]),
                                   loss_scale=float(world))
    loss = sum_over_ranks([sum(float(p.stats["loss"]) for _, p in parts)])[0]
    grad_diff = max(float((p.grad - r.grad).abs().max())
                    for p, r in zip(policy_of(engine.model).parameters(), reference.parameters(), strict=True))
    return {"loss": loss, "ref_loss": float(ref_loss), "max_grad_diff": grad_diff, "micro_batches": micro,
            "ref_grad_max": max(float(r.grad.abs().max()) for r in reference.parameters())}


def _worker(out_dir: str, mode: str) -> None:
    import faulthandler

    import torch

    from trajmesh.learner import advantages
    from trajmesh.learner.logprobs import policy_of
    from trajmesh.learner.train_engine import ensure_distributed
    from trajmesh.learner.weights import export_policy

    faulthandler.dump_traceback_later(HANG_S[mode], exit=True)  # a hang ends with every rank's stack in its log
    torch.set_num_threads(1)
    ensure_distributed("gloo")
    rank = torch.distributed.get_rank()
    batch = _batch()
    adv_BT = advantages.advantages_BT(batch, "grpo", scale_by_std=True, eps=1e-6)
    result: dict[str, Any] = {}
    if mode == "fast":
        solo = torch.distributed.new_group([0])  # the reference's world: rank 0 alone (collective call)
        engine, losses = _train("deepspeed", 3, batch, adv_BT, chunk_tokens=7)
        weights = _weights(engine)  # collective under ZeRO-3: every rank gathers
        if rank == 0:
            result["3"] = {"losses": losses, "weights": weights}
            ref_engine, ref_losses = _train("torch", 0, batch, adv_BT, chunk_tokens=7, group=solo)
            result["torch"] = {"losses": ref_losses, "weights": _weights(ref_engine)}
    else:
        for stage in STAGES:
            if stage == 3:  # export of the initial weights: every rank gathers, rank 0 writes
                from tiny_llama import tiny_llama

                from trajmesh.learner.logprobs import PolicyLogprobs
                from trajmesh.learner.train_engine import build_train_engine

                init = build_train_engine(PolicyLogprobs(tiny_llama(0)), type="deepspeed", lr=1e-2, warmup_steps=0,
                                          weight_decay=0.0, grad_clip=0.5, zero_stage=3, seed=0)
                result["export_init_sha"] = export_policy(policy_of(init.model), Path(out_dir, "export_init"),
                                                          zero3=True, write=rank == 0)
                del init
            engine, losses = _train("deepspeed", stage, batch, adv_BT, chunk_tokens=LONG_CHUNK)
            weights = _weights(engine)
            result[str(stage)] = {"losses": losses, "weights": weights}
            if stage == 3:
                result["export_final_sha"] = export_policy(policy_of(engine.model), Path(out_dir, "export_final"),
                                                           zero3=True, write=rank == 0)
        result["micro"] = _micro_batched_update()
    Path(out_dir, f"result{rank}.json").write_text(json.dumps(result))


def _run(world: int, out: Path, mode: str) -> list[dict]:
    """Start `world` rank processes of this file; every rank's result (a hang fails, never blocks)."""
    out.mkdir(parents=True)
    port = str(free_port())
    procs = []
    for rank in range(world):
        env = {**os.environ, "RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(world),
               "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port, "DS_ACCELERATOR": "cpu",
               # the rank imports the support modules of tests/ (tiny_llama), not beside this file
               "PYTHONPATH": os.pathsep.join([str(TESTS), os.environ.get("PYTHONPATH", "")])}
        log = open(out / f"rank{rank}.log", "w")  # noqa: SIM115 - closed with the process
        procs.append((subprocess.Popen([sys.executable, __file__, str(out), mode], env=env, stdout=log,
                                       stderr=log), log))
    try:
        codes = []
        for p, _ in procs:
            try:
                codes.append(p.wait(timeout=HANG_S[mode] + 60))  # faulthandler ends a hung rank first
            except subprocess.TimeoutExpired:
                codes.append(None)
    finally:
        for p, log in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
            log.close()
    logs = "\n".join(f"--- rank {r}\n" + (out / f"rank{r}.log").read_text()[-4000:] for r in range(world))
    assert codes == [0] * world, f"exit codes {codes}\n{logs}"
    return [json.loads((out / f"result{r}.json").read_text()) for r in range(world)]


def _assert_same_training(a: dict, b: dict, label: str) -> None:
    for x, y in zip(a["losses"], b["losses"], strict=True):
        assert x == pytest.approx(y, abs=1e-5), label
    assert a["losses"][0] != a["losses"][-1], label  # the weights moved
    assert a["weights"].keys() == b["weights"].keys(), label
    for name, w1 in a["weights"].items():
        w2 = b["weights"][name]
        assert max(abs(x - y) for x, y in zip(w1, w2, strict=True)) <= 1e-5, (label, name)


def test_two_zero3_ranks_train_the_same_weights_as_the_torch_engine(tmp_path: Path) -> None:
    rank0, _ = _run(2, tmp_path / "two", "fast")
    _assert_same_training(rank0["3"], rank0["torch"], "zero3 x2 vs torch")


@pytest.mark.slow
def test_two_ranks_train_the_same_weights_as_one_and_export_the_same_bytes(tmp_path: Path) -> None:
    import torch
    from safetensors.torch import load_file
    from tiny_llama import tiny_llama

    from trajmesh.learner.weights import export_policy

    (one,) = _run(1, tmp_path / "one", "full")
    two = _run(2, tmp_path / "two", "full")
    for stage in map(str, STAGES):
        _assert_same_training(one[stage], two[0][stage], f"zero{stage}")

    # Weights out under ZeRO-3: the same bytes from 2 ranks as from 1 and from the plain model; rank 1
    # gathered (its call returned None) but wrote nothing.
    plain = export_policy(tiny_llama(0), tmp_path / "plain")
    assert two[0]["export_init_sha"] == one["export_init_sha"] == plain
    assert two[1]["export_init_sha"] is None and two[1]["export_final_sha"] is None
    exported = load_file(str(tmp_path / "two" / "export_final" / "model.safetensors"))
    trained = two[0]["3"]["weights"]
    assert "policy.lm_head.weight" in trained and "lm_head.weight" not in exported  # tied: written once
    for name, t in exported.items():
        assert torch.equal(t.flatten(), torch.tensor(trained[f"policy.{name}"], dtype=t.dtype)), name

    # One micro-batched update across 2 ranks equals one forward over the whole batch.
    for r in range(2):
        m = two[r]["micro"]
        assert m["micro_batches"] >= 2  # each rank's share is cut into micro-batches
        assert m["loss"] == pytest.approx(m["ref_loss"], abs=1e-6)
        assert abs(m["ref_loss"]) > 1e-3 and m["ref_grad_max"] > 1e-3  # not trivially 0
        assert m["max_grad_diff"] <= 1e-6


if __name__ == "__main__":
    _worker(sys.argv[1], sys.argv[2])
