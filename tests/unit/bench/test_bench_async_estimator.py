"""The async-vs-sync benchmark's time-to-accuracy estimator, by hand."""

from __future__ import annotations

import importlib.util

import pytest
from repo_paths import REPO

_spec = importlib.util.spec_from_file_location("bench_async", REPO / "bench" / "bench_async.py")
assert _spec is not None and _spec.loader is not None
bench_async = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(bench_async)


def _evals(points: list[tuple[float, float]]) -> list[dict[str, float]]:
    return [{"rl_seconds": t, "acc": a} for t, a in points]


def test_smoothing_is_a_trailing_mean_from_the_first_full_window() -> None:
    curve = bench_async.smoothed(_evals([(0, 0.3), (10, 0.6), (20, 0.3), (30, 0.6)]), "acc", 3)
    assert [t for t, _ in curve] == [20, 30]
    assert [v for _, v in curve] == pytest.approx([0.4, 0.5])


def test_a_single_spike_no_longer_wins_the_race() -> None:
    # sync spikes once early; async climbs steadily. The raw first crossing of 0.45 would favour sync.
    sync = _evals([(0, 0.40), (10, 0.55), (20, 0.40), (30, 0.42), (40, 0.44), (50, 0.46)])
    fast = _evals([(0, 0.40), (10, 0.50), (20, 0.52), (30, 0.52), (40, 0.54), (50, 0.55)])
    curves = {"sync": bench_async.smoothed(sync, "acc", 3), "async": bench_async.smoothed(fast, "acc", 3)}
    times = bench_async.time_to_accuracy(curves, 0.45)
    assert times == {"sync": 20, "async": 20}  # smoothed: sync (0.40 + 0.55 + 0.40) / 3 = 0.45
    times = bench_async.time_to_accuracy(curves, 0.47)
    assert times == {"sync": None, "async": 20}  # sync never gets there: only a lower bound exists
