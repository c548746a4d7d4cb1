"""Async vs sync, systems (issue 13, item 4): trained tokens/s of the real mesh on a GPU-like timing
model, for sync (η = 0, full-batch barrier) and async with η = 1, 2, 4, side by side in one run.

Every service is a process on real NATS and Redis (environment, store, grader, rollout, learner;
the real staleness gate, store and learner service). What a GPU would compute is replaced by a
sleep of the modelled time, so rollout and learner do not compete for this machine's cores and the
figures hold on a busy machine (the services' own CPU work — messaging, grading, storing — is
real):

- rollout: the synthetic engine (rollout/engines/synthetic_engine.py, `rollout.engine.synthetic`) with
  log-normal response lengths capped at max_new_tokens (long tail), decoded as one continuous
  batch: a step of B running sequences takes decode_step_s + step_s_per_sequence·B seconds;
- environment: a log-normal delay per Step (`environment.simulated_step_latency`);
- learner: no training; each step sleeps seconds_per_step + seconds_per_token·(trained tokens)
  (`learner.simulated_step`).

Per cell: trained tokens/s in steady state (from the first learner step after --warmup seconds to
the last one), the rollout engine's busy fraction (modelled decode time / wall, from its Prometheus
counter) and the learner's (step time / wall), steps, stale quarantines and the mean decode batch.
Prints the timing model, then `async_vs_sync_trained_tokens_per_s_ratio eta=N` per η (goal ≥ 2;
AReaL reports 2.57–2.77×).
"""

from __future__ import annotations

import argparse
import inspect
import json
import re
import shutil
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

from trajmesh.config import RunConfig, load_config
from trajmesh.run.launcher import Mesh, prepare_model, start_mesh
from trajmesh.run.train import read_metrics


def _write_manifest(cfg: RunConfig) -> None:
    from trajmesh.run import train

    if len(inspect.signature(train._write_manifest).parameters) > 1:
        train._write_manifest(cfg, train.heldout_tasks(cfg))
    else:
        train._write_manifest(cfg)  # type: ignore[call-arg]


def _scrape(port: int) -> dict[str, float]:
    """The synthetic engine's counters from one rollout process's /metrics."""
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    out = {}
    for name in ("busy_seconds", "decode_steps", "decoded_tokens"):
        m = re.search(rf"^trajmesh_rollout_synthetic_{name}_total (\S+)$", text, re.M)
        out[name] = float(m.group(1)) if m else 0.0
    return out


def overrides(args: argparse.Namespace, mode: str, eta: int, run_dir: Path) -> dict[str, Any]:
    return {
        "run_dir": str(run_dir), "seed": args.seed, "mode": mode, "gate.eta": max(eta, 1),
        "tasks.group_size": args.group_size, "tasks.train_size": 20000, "tasks.heldout_size": 10,
        "tasks.sampling.max_new_tokens": args.max_new_tokens,
        "rollout.replicas": 1, "rollout.concurrent_tasks": args.concurrent_tasks,
        "rollout.engine.type": "synthetic",
        "rollout.engine.synthetic.decode_step_s": args.decode_step_s,
        "rollout.engine.synthetic.step_s_per_sequence": args.step_s_per_sequence,
        "rollout.engine.synthetic.max_batch": args.max_batch,
        "rollout.engine.synthetic.length_median": args.length_median,
        "rollout.engine.synthetic.length_sigma": args.length_sigma,
        "environment.simulated_step_latency.median_s": args.env_median_s,
        "environment.simulated_step_latency.sigma": args.env_sigma,
        "grader.replicas": 1, "store.drop_zero_variance_groups": False,  # random text: every reward is 0
        "learner.engine.type": "torch", "learner.batch_groups": args.batch_groups,
        "learner.simulated_step.seconds_per_token": args.learner_s_per_token,
        "learner.simulated_step.seconds_per_step": args.learner_s_per_step,
        "learner.consistency_probe_trajectories": 0,  # a forward pass on the CPU: not in the model
        "learner.max_steps": 10**6, "learner.max_seconds": args.seconds, "learner.checkpoint_every": 10**6,
    }


def run_cell(args: argparse.Namespace, mode: str, eta: int, root: Path) -> dict[str, Any]:
    name = f"{mode}" if mode == "sync" else f"async-eta{eta}"
    over = overrides(args, mode, eta, root / name)
    # The model only gives the tokenizer and the learner's (untrained) weights: the config's own
    # (the demo's shipped warm start) whatever --seed, so no seed builds a new one.
    model = prepare_model(load_config(args.config, {k: v for k, v in over.items() if k != "seed"})).model.path
    cfg = load_config(args.config, {**over, "model.path": model})
    Path(cfg.run_dir).mkdir(parents=True)
    _write_manifest(cfg)
    mesh: Mesh = start_mesh(cfg)
    samples: list[tuple[float, dict[str, float]]] = []
    try:
        rollout = next(p for p in mesh.procs if p.name == "rollout")
        learner = next(p for p in mesh.procs if p.name == "learner")
        deadline = time.monotonic() + args.seconds + 120
        while learner.popen.poll() is None and time.monotonic() < deadline:
            samples.append((time.time(), _scrape(rollout.metrics_port)))
            time.sleep(1.0)  # a sampling period, not a synchronization: the window is cut from the samples
        if learner.popen.poll() is None:
            raise RuntimeError(f"{name}: the learner did not finish in {args.seconds + 120:.0f} s")
        if learner.popen.returncode != 0:
            raise RuntimeError(f"{name}: the learner exited with {learner.popen.returncode}")
    finally:
        mesh.stop_services()
        mesh.stop_infra()
    steps = [r for r in read_metrics(Path(cfg.run_dir)) if r.get("kind") == "learner_step"]
    anchor = next((i for i, r in enumerate(steps) if r["rl_seconds"] >= args.warmup), None)
    if anchor is None or anchor >= len(steps) - 1:
        raise RuntimeError(f"{name}: fewer than 2 learner steps after the {args.warmup:.0f} s warm-up "
                           f"({len(steps)} in all); raise --seconds")
    window = steps[anchor + 1:]
    t0, t1 = steps[anchor]["time"], steps[-1]["time"]
    wall = t1 - t0

    def engine_at(t: float) -> dict[str, float]:
        """Counter values at the last sample at or before t (sampled every second)."""
        best = samples[0][1]
        for ts, vals in samples:
            if ts <= t:
                best = vals
        return best

    e0, e1 = engine_at(t0), engine_at(t1)
    tokens = sum(int(r.get("tokens_trained", 0)) for r in window)
    steps_d = e1["decode_steps"] - e0["decode_steps"]
    cell = {
        "cell": name, "mode": mode, "eta": eta if mode == "async" else 0, "wall_s": wall,
        "steps": len(window), "trained_tokens": tokens, "trained_tokens_per_s": tokens / wall,
        "trajectories_trained": sum(int(r.get("trajectories_trained", 0)) for r in window),
        "trajectories_stale": sum(int(r.get("trajectories_stale", 0)) for r in window),
        "learner_busy": sum(float(r["step_seconds"]) for r in window) / wall,
        "rollout_busy": (e1["busy_seconds"] - e0["busy_seconds"]) / wall,
        "mean_decode_batch": (e1["decoded_tokens"] - e0["decoded_tokens"]) / steps_d if steps_d else 0.0,
        "max_token_lag": max((int(r.get("max_token_lag", 0)) for r in window), default=0),
    }
    print(f"{name}: {json.dumps({k: round(v, 3) if isinstance(v, float) else v for k, v in cell.items()})}",
          flush=True)
    return cell


def main(argv: list[str] | None = None) -> dict[int, float]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default="examples/demo.yaml", help="the tasks and model (the demo's chain_sum)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--etas", default="1,2,4", help="async cells (sync always runs first)")
    ap.add_argument("--seconds", type=float, default=100.0, help="learner wall-clock budget per cell")
    ap.add_argument("--warmup", type=float, default=15.0, help="learner seconds left out of the rates")
    ap.add_argument("--group-size", type=int, default=8)
    ap.add_argument("--batch-groups", type=int, default=8, help="groups per learner step")
    ap.add_argument("--concurrent-tasks", type=int, default=64, help="groups in flight in the rollout (the gate caps it)")
    ap.add_argument("--max-new-tokens", type=int, default=512)
    ap.add_argument("--length-median", type=int, default=48)
    ap.add_argument("--length-sigma", type=float, default=1.0)
    ap.add_argument("--decode-step-s", type=float, default=0.01)
    ap.add_argument("--step-s-per-sequence", type=float, default=0.0001)
    ap.add_argument("--max-batch", type=int, default=512)
    ap.add_argument("--env-median-s", type=float, default=0.3)
    ap.add_argument("--env-sigma", type=float, default=1.0)
    ap.add_argument("--learner-s-per-token", type=float, default=0.0005)
    ap.add_argument("--learner-s-per-step", type=float, default=0.5)
    ap.add_argument("--keep", default="", help="keep the run dirs under this folder (default: a temp dir)")
    args = ap.parse_args(argv)
    etas = [int(e) for e in args.etas.split(",") if e]
    print("timing model (sleep-based; seconds of a modelled GPU, not this machine's CPU):")
    print(f"  rollout engine: response length ~ min(max_new_tokens={args.max_new_tokens}, "
          f"lognormal(median={args.length_median}, sigma={args.length_sigma})), EOS when shorter; "
          f"decode step of B sequences = {args.decode_step_s} + {args.step_s_per_sequence}*B s, "
          f"max batch {args.max_batch}")
    print(f"  environment: Step delay ~ lognormal(median={args.env_median_s} s, sigma={args.env_sigma})")
    print(f"  learner: step = {args.learner_s_per_step} + {args.learner_s_per_token}*trained_tokens s (no training)")
    print(f"  batch {args.batch_groups} groups x {args.group_size}, {args.concurrent_tasks} groups in flight at most, "
          f"seed {args.seed}, {args.seconds:.0f} s per cell, first {args.warmup:.0f} s left out", flush=True)
    root = Path(args.keep) if args.keep else Path(tempfile.mkdtemp(prefix="bench-systems-"))
    try:
        cells = [run_cell(args, "sync", 0, root)] + [run_cell(args, "async", e, root) for e in etas]
    finally:
        if not args.keep:
            shutil.rmtree(root, ignore_errors=True)
    sync = cells[0]
    print(f"\n{'cell':12s} {'tok/s':>9s} {'x sync':>7s} {'steps':>5s} {'stale':>5s} {'lag':>3s} "
          f"{'rollout busy':>12s} {'learner busy':>12s} {'decode batch':>12s}")
    for c in cells:
        print(f"{c['cell']:12s} {c['trained_tokens_per_s']:9.0f} {c['trained_tokens_per_s'] / sync['trained_tokens_per_s']:7.2f} "
              f"{c['steps']:5d} {c['trajectories_stale']:5d} {c['max_token_lag']:3d} {c['rollout_busy']:12.2f} "
              f"{c['learner_busy']:12.2f} {c['mean_decode_batch']:12.1f}")
    ratios = {}
    for c in cells[1:]:
        ratios[c["eta"]] = c["trained_tokens_per_s"] / sync["trained_tokens_per_s"]
        print(f"async_vs_sync_trained_tokens_per_s_ratio eta={c['eta']}: {ratios[c['eta']]:.2f} (goal >= 2)")
    return ratios


if __name__ == "__main__":
    main()
