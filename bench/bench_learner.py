"""Learner memory at scale, side by side in one run (docs/DESIGN.md §4b; goals from issue 11):

* ``step_4x_over_1x_peak_ratio`` — peak memory of one learner step (torch engine, fp32, K = 1) on 4×
  the batch over 1× at the same ``micro_batch_tokens`` (goal ≤ 1.2: micro-batches bound the peak);
* ``chunked_over_naive_logprob_peak_ratio`` — peak memory of token log-probs + entropy, forward
  and backward, from hidden states through a 32k-vocabulary head: chunked (learner/logprobs.py)
  over the naive fp32 [B, T, V] computation (goal ≤ 0.25);
* ``demo_step_K4_over_K1_time_ratio`` — CPU time of a learner step at the demo's shapes (tiny
  Llama d = 128, 256 sequences of ~22 tokens) with 4 PPO minibatches over 1 (for the demo's K);
* ``ranks_2_over_1_tokens_per_s_ratio`` — learner tokens/s (DeepSpeed ZeRO-3, gloo, one thread per
  rank) of 2 ranks over 1 on the same batches at the demo's shapes, both worlds run back to back in
  one run (report, no goal). On a machine with fewer than 2 free cores the ranks share cores.
* ``reference_zero3_{copied,partitioned}_over_zero0_added_peak_ratio`` — what the frozen reference
  model (``learner.reference``, learner/reference.py) adds to a rank's peak memory under ZeRO-3 over
  what it adds under ZeRO-0, 2 ranks (DeepSpeed, gloo), one step with the KL term on: each rank's
  peak RSS rise over building the engine (and reference) and stepping, reference on minus off, at a
  513 MiB fp32 model (Llama, 8k vocabulary, d = 1024, 12 layers); and the reference's parameter
  bytes each rank holds (exact: its tensors, ZeRO-3 partitions). ``copied``: the reference
  deep-copied from the policy before the engine; ``partitioned``: built after it under
  ``deepspeed.zero.Init`` (what the learner does under ZeRO-3). A partitioned copy is half of a
  whole one on 2 ranks (report, no goal).

Memory is measured in fresh subprocesses (one per figure) as the rise of the process's peak RSS
(``ru_maxrss``) over its RSS just before the measured call: torch's CPU allocations are invisible to
tracemalloc. Run: ``.venv/bin/python bench/bench_learner.py`` (or ``python bench/run.py learner``).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import resource
import subprocess
import sys
import time
from collections.abc import Callable

import torch

from trajmesh.infra import free_port

VOCAB = 32000
STEP_GOAL = 1.2
LOGPROB_GOAL = 0.25


def _rss_bytes() -> int:
    with open("/proc/self/statm") as fh:
        return int(fh.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _peak_rise(fn: Callable[[], object]) -> int:
    """Bytes the process's peak RSS rose above its RSS before ``fn``."""
    gc.collect()
    before = _rss_bytes()
    fn()
    return max(0, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - before)


def _llama(vocab: int, hidden: int, layers: int) -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
                      num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=512,
                      tie_word_embeddings=True)
    return LlamaForCausalLM(cfg).float()


def _batch(n: int, lengths: list[int], vocab: int, prompt: int = 4):  # type: ignore[no-untyped-def]
    from trajmesh.contract import Trajectory
    from trajmesh.learner import step

    g = torch.Generator().manual_seed(n)
    trajs = []
    for i in range(n):
        t = Trajectory.new(trajectory_id=f"t{i}")
        t.pb.group_id = f"g{i // 8}"
        t.append_prompt(torch.randint(4, vocab, (prompt,), generator=g).tolist())
        k = lengths[i % len(lengths)] - prompt
        t.append_sampled(torch.randint(4, vocab, (k,), generator=g).tolist(), [-1.0] * k, 0)
        t.set_reward(float(i % 2))
        trajs.append(t)
    return step.build_batch(trajs, 0)


def _learner_step(n_seqs: int, budget: int, minibatches: int = 1, vocab: int = VOCAB, hidden: int = 128,
                  layers: int = 2, lengths: tuple[int, ...] = (96, 128, 112, 80)) -> Callable[[], object]:
    from trajmesh.learner import advantages, step
    from trajmesh.learner.logprobs import PolicyLogprobs
    from trajmesh.learner.objective import ObjectiveConfig
    from trajmesh.learner.train_engine import build_train_engine

    engine = build_train_engine(PolicyLogprobs(_llama(vocab, hidden, layers)), type="torch", lr=1e-4,
                                warmup_steps=0, weight_decay=0.0, grad_clip=1.0, seed=0)
    batch = _batch(n_seqs, list(lengths), vocab)
    adv_BT = advantages.advantages_BT(batch, "grpo", scale_by_std=True, eps=1e-6)
    plan = step.StepPlan(micro_batch_tokens=budget, minibatches=minibatches)
    return lambda: step.train_batch(engine, batch, adv_BT, ObjectiveConfig(), plan, temperature=1.0, version=0,
                                    max_lag=3)


def _logprob_pass(mode: str, tokens: int, chunk: int) -> Callable[[], object]:
    from trajmesh.learner.logprobs import chunked_token_stats, naive_token_stats

    torch.manual_seed(0)
    b, hidden = 8, 128
    t = tokens // b
    head = torch.nn.Linear(hidden, VOCAB, bias=False)
    h_BTH = torch.randn(b, t, hidden, requires_grad=True)
    ids_BT = torch.randint(0, VOCAB, (b, t))

    def run() -> None:
        if mode == "naive":
            logp_BT, ent_BT = naive_token_stats(head(h_BTH), ids_BT, 1.0)
        else:
            logp_BT, ent_BT = chunked_token_stats(h_BTH, ids_BT, head, 1.0, chunk)
        (logp_BT.sum() + ent_BT.sum()).backward()

    return run


def _child(args: argparse.Namespace) -> None:
    torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))
    if args.child == "step":
        fn = _learner_step(args.seqs, args.budget)
    else:
        fn = _logprob_pass(args.child, args.tokens, args.chunk)
    print(json.dumps({"peak_rise_bytes": _peak_rise(fn)}))


def _measure(*child_args: str) -> int:
    out = subprocess.run([sys.executable, __file__, "--child", *child_args], capture_output=True, text=True,
                         timeout=1800, check=True)
    return int(json.loads(out.stdout.strip().splitlines()[-1])["peak_rise_bytes"])


def _demo_step_times() -> tuple[float, float]:
    """Best of 5 learner-step CPU times at the demo's shapes, K = 1 and K = 4, interleaved, one
    thread (CPU time on one thread is what stays stable on a shared machine; wall time is not)."""
    torch.set_num_threads(1)
    fns = [_learner_step(256, 16384, minibatches=k, vocab=50, hidden=128, layers=4, lengths=(20, 22, 24, 21))
           for k in (1, 4)]
    best = [float("inf")] * len(fns)
    for _ in range(6):  # the first round warms up
        for i, fn in enumerate(fns):
            t0 = time.process_time()
            fn()
            best[i] = min(best[i], time.process_time() - t0)
    return best[0], best[1]


RANK_STEPS = 3  # timed learner steps per world (after one untimed warm-up step)


def _rank_child(steps: int) -> None:
    """One rank of a ZeRO-3 learner world: a warm-up step, then `steps` timed steps of the same
    batch; rank 0 prints the world's tokens (sum over ranks) and the wall time between barriers."""
    from trajmesh.learner import advantages, step
    from trajmesh.learner.logprobs import PolicyLogprobs
    from trajmesh.learner.objective import ObjectiveConfig
    from trajmesh.learner.train_engine import build_train_engine, ensure_distributed

    torch.set_num_threads(1)
    ensure_distributed("gloo")
    dist = torch.distributed
    engine = build_train_engine(PolicyLogprobs(_llama(50, 128, 4)), type="deepspeed", lr=1e-4, warmup_steps=0,
                                weight_decay=0.0, grad_clip=1.0, zero_stage=3, seed=0)
    batch = _batch(256, [20, 22, 24, 21], 50)  # the demo's shapes (as _demo_step_times)
    adv_BT = advantages.advantages_BT(batch, "grpo", scale_by_std=True, eps=1e-6)
    plan = step.StepPlan(micro_batch_tokens=16384)

    def one() -> None:
        step.train_batch(engine, batch, adv_BT, ObjectiveConfig(), plan, temperature=1.0, version=0, max_lag=3)

    one()
    dist.barrier()
    t0 = time.perf_counter()
    for _ in range(steps):
        one()
    dist.barrier()
    seconds = time.perf_counter() - t0
    if dist.get_rank() == 0:  # every rank trains its share; together they train the whole batch
        tokens = int(batch.attention_BT.sum()) * steps
        print(json.dumps({"tokens": tokens, "seconds": seconds, "world": dist.get_world_size()}))


REF_MODEL = {"vocab": 8192, "hidden": 1024, "layers": 12}
"""The reference figure's model: 134M parameters, 513 MiB in fp32 (large enough that the reference
stands out of DeepSpeed's RSS noise, about ±100 MiB at 128 MiB), its largest tensor (the tied
embedding) 6 % of it, as in a 7B model (Qwen2.5-7B: 545M of 7.6B)."""


def _ref_child(zero_stage: int, reference: str) -> None:
    """One rank of a 2-rank DeepSpeed world: peak RSS rise over building the engine (with
    `reference` ``copied``: the reference copied from the policy first; ``partitioned``: built after
    the engine under ``zero.Init``, ZeRO-3 only; ``off``) and one step with the KL term."""
    from trajmesh.config import ReferenceConfig
    from trajmesh.learner import advantages, step
    from trajmesh.learner.logprobs import PolicyLogprobs
    from trajmesh.learner.objective import ObjectiveConfig
    from trajmesh.learner.reference import ReferencePolicy
    from trajmesh.learner.train_engine import build_train_engine, ensure_distributed

    torch.set_num_threads(1)
    ensure_distributed("gloo")
    import deepspeed  # noqa: F401 - imported before the baseline, as the learner has it by then

    batch = _batch(16, [60, 64], REF_MODEL["vocab"])
    adv_BT = advantages.advantages_BT(batch, "grpo", scale_by_std=True, eps=1e-6)
    kl = ReferenceConfig(enabled=True, kl_coef=0.1)

    held: list[object] = []
    kl_first: list[float] = []
    ref_bytes: list[int] = []

    def build_and_step() -> None:
        policy = PolicyLogprobs(_llama(REF_MODEL["vocab"], REF_MODEL["hidden"], REF_MODEL["layers"]))
        ref = ReferencePolicy(policy, "deepspeed", zero_stage=zero_stage) if reference == "copied" else None
        engine = build_train_engine(policy, type="deepspeed", lr=1e-4, warmup_steps=0, weight_decay=0.0,
                                    grad_clip=1.0, zero_stage=zero_stage, seed=0)
        if reference == "partitioned":
            ref = ReferencePolicy.after_zero3_engine(engine)
        m = step.train_batch(engine, batch, adv_BT, ObjectiveConfig(), step.StepPlan(micro_batch_tokens=1024),
                             temperature=1.0, version=0, max_lag=3, reference=ref, kl=kl if ref else None)
        kl_first.append(float(m.get("trajmesh_learner_reference_kl_k3", 0.0)))
        ref_bytes.append(0 if ref is None else sum(int(t.numel()) * t.element_size() for t in ref._tensors().values()))
        held.extend([engine, ref])  # alive after the step, as in the learner

    gc.collect()
    before = _rss_bytes()
    rise = _peak_rise(build_and_step)
    gc.collect()
    torch.distributed.barrier()
    print(json.dumps({"peak_rise_bytes": rise, "held_bytes": _rss_bytes() - before,
                      "rank": torch.distributed.get_rank(), "reference_kl_k3_first_step": kl_first[0],
                      "reference_parameter_bytes": ref_bytes[0]}))


def _world(world: int, *child_args: str) -> list[dict[str, float]]:
    """Runs `world` ranks of this file with `child_args`; each rank's last JSON line ({} for a rank
    that prints none), by rank."""
    port = str(free_port())
    procs = []
    for rank in range(world):
        env = {**os.environ, "RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(world),
               "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port, "DS_ACCELERATOR": "cpu"}
        procs.append(subprocess.Popen([sys.executable, __file__, *child_args], env=env,
                                      stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True))
    try:
        outs = [p.communicate(timeout=1800)[0] for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    if any(p.returncode != 0 for p in procs):
        raise RuntimeError(f"a rank failed: exit codes {[p.returncode for p in procs]}")
    return [json.loads(lines[-1]) if (lines := out.strip().splitlines()) else {} for out in outs]


def _reference_memory() -> None:
    mib = 1 / 2**20
    cells = [(0, "off"), (0, "copied"), (3, "off"), (3, "copied"), (3, "partitioned")]
    rise: dict[tuple[int, str], float] = {}
    held: dict[tuple[int, str], float] = {}
    held_params: dict[tuple[int, str], float] = {}
    for zero, ref in cells:
        ranks = _world(2, "--ref-child", "--zero", str(zero), "--reference", ref)
        rise[zero, ref] = max(r["peak_rise_bytes"] for r in ranks)
        held[zero, ref] = max(r["held_bytes"] for r in ranks)
        held_params[zero, ref] = max(r["reference_parameter_bytes"] for r in ranks)
        if ref != "off" and any(r["reference_kl_k3_first_step"] != 0.0 for r in ranks):
            raise RuntimeError(f"ZeRO-{zero} {ref}: the first step's KL to the reference is not 0: {ranks}")
    params = sum(p.numel() for p in _llama(REF_MODEL["vocab"], REF_MODEL["hidden"], REF_MODEL["layers"]).parameters())
    print(f"learner peak RSS rise per rank (max of 2), DeepSpeed gloo, {params / 1e6:.1f}M params "
          f"({params * 4 * mib:.0f} MiB fp32), one step with the KL term (its first-step KL 0 on every rank): "
          + ", ".join(f"ZeRO-{z} reference {ref} {rise[z, ref] * mib:.0f} MiB" for z, ref in cells))
    added = {(z, ref): rise[z, ref] - rise[z, "off"] for z, ref in cells if ref != "off"}
    added_held = {(z, ref): held[z, ref] - held[z, "off"] for z, ref in cells if ref != "off"}
    print("reference parameters held per rank (exact): "
          + ", ".join(f"ZeRO-{z} {ref} {held_params[z, ref] * mib:.0f} MiB" for z, ref in cells if ref != "off"))
    print("reference adds per rank, at the peak / resident after the step: "
          + ", ".join(f"ZeRO-{z} {ref} {added[z, ref] * mib:.0f} / {added_held[z, ref] * mib:.0f} MiB"
                      for z, ref in added))
    for ref in ("copied", "partitioned"):
        print(f"reference_zero3_{ref}_over_zero0_added_peak_ratio={added[3, ref] / added[0, 'copied']:.2f} "
              "(report; a half-copy is 0.5)")


def _ranks_tokens_per_s(world: int, steps: int = RANK_STEPS) -> float:
    """Tokens/s of a `world`-rank learner (processes of this file, torch.distributed environment)."""
    result = _world(world, "--rank-child", "--steps", str(steps))[0]
    return float(result["tokens"]) / float(result["seconds"])


def main(argv: list[str]) -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--child", choices=["step", "naive", "chunked"])
    p.add_argument("--rank-child", action="store_true")
    p.add_argument("--steps", type=int, default=RANK_STEPS)
    p.add_argument("--only-ranks", action="store_true", help="only the 2-ranks-over-1 figure")
    p.add_argument("--only-reference", action="store_true", help="only the reference-memory figure")
    p.add_argument("--ref-child", action="store_true")
    p.add_argument("--zero", type=int, default=0)
    p.add_argument("--reference", choices=["off", "copied", "partitioned"], default="off")
    p.add_argument("--seqs", type=int, default=16)
    p.add_argument("--budget", type=int, default=1024)
    p.add_argument("--tokens", type=int, default=8192)
    p.add_argument("--chunk", type=int, default=1024)
    args = p.parse_args(argv)
    if args.child:
        _child(args)
        return
    if args.rank_child:
        _rank_child(args.steps)
        return
    if args.ref_child:
        _ref_child(args.zero, args.reference)
        return
    if args.only_reference:
        _reference_memory()
        return
    if not args.only_ranks:
        _memory_and_k()
        _reference_memory()
    one, two = _ranks_tokens_per_s(1), _ranks_tokens_per_s(2)
    print(f"learner tokens/s, DeepSpeed ZeRO-3 gloo, demo shapes, 1 thread per rank, {RANK_STEPS} steps, "
          f"{os.cpu_count()} CPU cores: 1 rank {one:.0f}, 2 ranks {two:.0f}")
    print(f"ranks_2_over_1_tokens_per_s_ratio={two / one:.2f} (report)")


def _memory_and_k() -> None:
    mib = 1 / 2**20
    one = _measure("step", "--seqs", "16", "--budget", "1024")
    four = _measure("step", "--seqs", "64", "--budget", "1024")
    print(f"learner step peak rise, vocab {VOCAB}, micro_batch_tokens 1024: 1x (16 seqs) {one * mib:.0f} MiB, "
          f"4x (64 seqs) {four * mib:.0f} MiB")
    print(f"step_4x_over_1x_peak_ratio={four / one:.3f} (goal <= {STEP_GOAL})")
    naive = _measure("naive", "--tokens", "8192")
    chunked = _measure("chunked", "--tokens", "8192", "--chunk", "1024")
    print(f"log-prob + entropy fwd+bwd peak rise, 8192 tokens x {VOCAB} vocab: naive {naive * mib:.0f} MiB, "
          f"chunked (1024) {chunked * mib:.0f} MiB")
    print(f"chunked_over_naive_logprob_peak_ratio={chunked / naive:.3f} (goal <= {LOGPROB_GOAL})")
    k1, k4 = _demo_step_times()
    print(f"demo-shape learner step CPU time (1 thread): K=1 {k1:.3f} s, K=4 {k4:.3f} s")
    print(f"demo_step_K4_over_K1_time_ratio={k4 / k1:.2f} (report)")


if __name__ == "__main__":
    main(sys.argv[1:])
