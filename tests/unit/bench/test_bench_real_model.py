"""The real-model benchmark's breakdown of `trajmesh train` (bench/bench_real_model.py): log record
times, the first matching record, and the spans between events."""

from __future__ import annotations

import importlib.util
from datetime import datetime

import pytest
from repo_paths import REPO

_spec = importlib.util.spec_from_file_location("bench_real_model", REPO / "bench" / "bench_real_model.py")
assert _spec is not None and _spec.loader is not None
brm = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(brm)


def test_log_time_reads_the_logging_asctime_in_local_time() -> None:
    t = brm.log_time("2026-12-04 22:41:05,250 trajmesh.service INFO learner-0-123 ready")
    assert t == pytest.approx(datetime(2026, 12, 4, 22, 41, 5).timestamp() + 0.25)
    assert brm.log_time("Traceback (most recent call last):") is None
    assert brm.log_time("  2026-12-04 22:41:05,250 indented") is None


def test_first_match_takes_the_first_stamped_line_matching() -> None:
    lines = ["learner-0-77 ready (unstamped)",
             "2026-12-04 10:00:01,000 trajmesh.service INFO rollout-0-9 ready",
             "2026-12-04 10:00:02,000 trajmesh.service INFO learner-0-77 ready",
             "2026-12-04 10:00:03,000 trajmesh.service INFO learner-0-77 ready"]
    assert brm.first_match(lines, r"learner-0-\d+ ready") == brm.log_time(lines[2])
    assert brm.first_match(lines, r"learner-1-\d+ ready") is None


def test_breakdown_spans_follow_time_order_and_skip_unseen_events() -> None:
    out = brm.breakdown(100.0, {"a": 101.0, "c": 110.0, "b": 104.5, "never": None})
    assert out["a"] == 1.0 and out["b"] == 4.5 and out["c"] == 10.0 and out["never"] is None
    assert out["a -> b"] == 3.5 and out["b -> c"] == 5.5
    assert not any("never" in k for k in out if "->" in k) and "a -> c" not in out
