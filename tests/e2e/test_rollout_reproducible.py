"""Two runs of the same config and seed in sync mode produce identical trajectories for the first
learner step: task order from the run seed, each trajectory's sampling seed from (run seed, task
id, sample index) through the engine's ``sampling_seed``, environments seeded by task and index.
The two samples of a group differ (so the equality is not vacuous)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from mesh_checks import write_manifest

from trajmesh.config import load_config
from trajmesh.run.launcher import start_mesh
from trajmesh.services.store.archive import read_archive

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(600)]


def _first_step_trajectories(run_dir: Path, model_dir: str, seed: int) -> dict[str, tuple[Any, ...]]:
    cfg = load_config(None, {
        "run_dir": str(run_dir), "model.path": model_dir, "seed": seed, "mode": "sync",
        "tasks.group_size": 2, "tasks.train_size": 50, "tasks.heldout_size": 5,
        "tasks.sampling.max_new_tokens": 6, "tasks.sampling.temperature": 1.0,
        "rollout.replicas": 1, "rollout.concurrent_tasks": 2, "grader.replicas": 1, "environment.replicas": 1,
        "store.drop_zero_variance_groups": False,
        "learner.engine.type": "torch", "learner.batch_groups": 2, "learner.max_steps": 1,
    })
    run_dir.mkdir(parents=True)
    write_manifest(cfg)
    mesh = start_mesh(cfg)
    try:
        learner = next(p for p in mesh.procs if p.name == "learner")
        assert learner.popen.wait(timeout=300) == 0, learner.log_path.read_text()[-3000:]
    finally:
        mesh.stop_services()
        mesh.stop_infra()
    rows = read_archive(run_dir / "archive").to_pylist()
    trained = {r["trajectory_id"] for r in rows if r["outcome"] == "trained" and r["learner_version"] == 0}
    accepted = {r["trajectory_id"]: r for r in rows if r["outcome"] == "accepted"}
    assert trained and trained <= accepted.keys()
    return {t: (tuple(accepted[t]["token_ids"]), tuple(accepted[t]["behavior_logprobs"]),
                tuple(accepted[t]["loss_mask"])) for t in trained}


def test_same_seed_same_first_step_trajectories(tmp_path: Path, tiny_model_dir: str) -> None:
    first = _first_step_trajectories(tmp_path / "a", tiny_model_dir, seed=7)
    again = _first_step_trajectories(tmp_path / "b", tiny_model_dir, seed=7)
    assert first.keys() == again.keys()
    for tid in first:
        ids_a, logp_a, mask_a = first[tid]
        ids_b, logp_b, mask_b = again[tid]
        assert ids_a == ids_b and mask_a == mask_b, tid
        assert logp_a == pytest.approx(logp_b, abs=1e-5), tid
    # not vacuous: the two samples of a group (same prompt, sample index 0 and 1) differ
    groups: dict[str, set[tuple[int, ...]]] = {}
    for tid, (ids, _, _) in first.items():
        groups.setdefault(tid.rsplit("-", 1)[0], set()).add(ids)
    assert any(len(samples) > 1 for samples in groups.values())
