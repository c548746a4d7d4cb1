"""Assertions shared by the end-to-end mesh tests (imported by them; not a test module)."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path
from typing import Any

from trajmesh.archive import read_archive
from trajmesh.config import RunConfig


def check_archive(cfg: RunConfig, acct: dict[str, Any], eta: int) -> list[dict[str, Any]]:
    """No trajectory trained twice; every trained token's lag in [0, η]; every admitted trajectory
    ends as exactly one final outcome (none left "accepted"). Returns the archive rows."""
    rows = read_archive(Path(cfg.run_dir) / "archive").to_pylist()
    trained = Counter(r["trajectory_id"] for r in rows if r["outcome"] == "trained")
    assert trained and max(trained.values()) == 1, "a trajectory was trained twice"
    intake = {r["trajectory_id"]: r for r in rows if r["outcome"] == "accepted"}
    for r in rows:
        if r["outcome"] == "trained":
            acc = intake[r["trajectory_id"]]
            lags = [r["learner_version"] - v for v, m in zip(acc["behavior_versions"], acc["loss_mask"], strict=True) if m]
            assert lags and 0 <= min(lags) and max(lags) <= eta, (r["trajectory_id"], lags)
    outcomes = acct["outcomes"]
    assert outcomes.get("accepted", 0) == 0, json.dumps(acct)
    total = sum(outcomes.get(k, 0) for k in ("trained", "filtered", "quarantined", "failed_infra"))
    assert acct["admitted"] > 0 and total == acct["admitted"], json.dumps(acct)
    return rows
