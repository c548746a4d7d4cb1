"""Async vs sync, the LEARNING benchmark (issue 13, item 4a): held-out accuracy against wall clock,
over seeds, with 95 % confidence intervals.

::

    run      `trajmesh sweep examples/demo.yaml --grid mode=async,sync --seeds 3`, interleaved
             (async s0, sync s0, async s1, …) so machine load drifts onto both modes alike;
             resumable (a finished run dir is skipped); each run from the SHIPPED SFT start
             (model.path pinned, so every seed starts from the same weights), RL_SECONDS of RL,
             held-out evaluation every EVAL_EVERY_S seconds after the previous one ended
             (EVAL_SAMPLES sampled answers per problem at T = 1, and greedy; before and after RL
             EVAL_SAMPLES_BEFORE_AFTER, no extra noise seeds), the machine's load average sampled
             to OUT/loadavg.jsonl
    analyze  reads each run dir's metrics.jsonl / summary.json and prints the table below

Everything measured is fixed here, BEFORE the runs (2026-11-30, first session of this benchmark).
The budget was cut once before any valid run (300 s of RL, evaluation every 30 s with 4 samples,
smoothing over 3 → 200 s, 20 s with 2 samples, over 2): the first two starts were aborted because
the services ran a working tree that other sessions were editing (a learner crash at every
checkpoint), and the rest of the time did not fit 6 runs of the first budget on a loaded machine.
The targets did not change. The runs now execute a frozen `git archive` of one commit.

* **Curve.** A run's held-out sampled accuracy at RL second t: its evaluations (the before-RL one
  at t = 0, then one every EVAL_EVERY_S, each stamped with the learner's `rl_seconds` of the weights
  it scored), smoothed by a trailing mean over SMOOTH_WINDOW evaluations (one evaluation of 200
  problems moves by ±2–3 points).
* **Baseline** = the mean over ALL runs of the before-RL sampled accuracy (every run starts from the
  same weights and the same held-out set; only the sampling seed differs, so pooling is the least
  noisy estimate of the one true starting accuracy).
* **Targets** = baseline + TARGET_DELTAS (2, 4 and 6 points). Time to a target = the first
  smoothed point at or above it. A run that does not reach it is censored at its last evaluation:
  the table shows how many runs reached it and the mean time over those (with its 95 % t-interval
  when ≥ 2 reached), and the mean with censored runs counted at the budget (a lower bound).
* **AUC** = ∫₀ᵀ (accuracy(t) − baseline) dt / T on the raw (unsmoothed) curve, trapezoidal, with
  T = AUC_HORIZON_S and the last evaluation held flat to T: the mean gain in points over the budget.
* **Per trained token.** Each evaluation is placed at the trained tokens of the learner steps up to
  its weights' version; the accuracy gain at the common token budget (the smallest final trained
  tokens of any run, linear interpolation, raw curve) per mode — goal: async not worse than sync
  within the 95 % interval — and, per run, the gain after RL per million trained tokens.
* Per run: learner steps, trained tokens, RL seconds, before/after sampled and greedy accuracy.

Intervals are over seeds: mean ± half-width of the 95 % Student t-interval (trajmesh.run.sweep.mean_ci95);
the async − sync difference uses Welch's t-interval, and the t-interval of the differences paired by seed
(a seed's two runs share the evaluation's sampling draw).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import threading
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from trajmesh.run.sweep import mean_ci95, t_quantile_975  # noqa: E402

CONFIG = REPO / "examples" / "demo.yaml"
SHIPPED_START = REPO / "examples" / "demo-start" / "demo-model-8195caa0ae10" / "sft"
MODES = ("async", "sync")
SEEDS = 3
RL_SECONDS = 200.0
EVAL_EVERY_S = 20.0
EVAL_SAMPLES = 2
EVAL_SAMPLES_BEFORE_AFTER = 4
SMOOTH_WINDOW = 2
TARGET_DELTAS = (0.02, 0.04, 0.06)
AUC_HORIZON_S = RL_SECONDS
KEY = "sampled_accuracy"


# --------------------------------------------------------------------------- analysis (pure)


def curve(evals: list[dict[str, Any]], key: str = KEY) -> list[tuple[float, float]]:
    """(rl_seconds, accuracy) of the before-RL and during-RL evaluations, in time order."""
    pts = [(float(e["rl_seconds"]), float(e[key])) for e in evals
           if e.get("phase") in ("before", "during") and e.get(key) is not None]
    return sorted(pts, key=lambda p: p[0])


def smoothed(pts: list[tuple[float, float]], window: int) -> list[tuple[float, float]]:
    """(time, trailing mean of the last `window` values), from the first full window on."""
    return [(pts[i][0], statistics.fmean(v for _, v in pts[i - window + 1:i + 1])) for i in range(window - 1, len(pts))]


def time_to_target(pts: list[tuple[float, float]], target: float) -> float | None:
    """First time at or above `target` (None: never)."""
    return next((t for t, v in pts if v >= target - 1e-12), None)


def normalized_auc(pts: list[tuple[float, float]], baseline: float, horizon: float) -> float:
    """∫₀^horizon (acc(t) − baseline) dt / horizon, trapezoidal between points, the first point held
    back to 0 and the last held flat to `horizon`; points beyond `horizon` are cut there (interpolated)."""
    if not pts or horizon <= 0:
        raise ValueError("need points and a positive horizon")
    xs = [0.0] + [t for t, _ in pts] + [horizon]
    ys = [pts[0][1]] + [v for _, v in pts] + [pts[-1][1]]
    area = 0.0
    for (x0, y0), (x1, y1) in zip(zip(xs, ys, strict=True), zip(xs[1:], ys[1:], strict=True), strict=False):
        if x0 >= horizon:
            break
        if x1 > horizon:  # cut the segment at the horizon
            y1 = y0 + (y1 - y0) * (horizon - x0) / (x1 - x0)
            x1 = horizon
        area += (x1 - x0) * ((y0 + y1) / 2 - baseline)
    return area / horizon


def interp(xs: list[float], ys: list[float], x: float) -> float:
    """Piecewise-linear y(x) on increasing xs, held flat outside."""
    if x <= xs[0]:
        return ys[0]
    for x0, x1, y0, y1 in zip(xs, xs[1:], ys, ys[1:], strict=False):
        if x <= x1:
            return y0 if x1 == x0 else y0 + (y1 - y0) * (x - x0) / (x1 - x0)
    return ys[-1]


def tokens_curve(evals: list[dict[str, Any]], steps: list[dict[str, Any]], key: str = KEY) -> list[tuple[float, float]]:
    """(trained tokens of the steps up to the evaluated version, accuracy) per before/during evaluation."""
    cum: dict[int, float] = {0: 0.0}
    total = 0.0
    for s in sorted(steps, key=lambda s: s["version"]):
        total += float(s.get("trajmesh_learner_tokens", 0))
        cum[int(s["version"])] = total
    out = []
    for e in evals:
        if e.get("phase") not in ("before", "during") or e.get(key) is None:
            continue
        v = int(e.get("version", 0))
        tok = cum.get(v, max((t for ver, t in cum.items() if ver <= v), default=0.0))
        out.append((tok, float(e[key])))
    return sorted(out, key=lambda p: p[0])


def welch_ci95(a: list[float], b: list[float]) -> tuple[float, float | None]:
    """mean(a) − mean(b) and the half-width of Welch's 95 % t-interval (None with < 2 per group)."""
    d = statistics.fmean(a) - statistics.fmean(b)
    if len(a) < 2 or len(b) < 2:
        return d, None
    va, vb = statistics.variance(a) / len(a), statistics.variance(b) / len(b)
    se2 = va + vb
    if se2 == 0:
        return d, 0.0
    df = se2 ** 2 / (va ** 2 / (len(a) - 1) + vb ** 2 / (len(b) - 1))
    return d, t_quantile_975(max(1, math.floor(df))) * math.sqrt(se2)


def paired_ci95(a: dict[int, float], b: dict[int, float]) -> tuple[float, float | None] | None:
    """Mean and 95 % t half-width of a[seed] − b[seed] over the seeds both have (a seed's runs share
    its evaluation sampling draw); None when no seed is shared."""
    diffs = [a[k] - b[k] for k in sorted(a) if k in b]
    return mean_ci95(diffs) if diffs else None


def analyze_runs(runs: dict[str, list[dict[str, Any]]], *, deltas: tuple[float, ...] = TARGET_DELTAS,
                 window: int = SMOOTH_WINDOW, horizon: float = AUC_HORIZON_S) -> dict[str, Any]:
    """`runs`: mode → list of {"seed", "evals", "steps", "summary"}. Returns every figure the table shows."""
    all_runs = [r for rs in runs.values() for r in rs]
    befores = [c[0][1] for r in all_runs if (c := curve(r["evals"])) and c[0][0] == 0.0]
    baseline = statistics.fmean(befores)
    targets = [baseline + d for d in deltas]
    tok_curves = {id(r): tokens_curve(r["evals"], r["steps"]) for r in all_runs}
    common_tokens = min(float(r["summary"].get("trained_tokens", 0)) for r in all_runs)
    out: dict[str, Any] = {"baseline": baseline, "targets": targets, "common_tokens": common_tokens, "modes": {}}
    for mode, rs in runs.items():
        per_run = []
        for r in rs:
            raw = curve(r["evals"])
            sm = smoothed(raw, window)
            tc = tok_curves[id(r)]
            s = r["summary"]
            tokens = float(s.get("trained_tokens", 0))
            after, before = s.get("heldout_accuracy_after_rl"), s.get("heldout_accuracy_before_rl")
            per_run.append({
                "seed": r["seed"],
                "times": [time_to_target(sm, tg) for tg in targets],
                "last_eval_s": raw[-1][0],
                "auc": normalized_auc(raw, baseline, horizon),
                "gain_at_common_tokens": interp([t for t, _ in tc], [v for _, v in tc], common_tokens) - baseline,
                "steps": float(s.get("rl_steps", 0)),
                "trained_tokens": tokens,
                "rl_seconds": float(s.get("rl_seconds", 0.0)),
                "before": before, "after": after,
                "greedy_before": s.get("heldout_greedy_accuracy_before_rl"),
                "greedy_after": s.get("heldout_greedy_accuracy_after_rl"),
                "gain_per_mtok": (after - before) / tokens * 1e6 if after is not None and before is not None and tokens
                else None,
            })
        out["modes"][mode] = per_run
    return out


def _fmt(values: list[float], digits: int = 3, scale: float = 1.0) -> str:
    vals = [v * scale for v in values if v is not None]
    if not vals:
        return "-"
    m, h = mean_ci95(vals)
    return f"{m:.{digits}f}" + (f" ± {h:.{digits}f}" if h is not None else "") + f" (n={len(vals)})"


def report(res: dict[str, Any], horizon: float = AUC_HORIZON_S) -> str:
    """The Markdown table of `analyze_runs`' result, and the async − sync differences."""
    modes = list(res["modes"])
    lines = [f"baseline (before-RL sampled accuracy, mean of all runs) = {res['baseline']:.4f}; "
             f"targets = " + ", ".join(f"{t:.4f}" for t in res["targets"]), "",
             "| figure | " + " | ".join(modes) + " |", "|---|" + "---|" * len(modes)]

    def row(name: str, fn: Any, digits: int = 3, scale: float = 1.0) -> None:
        lines.append(f"| {name} | " + " | ".join(_fmt([fn(r) for r in res["modes"][m]], digits, scale)
                                                 for m in modes) + " |")

    row("learner steps", lambda r: r["steps"], 0)
    row("trained tokens", lambda r: r["trained_tokens"], 0)
    row("RL seconds", lambda r: r["rl_seconds"], 0)
    row("sampled accuracy before RL", lambda r: r["before"])
    row("sampled accuracy after RL", lambda r: r["after"])
    row("greedy accuracy before RL", lambda r: r["greedy_before"])
    row("greedy accuracy after RL", lambda r: r["greedy_after"])
    for i, (tg, d) in enumerate(zip(res["targets"], TARGET_DELTAS, strict=False)):
        for m in modes:
            rs = res["modes"][m]
            reached = [r["times"][i] for r in rs if r["times"][i] is not None]
            censored = [r["times"][i] if r["times"][i] is not None else horizon for r in rs]
            lines_cell = f"reached {len(reached)}/{len(rs)}; mean of reached {_fmt(reached, 0)}; "
            lines_cell += f"censored at {horizon:.0f} s: {_fmt(censored, 0)}"
            res.setdefault("_t", {}).setdefault(i, {})[m] = lines_cell
        lines.append(f"| time to +{d * 100:.0f} pts ({tg:.3f}), s | " +
                     " | ".join(res["_t"][i][m] for m in modes) + " |")
    row("AUC: mean gain over the budget, points", lambda r: r["auc"], 2, 100.0)
    row(f"gain at {res['common_tokens']:.0f} trained tokens, points", lambda r: r["gain_at_common_tokens"], 2, 100.0)
    row("gain after RL per million trained tokens, points", lambda r: r["gain_per_mtok"], 2, 100.0)
    res.pop("_t", None)
    if len(modes) == 2:
        a, b = (res["modes"][m] for m in modes)
        lines.append("")
        for name, fn in (("AUC (points)", lambda r: r["auc"] * 100),
                         ("gain at the common token budget (points)", lambda r: r["gain_at_common_tokens"] * 100),
                         ("sampled accuracy after RL (points)", lambda r: (r["after"] or 0) * 100)):
            d, h = welch_ci95([fn(r) for r in a], [fn(r) for r in b])
            line = f"{modes[0]} − {modes[1]}, {name}: {d:+.2f}" + (f" ± {h:.2f} (Welch 95 %)" if h is not None else "")
            pd = paired_ci95({r["seed"]: fn(r) for r in a}, {r["seed"]: fn(r) for r in b})
            if pd is not None:
                line += f"; paired by seed {pd[0]:+.2f}" + (f" ± {pd[1]:.2f}" if pd[1] is not None else "")
            lines.append(line)
    lines.append("")
    lines.append("per run: " + "; ".join(
        f"{m} s{r['seed']}: {r['steps']:.0f} steps, {r['trained_tokens']:.0f} tok, times "
        + "/".join("-" if t is None else f"{t:.0f}" for t in r["times"]) + f", AUC {r['auc'] * 100:.2f}"
        for m in modes for r in res["modes"][m]))
    return "\n".join(lines)


# --------------------------------------------------------------------------- run / load


def load_runs(out: Path, modes: tuple[str, ...] = MODES, seeds: int = SEEDS) -> dict[str, list[dict[str, Any]]]:
    """mode → finished runs (those with summary.json) under OUT/mode=<mode>/seed<k>."""
    from trajmesh.run.train import read_metrics

    runs: dict[str, list[dict[str, Any]]] = {}
    for mode in modes:
        for seed in range(seeds):
            d = out / f"mode={mode}" / f"seed{seed}"
            if not (d / "summary.json").exists():
                continue
            records = read_metrics(d)
            runs.setdefault(mode, []).append({
                "seed": seed, "summary": json.loads((d / "summary.json").read_text()),
                "evals": [r for r in records if r.get("kind") == "eval"],
                "steps": [r for r in records if r.get("kind") == "learner_step"]})
    return runs


def rebase(runs: dict[str, list[dict[str, Any]]], start: dict[int, float]) -> dict[str, list[dict[str, Any]]]:
    """The runs with every before-RL evaluation's sampled accuracy replaced by `start[seed]` (the
    start weights scored on the during-RL evaluations' scale, with that run's seed)."""
    return {m: [{**r, "evals": [{**e, KEY: start[r["seed"]]} if e.get("phase") == "before" else e
                                for e in r["evals"]]} for r in rs] for m, rs in runs.items()}


def start_accuracy(out: Path, seeds: int = SEEDS) -> dict[int, float]:
    """Per run seed, the sampled held-out accuracy of the shipped start with EVAL_SAMPLES samples per
    problem (the during-RL protocol; the before-RL evaluation uses EVAL_SAMPLES_BEFORE_AFTER, and
    the sampling seeds, fixed per run seed, problem and sample, make the first samples a fixed draw,
    so the two differ by a constant per seed), cached in OUT/start_eval.json."""
    cache = out / "start_eval.json"
    got: dict[str, Any] = json.loads(cache.read_text()) if cache.exists() else {}
    for seed in range(seeds):
        if str(seed) in got:
            continue
        from trajmesh.config import load_config
        from trajmesh.run.train import evaluate_dir, heldout_tasks

        cfg = load_config(CONFIG, {"model.path": str(SHIPPED_START), "seed": seed})
        res = evaluate_dir(str(SHIPPED_START), heldout_tasks(cfg), cfg, samples=EVAL_SAMPLES)
        got[str(seed)] = {KEY: res[KEY], "greedy_accuracy": res.get("greedy_accuracy"), "samples": EVAL_SAMPLES}
        cache.write_text(json.dumps(got, indent=1))
    return {int(k): float(v[KEY]) for k, v in got.items()}


def _sample_load(path: Path, stop: threading.Event, every: float = 15.0) -> None:
    with open(path, "a") as fh:
        while True:
            fh.write(json.dumps({"time": time.time(), "loadavg": os.getloadavg()}) + "\n")
            fh.flush()
            if stop.wait(every):
                return


def run(out: Path, seeds: int) -> None:
    from trajmesh.run.sweep import run_sweep, train_run

    out.mkdir(parents=True, exist_ok=True)
    stop = threading.Event()
    sampler = threading.Thread(target=_sample_load, args=(out / "loadavg.jsonl", stop), daemon=True)
    sampler.start()
    try:
        run_sweep(CONFIG, [("mode", list(MODES))], seeds, out, run_fn=train_run(EVAL_EVERY_S), interleave=True,
                  overrides={"model.path": str(SHIPPED_START), "learner.max_seconds": RL_SECONDS,
                             "learner.max_steps": 100000, "eval.samples_during": EVAL_SAMPLES,
                             "eval.samples": EVAL_SAMPLES_BEFORE_AFTER, "eval.noise_seeds": 0})
    finally:
        stop.set()
        sampler.join()


def load_summary(out: Path) -> str:
    """Load average during the runs (1-minute average, sampled every 15 s)."""
    path = out / "loadavg.jsonl"
    if not path.exists():
        return "load average: not recorded"
    one = [json.loads(line)["loadavg"][0] for line in path.read_text().splitlines() if line.strip()]
    return (f"1-min load average during the runs (2 cores): mean {statistics.fmean(one):.2f}, "
            f"min {min(one):.2f}, max {max(one):.2f} ({len(one)} samples)")


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("action", nargs="?", choices=("run", "analyze", "all"), default="all")
    ap.add_argument("--out", default="runs/bench-learning", help="sweep directory (resumable)")
    ap.add_argument("--seeds", type=int, default=SEEDS)
    args = ap.parse_args(argv)
    out = Path(args.out)
    if args.action in ("run", "all"):
        run(out, args.seeds)
    runs = load_runs(out, seeds=args.seeds)
    res = analyze_runs(runs)
    print("== as fixed before the run (baseline: the before-RL evaluation, EVAL_SAMPLES_BEFORE_AFTER samples)")
    print(report(res))
    start = start_accuracy(out, args.seeds)
    print(f"\n== on one scale (post hoc): the start weights evaluated as the during-RL evaluations are "
          f"({EVAL_SAMPLES} samples, each run seed's sampling seeds): "
          + ", ".join(f"seed {k} {v:.4f}" for k, v in sorted(start.items()))
          + "; they replace the t = 0 point and give the baseline")
    print(report(analyze_runs(rebase(runs, start))))
    for mode, rs in runs.items():
        for r in rs:
            print(f"{mode} seed {r['seed']} sampled accuracy (RL s: value): "
                  + ", ".join(f"{t:.0f}: {v:.3f}" for t, v in curve(r["evals"])))
    print(load_summary(out))
    return res


if __name__ == "__main__":
    main()
