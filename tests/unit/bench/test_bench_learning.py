"""The learning benchmark's analysis (bench/bench_learning.py) by hand, and the sweep's interleaved order."""

from __future__ import annotations

import importlib.util
import json
import math
from pathlib import Path
from typing import Any

import pytest
from repo_paths import REPO

from trajmesh.config import RunConfig
from trajmesh.run.sweep import parse_grid, run_sweep

_spec = importlib.util.spec_from_file_location("bench_learning",
                                               REPO / "bench" / "bench_learning.py")
assert _spec is not None and _spec.loader is not None
bl = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(bl)


def _ev(phase: str, t: float, acc: float, version: int = 0) -> dict[str, Any]:
    return {"kind": "eval", "phase": phase, "rl_seconds": t, "sampled_accuracy": acc, "version": version}


def test_curve_keeps_before_and_during_in_time_order() -> None:
    evals = [_ev("during", 20, 0.5), _ev("before", 0, 0.3), _ev("after", 25, 0.9), _ev("during", 10, 0.4)]
    assert bl.curve(evals) == [(0.0, 0.3), (10.0, 0.4), (20.0, 0.5)]


def test_smoothing_and_time_to_target() -> None:
    pts = [(0.0, 0.30), (10.0, 0.60), (20.0, 0.30), (30.0, 0.60)]
    sm = bl.smoothed(pts, 3)   # (0.3 + 0.6 + 0.3) / 3 = 0.4 at 20 s, (0.6 + 0.3 + 0.6) / 3 = 0.5 at 30 s
    assert [t for t, _ in sm] == [20.0, 30.0] and [v for _, v in sm] == pytest.approx([0.4, 0.5])
    assert bl.time_to_target(sm, 0.45) == 30.0
    assert bl.time_to_target(sm, 0.4) == 20.0   # at or above
    assert bl.time_to_target(sm, 0.51) is None
    assert bl.time_to_target(pts, 0.45) == 10.0  # the raw curve would take the single spike


def test_normalized_auc_by_hand() -> None:
    pts = [(0.0, 0.3), (10.0, 0.5)]
    # 0-10 s: trapezoid mean 0.4, gain 0.1 → 1.0; 10-20 s held at 0.5, gain 0.2 → 2.0; (1 + 2) / 20
    assert bl.normalized_auc(pts, 0.3, 20.0) == pytest.approx(0.15)
    # cut at 5 s: the segment ends at 0.4, trapezoid mean 0.35, gain 0.05 over 5 s → 0.05
    assert bl.normalized_auc(pts, 0.3, 5.0) == pytest.approx(0.05)
    # a first evaluation after 0 is held back to 0: 0.2 over 0-10, trapezoid 0.2→0.4 over 10-20 (0.3)
    assert bl.normalized_auc([(10.0, 0.2), (20.0, 0.4)], 0.0, 20.0) == pytest.approx((2.0 + 3.0) / 20)
    with pytest.raises(ValueError):
        bl.normalized_auc([], 0.0, 10.0)


def test_interp_and_tokens_curve() -> None:
    assert bl.interp([0.0, 10.0], [1.0, 3.0], 2.5) == pytest.approx(1.5)
    assert bl.interp([0.0, 10.0], [1.0, 3.0], -1.0) == 1.0 and bl.interp([0.0, 10.0], [1.0, 3.0], 11.0) == 3.0
    steps = [{"version": v, "trajmesh_learner_tokens": 100 * v} for v in (1, 2, 3)]  # cumulative 100, 300, 600
    evals = [_ev("before", 0, 0.3, 0), _ev("during", 5, 0.4, 2), _ev("during", 9, 0.5, 3), _ev("after", 9, 0.9, 3),
             _ev("during", 12, 0.45, 7)]  # version 7 has no step record here: the tokens up to the newest below it
    assert bl.tokens_curve(evals, steps) == [(0.0, 0.3), (300.0, 0.4), (600.0, 0.5), (600.0, 0.45)]


def test_welch_interval_by_hand() -> None:
    # a = 1, 2, 3 (var 1), b = 2, 4, 6 (var 4): se² = 1/3 + 4/3 = 5/3;
    # df = (5/3)² / ((1/3)²/2 + (4/3)²/2) = 50/17 ≈ 2.94 → 2 (conservative) → t = 4.303
    d, half = bl.welch_ci95([1.0, 2.0, 3.0], [2.0, 4.0, 6.0])
    assert d == pytest.approx(-2.0) and half == pytest.approx(4.303 * math.sqrt(5 / 3))
    assert bl.welch_ci95([1.0], [2.0, 3.0]) == (-1.5, None)
    assert bl.welch_ci95([1.0, 1.0], [2.0, 2.0]) == (-1.0, 0.0)


def _run(seed: int, before: float, during: list[tuple[float, float, int]], tokens_per_step: int, nsteps: int,
         after: float) -> dict[str, Any]:
    evals = [_ev("before", 0.0, before, 0)] + [_ev("during", t, a, v) for t, a, v in during]
    steps = [{"version": v, "trajmesh_learner_tokens": tokens_per_step} for v in range(1, nsteps + 1)]
    summary = {"trained_tokens": tokens_per_step * nsteps, "rl_steps": nsteps, "rl_seconds": 30.0,
               "heldout_accuracy_before_rl": before, "heldout_accuracy_after_rl": after}
    return {"seed": seed, "evals": evals, "steps": steps, "summary": summary}


def test_analyze_runs_baseline_targets_times_auc_and_tokens() -> None:
    runs = {"async": [_run(0, 0.30, [(10, 0.36, 4), (20, 0.40, 8), (30, 0.44, 12)], 10, 12, 0.44)],
            "sync": [_run(0, 0.34, [(10, 0.34, 1), (20, 0.36, 2), (30, 0.38, 3)], 20, 3, 0.38)]}
    res = bl.analyze_runs(runs, deltas=(0.02, 0.06), window=2, horizon=30.0)
    assert res["baseline"] == pytest.approx(0.32)          # (0.30 + 0.34) / 2
    assert res["targets"] == pytest.approx([0.34, 0.38])
    assert res["common_tokens"] == 60.0                      # min(120, 60)
    a, s = res["modes"]["async"][0], res["modes"]["sync"][0]
    # async smoothed (window 2): 10 s 0.33, 20 s 0.38, 30 s 0.42 → 0.34 at 20 s, 0.38 at 20 s
    assert a["times"] == [20.0, 20.0]
    # sync smoothed: 10 s 0.34, 20 s 0.35, 30 s 0.37 → 0.34 at 10 s, 0.38 never
    assert s["times"] == [10.0, None]
    # async AUC: (0.33 + 0.38 + 0.42) * 10 / 30 − 0.32 = 0.37667 − 0.32
    assert a["auc"] == pytest.approx((0.33 + 0.38 + 0.42) / 3 - 0.32)
    # async at 60 tokens: evaluation at version 4 = 40 tokens (0.36), version 8 = 80 tokens (0.40) → 0.38
    assert a["gain_at_common_tokens"] == pytest.approx(0.38 - 0.32)
    # sync at 60 tokens = its version 3 (0.38)
    assert s["gain_at_common_tokens"] == pytest.approx(0.38 - 0.32)
    assert a["gain_per_mtok"] == pytest.approx((0.44 - 0.30) / 120 * 1e6)
    text = bl.report(res, horizon=30.0)
    assert "reached 1/1" in text and "reached 0/1" in text and "baseline" in text


def test_sweep_interleaves_seeds_when_asked(tmp_path: Path) -> None:
    calls: list[tuple[str, int]] = []

    def fake(cfg: RunConfig) -> dict[str, Any]:
        calls.append((cfg.mode, cfg.seed))
        Path(cfg.run_dir).mkdir(parents=True, exist_ok=True)
        (Path(cfg.run_dir) / "metrics.jsonl").write_text(json.dumps(_ev("before", 0.0, 0.1)) + "\n")
        return {"rl_steps": 1, "trained_tokens": 1}

    records = run_sweep(None, parse_grid(["mode=async,sync"]), 2, tmp_path / "i", run_fn=fake, interleave=True)
    assert calls == [("async", 0), ("sync", 0), ("async", 1), ("sync", 1)]
    assert [(r["cell"], r["seed"]) for r in records] == [("mode=async", 0), ("mode=async", 1), ("mode=sync", 0),
                                                         ("mode=sync", 1)]
    calls.clear()
    run_sweep(None, parse_grid(["mode=async,sync"]), 2, tmp_path / "c", run_fn=fake)
    assert calls == [("async", 0), ("async", 1), ("sync", 0), ("sync", 1)]


def test_rebase_replaces_only_the_before_point() -> None:
    runs = {"async": [_run(0, 0.30, [(10, 0.36, 4)], 10, 4, 0.44), _run(1, 0.32, [(10, 0.37, 4)], 10, 4, 0.45)]}
    out = bl.rebase(runs, {0: 0.25, 1: 0.27})
    assert bl.curve(out["async"][0]["evals"]) == [(0.0, 0.25), (10.0, 0.36)]
    assert bl.curve(out["async"][1]["evals"]) == [(0.0, 0.27), (10.0, 0.37)]
    assert bl.curve(runs["async"][0]["evals"])[0] == (0.0, 0.30)   # the input is untouched
    assert bl.analyze_runs(out, deltas=(0.02,), window=1, horizon=10.0)["baseline"] == pytest.approx(0.26)


def test_paired_difference_by_hand() -> None:
    # differences 1, 2, 3 (seed 3 only in a: ignored): mean 2, s = 1, half = 4.303 / sqrt(3)
    d, half = bl.paired_ci95({0: 5.0, 1: 6.0, 2: 7.0, 3: 9.0}, {0: 4.0, 1: 4.0, 2: 4.0})
    assert d == pytest.approx(2.0) and half == pytest.approx(4.303 / math.sqrt(3))
    assert bl.paired_ci95({0: 1.0}, {1: 1.0}) is None
