"""Asynchronous (η = 2) versus synchronous (η = 0, full-batch barrier) RL on the same config, with
a long-tailed environment latency (log-normal per step), measured side by side in one run.

Both runs train the embedded demo model (SFT warm start, cached) with every service a process on
real NATS and Redis, for the same wall-clock budget, evaluating greedy held-out accuracy every
`--eval-every` seconds. The target is the lower of the two runs' best greedy accuracy (so both
reach it); the ratio is the synchronous run's time to reach it over the asynchronous run's.
Prints `async_vs_sync_time_to_accuracy_ratio` (goal ≥ 2).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from trajmesh.config import load_config
from trajmesh.train import read_metrics, train


def _time_to(evals: list[dict[str, Any]], target: float) -> float | None:
    for e in evals:
        if e["greedy_accuracy"] >= target:
            return float(e["rl_seconds"])
    return None


def run(mode: str, args: argparse.Namespace) -> list[dict[str, Any]]:
    cfg = load_config(args.config, {
        "run_dir": f"{args.runs}/bench-async-{mode}", "mode": mode, "gate.eta": 2,
        "learner.max_seconds": args.seconds, "learner.max_steps": 100000,
        "environment.simulated_step_latency.median_s": args.latency_median,
        "environment.simulated_step_latency.sigma": args.latency_sigma,
        "rollout.concurrent_tasks": args.concurrent_tasks,
    })
    summary = train(cfg, fresh=True, eval_every_s=args.eval_every)
    print(f"{mode}: {json.dumps(summary)}", flush=True)
    records = read_metrics(Path(cfg.run_dir))
    return [r for r in records if r.get("kind") == "eval"]


def main(argv: list[str] | None = None) -> float:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default="examples/demo.yaml")
    ap.add_argument("--runs", default="runs")
    ap.add_argument("--seconds", type=float, default=300.0, help="RL wall-clock budget of each run")
    ap.add_argument("--eval-every", type=float, default=30.0)
    ap.add_argument("--latency-median", type=float, default=0.2, help="median extra seconds per env step")
    ap.add_argument("--latency-sigma", type=float, default=1.0, help="log-normal sigma (p99 ≈ 10x median)")
    ap.add_argument("--concurrent-tasks", type=int, default=64,
                    help="groups in flight per rollout process, both runs (the gate caps sync at one batch)")
    args = ap.parse_args(argv)
    evals = {mode: run(mode, args) for mode in ("sync", "async")}
    best = {m: max(e["greedy_accuracy"] for e in ev) for m, ev in evals.items()}
    start = evals["sync"][0]["greedy_accuracy"]
    target = min(best.values())
    print(f"greedy held-out accuracy before RL {start:.3f}; best sync {best['sync']:.3f}, "
          f"best async {best['async']:.3f}; target {target:.3f}")
    times = {m: _time_to(ev, target) for m, ev in evals.items()}
    for m, ev in evals.items():
        trail = ", ".join(f"{e['rl_seconds']:.0f}s:{e['greedy_accuracy']:.3f}" for e in ev)
        print(f"{m:5s} time to target {times[m]}s; evals {trail}")
    if target <= start or not times["async"] or not times["sync"]:
        print("async_vs_sync_time_to_accuracy_ratio=nan (no improvement over the start to compare)")
        return float("nan")
    ratio = times["sync"] / max(times["async"], 1e-9)
    print(f"async_vs_sync_time_to_accuracy_ratio={ratio:.2f} (goal >= 2)")
    return ratio


if __name__ == "__main__":
    main()
