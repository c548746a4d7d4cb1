"""`trajmesh sweep CONFIG --grid key=a,b [--grid ...] --seeds N`: a factorial experiment.

::

    grids ── cells (product of the values) × seeds 0..N-1 ── one run dir each: OUT/<cell>/seed<k>
       │ a run dir with sweep_run.json is finished: skipped (the sweep resumes where it stopped)
       ▼
    run_fn(cfg) (default: `trajmesh train`, fresh) ── summary + wall seconds ── OUT/<cell>/seed<k>/sweep_run.json
       ▼
    results.md / results.csv: per cell, over seeds, mean and 95% t-interval of each source's held-out
    accuracy before/after RL, steps, trained tokens, wall time; results.png: held-out score against
    RL wall clock per cell (mean over seeds, band = 95% t-interval).

No torch here: the runs are `trajmesh.run.train.train` (or an injected function, in tests).
"""

from __future__ import annotations

import csv
import itertools
import json
import math
import re
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from trajmesh.config import ConfigError, RunConfig, load_config

RunFn = Callable[[RunConfig], dict[str, Any]]
"""Runs one config to completion in `cfg.run_dir` and returns its summary.json content."""

DONE_FILE = "sweep_run.json"

_T975 = (12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228, 2.201, 2.179, 2.160, 2.145,
         2.131, 2.120, 2.110, 2.101, 2.093, 2.086, 2.080, 2.074, 2.069, 2.064, 2.060, 2.056, 2.052, 2.048,
         2.045, 2.042)
"""Student t 0.975 quantiles for 1..30 degrees of freedom (standard tables)."""
_T975_TAIL = ((30, 2.042), (40, 2.021), (60, 2.000), (120, 1.980), (math.inf, 1.960))


def t_quantile_975(df: int) -> float:
    """The two-sided 95% Student t critical value for `df` ≥ 1 degrees of freedom (tables; beyond
    30, linear in 1/df between tabulated points)."""
    if df < 1:
        raise ValueError(f"need df >= 1, got {df}")
    if df <= len(_T975):
        return _T975[df - 1]
    for (d0, t0), (d1, t1) in itertools.pairwise(_T975_TAIL):
        if d0 <= df <= d1:
            x0, x1, x = 1 / d0, (1 / d1 if d1 != math.inf else 0.0), 1 / df
            return t0 + (t1 - t0) * (x - x0) / (x1 - x0)
    raise AssertionError("unreachable")


def mean_ci95(values: list[float]) -> tuple[float, float | None]:
    """(mean, half-width of the 95% t-interval); the half-width is None with fewer than 2 values."""
    if not values:
        raise ValueError("no values")
    m = statistics.fmean(values)
    if len(values) < 2:
        return m, None
    return m, t_quantile_975(len(values) - 1) * statistics.stdev(values) / math.sqrt(len(values))


@dataclass(frozen=True)
class Cell:
    """One combination of grid values: dotted config keys → values."""

    overrides: tuple[tuple[str, Any], ...]

    @property
    def label(self) -> str:
        return ",".join(f"{k}={v}" for k, v in self.overrides) or "base"

    @property
    def slug(self) -> str:
        return re.sub(r"[^A-Za-z0-9._=,-]", "_", self.label).replace(",", "__")


def parse_grid(specs: list[str]) -> list[tuple[str, list[Any]]]:
    """`["gate.eta=1,2", "mode=sync,async"]` → `[("gate.eta", [1, 2]), ("mode", ["sync", "async"])]`
    (each value parsed as YAML, as `--set` does)."""
    out = []
    for spec in specs:
        key, sep, values = spec.partition("=")
        if not sep or not key or not values:
            raise ConfigError(f"--grid expects key=a,b,..., got {spec!r}")
        out.append((key, [yaml.safe_load(v) for v in values.split(",")]))
    return out


def cells(grids: list[tuple[str, list[Any]]]) -> list[Cell]:
    """The factorial of the grids, in the order given."""
    keys = [k for k, _ in grids]
    return [Cell(tuple(zip(keys, combo, strict=True))) for combo in itertools.product(*(v for _, v in grids))]


def train_run(eval_every_s: float = 60.0) -> RunFn:
    """The default run: `trajmesh train` from scratch (an unfinished run dir is started over)."""
    def run(cfg: RunConfig) -> dict[str, Any]:
        from trajmesh.run.train import train

        return train(cfg, fresh=True, eval_every_s=eval_every_s)
    return run


def run_sweep(config: str | Path | None, grids: list[tuple[str, list[Any]]], seeds: int, out_dir: str | Path,
              *, run_fn: RunFn | None = None, overrides: dict[str, Any] | None = None,
              interleave: bool = False) -> list[dict[str, Any]]:
    """Runs every unfinished (cell, seed) and writes the results; returns one record per run (cell
    by cell). `interleave`: run seed by seed instead (cell A s0, cell B s0, cell A s1, …), so a
    machine's load drifting over the sweep affects every cell alike."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    run_fn = run_fn or train_run()
    grid_cells = cells(grids)
    order = ([(c, s) for s in range(seeds) for c in grid_cells] if interleave
             else [(c, s) for c in grid_cells for s in range(seeds)])
    done = {(c.label, s): _run_one(config, c, s, out, run_fn, overrides or {}) for c, s in order}
    records = [done[(c.label, s)] for c in grid_cells for s in range(seeds)]
    write_results(records, out)
    return records


def _run_one(config: str | Path | None, cell: Cell, seed: int, out: Path, run_fn: RunFn,
             overrides: dict[str, Any]) -> dict[str, Any]:
    run_dir = out / cell.slug / f"seed{seed}"
    done = run_dir / DONE_FILE
    if done.exists():
        return dict(json.loads(done.read_text()))
    cfg = load_config(config, {**overrides, **dict(cell.overrides), "seed": seed, "run_dir": str(run_dir)})
    start = time.monotonic()
    summary = run_fn(cfg)
    record = {"cell": cell.label, "seed": seed, "run_dir": str(run_dir), "wall_seconds": time.monotonic() - start,
              "summary": summary}
    tmp = run_dir / f".{DONE_FILE}.tmp"
    tmp.write_text(json.dumps(record, indent=1))
    tmp.replace(done)
    return record


# --------------------------------------------------------------------------- results


def _figures(record: dict[str, Any]) -> dict[str, float]:
    """Flat figures of one run: per source and phase, sampled and greedy held-out accuracy."""
    s = record["summary"]
    out: dict[str, float] = {}
    for src, by_phase in (s.get("heldout") or {}).items():
        for phase in ("before", "after"):
            for kind in ("sampled", "greedy"):
                value = (by_phase.get(phase) or {}).get(f"{kind}_accuracy")
                if value is not None:
                    out[f"{src}.{kind}.{phase}"] = float(value)
    out["steps"] = float(s.get("rl_steps", 0))
    out["trained_tokens"] = float(s.get("trained_tokens", 0))
    out["wall_seconds"] = float(record["wall_seconds"])
    return out


def aggregate(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per cell (in first-seen order): seeds, and for every figure its mean and 95% t-interval."""
    by_cell: dict[str, list[dict[str, float]]] = {}
    for r in records:
        by_cell.setdefault(r["cell"], []).append(_figures(r))
    rows = []
    for cell, runs in by_cell.items():
        row: dict[str, Any] = {"cell": cell, "seeds": len(runs)}
        for key in dict.fromkeys(k for run in runs for k in run):
            values = [run[key] for run in runs if key in run]
            mean, half = mean_ci95(values)
            row[key] = {"mean": mean, "ci95": half, "n": len(values)}
        rows.append(row)
    return rows


def _cell_text(fig: dict[str, Any] | None, digits: int) -> str:
    if fig is None:
        return "-"
    mean, half = fig["mean"], fig["ci95"]
    return f"{mean:.{digits}f}" + (f" ± {half:.{digits}f}" if half is not None else "")


def write_results(records: list[dict[str, Any]], out: Path) -> tuple[Path, Path, Path | None]:
    """results.md (mean ± 95% t half-width), results.csv (mean, ci_low, ci_high) and results.png."""
    rows = aggregate(records)
    keys = list(dict.fromkeys(k for row in rows for k in row if k not in ("cell", "seeds")))
    md = ["| cell | seeds | " + " | ".join(keys) + " |", "|" + "---|" * (len(keys) + 2)]
    for row in rows:
        digits = {k: (0 if k in ("steps", "trained_tokens", "wall_seconds") else 3) for k in keys}
        md.append(f"| {row['cell']} | {row['seeds']} | " +
                  " | ".join(_cell_text(row.get(k), digits[k]) for k in keys) + " |")
    md += ["", "Mean over seeds ± half-width of the 95% Student t-interval (none with one seed). "
               "Accuracy: held-out, per source, sampled and greedy, before and after RL."]
    md_path = out / "results.md"
    md_path.write_text("\n".join(md) + "\n")
    csv_path = out / "results.csv"
    with open(csv_path, "w", newline="") as fh:
        w = csv.writer(fh)
        w.writerow(["cell", "seeds", "figure", "n", "mean", "ci95_low", "ci95_high"])
        for row in rows:
            for k in keys:
                fig = row.get(k)
                if fig is None:
                    continue
                half = fig["ci95"]
                w.writerow([row["cell"], row["seeds"], k, fig["n"], fig["mean"],
                            "" if half is None else fig["mean"] - half, "" if half is None else fig["mean"] + half])
    return md_path, csv_path, plot_sweep(records, out / "results.png")


def _curve(run_dir: Path) -> list[tuple[float, float]]:
    """(RL seconds, held-out score) of every evaluation of a run, in time order."""
    from trajmesh.run.train import read_metrics

    evals = [r for r in read_metrics(run_dir) if r.get("kind") == "eval"]
    pts = [(float(r.get("rl_seconds", 0.0)), float(r["score"] if "score" in r else r["sampled_accuracy"]))
           for r in evals if "score" in r or r.get("sampled_accuracy") is not None]
    return sorted(pts)


def plot_sweep(records: list[dict[str, Any]], path: Path) -> Path | None:
    """Held-out score against RL wall clock per cell: the seeds' curves interpolated on a common
    grid (up to the shortest run), mean line and 95% t band. None when no run has evaluations."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    curves: dict[str, list[list[tuple[float, float]]]] = {}
    for r in records:
        pts = _curve(Path(r["run_dir"]))
        if pts:
            curves.setdefault(r["cell"], []).append(pts)
    if not curves:
        return None
    fig, ax = plt.subplots(figsize=(8, 5))
    for cell, runs in curves.items():
        end = min(p[-1][0] for p in runs)
        grid = np.linspace(0.0, end, 50) if end > 0 else np.zeros(1)
        ys = np.array([np.interp(grid, [t for t, _ in p], [y for _, y in p]) for p in runs])
        mean = ys.mean(axis=0)
        line = ax.plot(grid, mean, "-o" if len(grid) == 1 else "-", label=f"{cell} (n={len(runs)})")[0]
        if len(runs) > 1:
            half = t_quantile_975(len(runs) - 1) * ys.std(axis=0, ddof=1) / math.sqrt(len(runs))
            ax.fill_between(grid, mean - half, mean + half, color=line.get_color(), alpha=0.2)
    ax.set_xlabel("RL wall clock (s)")
    ax.set_ylabel("held-out score (mean over sources)")
    ax.set_title("sweep: held-out score, mean over seeds ± 95% t-interval")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path
