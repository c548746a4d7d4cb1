"""PRIME's cost per learner step against outcome-only RLOO on the same batch, side by side in one run
(issue 46; survey §7.4: the paper reports 680.3 s against 530.7 s per step, ≈ 1.28×):

* ``prime_{before,after}_over_rloo_step_time_ratio`` — time of one learner step: the recipe, then
  the policy's decoupled-PPO update. PRIME's recipe also takes the implicit PRM's step: a π_ref
  forward, a πφ forward + backward + AdamW step, and with ``learner.prime.update: before`` a second
  πφ forward. CPU time of one thread on a CPU (steadier than wall time on a shared machine), wall
  time on a GPU; the median over the measured steps.
* ``prime_{before,after}_over_rloo_peak_memory_ratio`` — the rise of the process's peak memory from
  just before the engines (and for PRIME the PRM and its reference) are built to the end of the
  steps: peak RSS on a CPU, ``torch.cuda.max_memory_allocated`` on a GPU. PRIME holds two more
  models (πφ with its AdamW state, the frozen π_ref).

Each variant (RLOO; PRIME with ``update: before`` and ``after``) runs in a fresh subprocess (the
peak is per process) on the same seeded batch (8 prompts × 4 samples of 16 + 48 tokens, random 0/1
outcomes) and the same seeded Llama (vocabulary 4096, d = 256, 4 layers), torch engine, fp32 on a
CPU, bf16 on a GPU. No goal: a report. The paper's step time includes generation; this one is the
learner's step alone.
Run: ``.venv/bin/python bench/bench_prime.py`` (or ``python bench/run.py prime``).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import resource
import statistics
import subprocess
import sys
import time

import torch

VOCAB, HIDDEN, LAYERS = 4096, 256, 4
GROUPS, GROUP_SIZE, PROMPT, RESPONSE = 8, 4, 16, 48
STEPS = 4  # the first is a warm-up, not timed


def _rss_bytes() -> int:
    with open("/proc/self/statm") as fh:
        return int(fh.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _trajectories():  # type: ignore[no-untyped-def]
    from trajmesh.contract import Trajectory
    from trajmesh.v1 import trajectory_pb2

    g = torch.Generator().manual_seed(0)
    out = []
    for i in range(GROUPS * GROUP_SIZE):
        t = Trajectory.new(trajectory_id=f"t{i}")
        t.pb.group_id, t.pb.task_id = f"g{i // GROUP_SIZE}", f"task{i // GROUP_SIZE}"
        t.append_prompt(torch.randint(4, VOCAB, (PROMPT,), generator=g).tolist())
        t.append_sampled(torch.randint(4, VOCAB, (RESPONSE,), generator=g).tolist(), [-9.0] * RESPONSE, 0)
        t.finish(trajectory_pb2.EOS)
        t.set_reward(float(torch.rand((), generator=g) < 0.5))
        out.append(t)
    return out


def _child(advantage: str, update: str) -> None:
    from transformers import LlamaConfig, LlamaForCausalLM

    from trajmesh.config import load_config
    from trajmesh.learner.logprobs import PolicyLogprobs
    from trajmesh.learner.prm import ImplicitPRM
    from trajmesh.learner.recipe import prepare
    from trajmesh.learner.step import StepPlan, train_batch
    from trajmesh.learner.train_engine import build_train_engine

    cuda = torch.cuda.is_available()
    precision = "bf16" if cuda else "fp32"
    if not cuda:
        torch.set_num_threads(1)  # CPU time of one thread: steadier than wall time on a shared machine
    clock = time.perf_counter if cuda else time.process_time
    cfg = load_config(None, {"tasks.group_size": GROUP_SIZE, "learner.advantage.type": advantage,
                             "learner.prime.update": update, "learner.engine.type": "torch"})
    lc = cfg.learner
    torch.manual_seed(0)
    llama = LlamaForCausalLM(LlamaConfig(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=2 * HIDDEN,
                                         num_hidden_layers=LAYERS, num_attention_heads=4, num_key_value_heads=4,
                                         max_position_embeddings=512, tie_word_embeddings=True)).float()
    if cuda:
        llama = llama.cuda()
    policy = PolicyLogprobs(llama, lc.logprob_chunk_tokens)
    trajs = _trajectories()
    gc.collect()
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
    else:
        base = _rss_bytes()
    prm = (ImplicitPRM(policy, lc.prime, engine_type="torch", zero_stage=0, precision=precision, seed=0,
                       deterministic=False, micro_batch_tokens=lc.micro_batch_tokens)
           if advantage == "prime" else None)
    engine = build_train_engine(policy, type="torch", lr=1e-5, warmup_steps=0, weight_decay=0.0, grad_clip=1.0,
                                seed=0, precision=precision, deterministic=False)
    plan = StepPlan(micro_batch_tokens=lc.micro_batch_tokens)
    times: list[float] = []
    prm_times: list[float] = []

    def prm_step(batch):  # type: ignore[no-untyped-def]  # the PRM's step, on the same clock
        assert prm is not None
        start = clock()
        out = prm.step(batch)
        if cuda:
            torch.cuda.synchronize()
        prm_times.append(clock() - start)
        return out

    for step in range(STEPS):
        if cuda:
            torch.cuda.synchronize()
        start = clock()
        recipe = prepare(trajs, cfg, version=0, eta=1, pad_id=0,
                         process_rewards=prm_step if prm is not None else None)
        assert recipe.batch is not None and recipe.adv_BT is not None
        train_batch(engine, recipe.batch, recipe.adv_BT, lc.objective, plan, temperature=1.0, version=0, max_lag=2)
        if cuda:
            torch.cuda.synchronize()
        if step > 0:
            times.append(clock() - start)
    peak = (torch.cuda.max_memory_allocated() if cuda
            else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024) - base
    print(json.dumps({"step_s": statistics.median(times),
                      "prm_step_s": statistics.median(prm_times[1:]) if prm_times else 0.0,
                      "peak_rise_bytes": max(peak, 0), "device": "cuda" if cuda else "cpu"}))


def _measure(advantage: str, update: str) -> dict[str, float]:
    out = subprocess.run([sys.executable, __file__, "--child", advantage, "--update", update], check=True,
                         capture_output=True, text=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main(argv: list[str]) -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--child", choices=["rloo", "prime"])
    ap.add_argument("--update", choices=["before", "after"], default="before")
    args = ap.parse_args(argv)
    if args.child:
        _child(args.child, args.update)
        return
    runs = {"rloo": _measure("rloo", "before"), "prime before": _measure("prime", "before"),
            "prime after": _measure("prime", "after")}
    base = runs["rloo"]
    mib = 2**20
    print(f"device {base['device']}; {GROUPS}x{GROUP_SIZE} sequences of {PROMPT}+{RESPONSE} tokens; Llama V={VOCAB} "
          f"d={HIDDEN} L={LAYERS}; median of {STEPS - 1} steps after a warm-up")
    print(f"  {'':26s}" + "".join(f"{k:>14s}" for k in runs))
    print(f"  {'step time (s)':26s}" + "".join(f"{r['step_s']:14.3f}" for r in runs.values()))
    print(f"  {'  of it the PRM step (s)':26s}" + "".join(f"{r['prm_step_s']:14.3f}" for r in runs.values()))
    print(f"  {'step time / rloo':26s}" + "".join(f"{r['step_s'] / base['step_s']:14.2f}" for r in runs.values()))
    print(f"  {'peak memory rise (MiB)':26s}" + "".join(f"{r['peak_rise_bytes'] / mib:14.0f}" for r in runs.values()))
    print(f"  {'peak memory rise / rloo':26s}"
          + "".join(f"{r['peak_rise_bytes'] / max(base['peak_rise_bytes'], 1):14.2f}" for r in runs.values()))
    ratios = {f"prime_{u}_over_rloo_step_time_ratio": round(runs[f"prime {u}"]["step_s"] / base["step_s"], 3)
              for u in ("before", "after")}
    ratios.update({f"prime_{u}_over_rloo_peak_memory_ratio":
                   round(runs[f"prime {u}"]["peak_rise_bytes"] / max(base["peak_rise_bytes"], 1), 3)
                   for u in ("before", "after")})
    ratios["paper_prime_over_rloo_step_time_ratio"] = round(680.3 / 530.7, 3)
    print(json.dumps(ratios))


if __name__ == "__main__":
    main(sys.argv[1:])
