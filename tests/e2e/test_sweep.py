"""`trajmesh sweep`: factorial cells x seeds, one run dir each, results table/CSV/PNG, resume.

The fast tests inject the run function (it writes what `trajmesh train` writes: eval records in
metrics.jsonl and returns a summary); the slow e2e runs the real mesh with tiny budgets."""

from __future__ import annotations

import csv
import json
import math
from pathlib import Path
from typing import Any

import pytest
from repo_paths import REPO

from trajmesh.config import ConfigError, RunConfig
from trajmesh.run.sweep import DONE_FILE, cells, mean_ci95, parse_grid, run_sweep, t_quantile_975


def test_t_quantiles_and_interval_by_hand() -> None:
    assert t_quantile_975(1) == 12.706 and t_quantile_975(2) == 4.303 and t_quantile_975(30) == 2.042
    assert t_quantile_975(60) == pytest.approx(2.000) and 1.96 < t_quantile_975(1000) < 1.963
    mean, half = mean_ci95([0.2, 0.4])   # s = 0.1414..., half = 12.706 * s / sqrt(2) = 12.706 * 0.1
    assert mean == pytest.approx(0.3) and half == pytest.approx(1.2706)
    mean, half = mean_ci95([1.0, 2.0, 3.0])   # s = 1, half = 4.303 / sqrt(3)
    assert mean == 2.0 and half == pytest.approx(4.303 / math.sqrt(3))
    assert mean_ci95([0.5]) == (0.5, None)


def test_grid_parsing_and_factorial() -> None:
    grids = parse_grid(["gate.eta=0,2", "mode=sync,async"])
    assert grids == [("gate.eta", [0, 2]), ("mode", ["sync", "async"])]
    labels = [c.label for c in cells(grids)]
    assert labels == ["gate.eta=0,mode=sync", "gate.eta=0,mode=async", "gate.eta=2,mode=sync", "gate.eta=2,mode=async"]
    assert cells(grids)[0].slug == "gate.eta=0__mode=sync"
    with pytest.raises(ConfigError):
        parse_grid(["gate.eta"])


def _build_fake_run(calls: list[tuple[str, int]]) -> Any:
    """A run that writes two evaluations; its after-accuracy is lr * 1000 + seed / 10 (known)."""
    def run(cfg: RunConfig) -> dict[str, Any]:
        calls.append((cfg.run_dir, cfg.seed))
        after = cfg.learner.lr * 1000 + cfg.seed / 10
        run_dir = Path(cfg.run_dir)
        run_dir.mkdir(parents=True, exist_ok=True)
        with open(run_dir / "metrics.jsonl", "w") as fh:
            for t, score in ((0.0, 0.1), (10.0 + cfg.seed, after)):
                fh.write(json.dumps({"kind": "eval", "rl_seconds": t, "score": score, "sampled_accuracy": score}) + "\n")
        return {"heldout": {"chain_sum": {"before": {"sampled_accuracy": 0.1, "greedy_accuracy": 0.2},
                                          "after": {"sampled_accuracy": after, "greedy_accuracy": after}}},
                "rl_steps": 5 + cfg.seed, "trained_tokens": 100 * (cfg.seed + 1)}
    return run


def test_sweep_writes_table_csv_png_and_skips_finished_runs(tmp_path: Path) -> None:
    calls: list[tuple[str, int]] = []
    out = tmp_path / "sweep"
    grids = parse_grid(["learner.lr=1e-4,2e-4"])
    records = run_sweep(None, grids, 2, out, run_fn=_build_fake_run(calls))
    assert len(records) == 4 and sorted(s for _, s in calls) == [0, 0, 1, 1]
    assert {Path(d).relative_to(out).as_posix() for d, _ in calls} == {
        "learner.lr=1e-4/seed0", "learner.lr=1e-4/seed1", "learner.lr=2e-4/seed0", "learner.lr=2e-4/seed1"}
    rows = list(csv.DictReader(open(out / "results.csv")))
    after = {r["cell"]: r for r in rows if r["figure"] == "chain_sum.sampled.after"}
    cell = after["learner.lr=1e-4"]   # seeds give 0.1 and 0.2: mean 0.15, half = 12.706 * 0.0707 / sqrt(2)
    assert float(cell["mean"]) == pytest.approx(0.15)
    assert float(cell["ci95_high"]) - float(cell["mean"]) == pytest.approx(12.706 * 0.05)
    assert float(after["learner.lr=2e-4"]["mean"]) == pytest.approx(0.25)
    steps = {r["cell"]: float(r["mean"]) for r in rows if r["figure"] == "steps"}
    assert steps == {"learner.lr=1e-4": 5.5, "learner.lr=2e-4": 5.5}
    md = (out / "results.md").read_text()
    assert "| learner.lr=1e-4 | 2 |" in md and "0.150 ± 0.635" in md
    png = out / "results.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # Rerun: every run is finished, nothing runs again; a lost record reruns only that run.
    run_sweep(None, grids, 2, out, run_fn=_build_fake_run(calls))
    assert len(calls) == 4
    (out / "learner.lr=2e-4" / "seed1" / DONE_FILE).unlink()
    run_sweep(None, grids, 2, out, run_fn=_build_fake_run(calls))
    assert len(calls) == 5 and calls[-1][1] == 1 and "2e-4" in calls[-1][0]


@pytest.mark.slow
@pytest.mark.e2e
def test_sweep_e2e_two_cells_two_seeds(tmp_path: Path, tiny_model_dir: str) -> None:
    """The real `trajmesh sweep` (CLI, mesh, evaluation) with tiny budgets; rerun skips all.

    6 learner steps, not fewer: a learner that finishes before the launcher's start-up health poll
    sees it is reported by start_mesh as "exited with 0 during start" (seen once with 2 steps)."""
    from trajmesh.run.cli import main

    out = tmp_path / "sweep"
    args = ["sweep", "examples/demo.yaml", "--grid", "gate.eta=0,1", "--seeds", "2", "--out", str(out), "--eval-every", "5",
            "--set", f"model.path={tiny_model_dir}", "--set", "learner.max_steps=6", "--set", "learner.batch_groups=2",
            "--set", "tasks.group_size=4", "--set", "tasks.heldout_size=8", "--set", "eval.samples=2",
            "--set", "eval.noise_seeds=0", "--set", "learner.engine.type=torch", "--set", "rollout.concurrent_tasks=4",
            "--set", "eval.in_mesh=false"]  # the launcher evaluates (no evaluator process per cell: the suite's time)
    root = REPO
    import os

    cwd = os.getcwd()
    os.chdir(root)
    try:
        assert main(args) == 0
        stamps = {p: p.stat().st_mtime_ns for p in out.glob(f"*/seed*/{DONE_FILE}")}
        assert len(stamps) == 4
        assert main(args) == 0
        assert {p: p.stat().st_mtime_ns for p in out.glob(f"*/seed*/{DONE_FILE}")} == stamps
    finally:
        os.chdir(cwd)
    rows = list(csv.DictReader(open(out / "results.csv")))
    assert {r["cell"] for r in rows} == {"gate.eta=0", "gate.eta=1"}
    assert any(r["figure"] == "chain_sum.sampled.after" and r["n"] == "2" for r in rows)
    assert (out / "results.png").exists() and "gate.eta=1" in (out / "results.md").read_text()
