"""The KL-to-reference term in a mesh run (every service a real process, real NATS and Redis):
the same seed and config twice, `learner.reference.kl_coef` 0 (the reference only measured) and
β > 0. With the term, KL(π_θ ‖ π_ref) (k3, each step's metrics.jsonl record) stays under a bound
the run without it stays above (sync mode, lr 5e-2, β 4, 8 steps; 25 s of call time for both runs
on an idle 2-core machine); the manifest records the setting."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from mesh_checks import learner_steps, train_to_end

from trajmesh.config import load_config

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(600)]

STEPS = 8
BOUND = 0.3


def _run(run_dir: Path, model_dir: str, coef: float) -> tuple[list[float], dict]:
    cfg = load_config(None, {
        "run_dir": str(run_dir), "model.path": model_dir, "mode": "sync", "seed": 3,
        "tasks.group_size": 4, "tasks.heldout_size": 20, "tasks.train_size": 300,
        "tasks.sampling.max_new_tokens": 6, "rollout.replicas": 1, "grader.replicas": 1,
        "store.drop_zero_variance_groups": False,
        "learner.engine.type": "torch", "learner.batch_groups": 3, "learner.max_steps": STEPS,
        "learner.lr": 5e-2, "learner.warmup_steps": 0, "learner.checkpoint_every": STEPS,
        "learner.reference.enabled": True, "learner.reference.kl_coef": coef,
    })
    train_to_end(cfg, timeout_s=600)  # and the checks of every healthy run: exact accounting, no stale
    steps = learner_steps(cfg)
    assert [m["version"] for m in steps] == list(range(1, STEPS + 1))
    manifest = json.loads((run_dir / "manifest.json").read_text())
    return [m["trajmesh_learner_reference_kl_k3"] for m in steps], manifest


def test_the_term_bounds_kl_to_the_reference_in_a_mesh_run(tmp_path: Path, tiny_model_dir: str) -> None:
    off, manifest_off = _run(tmp_path / "off", tiny_model_dir, 0.0)
    on, manifest_on = _run(tmp_path / "on", tiny_model_dir, 4.0)
    for manifest, coef in ((manifest_off, 0.0), (manifest_on, 4.0)):
        algorithm = json.loads(manifest["algorithm_json"])
        assert algorithm["learner"]["reference"]["enabled"] is True
        assert algorithm["learner"]["reference"]["kl_coef"] == coef
    assert off[0] == on[0] == 0.0  # the first step trains the reference's own weights
    # The first updates move both runs alike (the term's gradient is 0 at the reference); over the
    # second half the term holds KL under the bound and the run without it stays above it.
    half = STEPS // 2
    print(json.dumps({"on": on, "off": off}))
    assert max(on[half:]) < BOUND < min(off[half:]), json.dumps({"on": on, "off": off})
