"""The learner service across ranks: `learner.world_size=2` in the mesh (issue 11, item 1).

Two learner processes (gloo, DeepSpeed ZeRO-0 on CPU; ZeRO-3 in a slow variant) started by the launcher with RANK /
WORLD_SIZE / MASTER_ADDR / MASTER_PORT, real NATS, Redis and every other service:

- a short run trains its steps with exact accounting (every admitted trajectory ends as exactly one
  outcome, none trained twice, the gate agrees with the archive), rank 0 alone publishes weights
  (exactly one weights directory per version), and the follower leaves on the leader's ``stop``;
- kill -9 of rank 1 mid-run (after a metrics row shows a step was trained): the launcher kills the
  whole group and starts it again, it resumes from its checkpoint and replays the batches since,
  and accounting stays exact with nothing trained twice (slow).
"""

from __future__ import annotations

import re
from collections import Counter
from pathlib import Path

import pytest
from mesh_checks import (
    check_archive,
    check_gate_reconciles,
    check_no_stale,
    kill_group,
    learner_steps,
    supervise_until,
    write_manifest,
)

from trajmesh.config import ConfigError, RunConfig, load_config
from trajmesh.run.launcher import Mesh, Proc, accounting, start_mesh
from trajmesh.run.run_end import end_run

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(600)]

ETA = 1
STEPS = 5


def _build_config(run_dir: Path, model_dir: str, **over: object) -> RunConfig:
    return load_config(None, {
        "run_dir": str(run_dir), "model.path": model_dir, "gate.eta": ETA,
        "tasks.group_size": 4, "tasks.heldout_size": 20, "tasks.train_size": 300,
        "tasks.sampling.max_new_tokens": 6, "store.drop_zero_variance_groups": False,
        "rollout.replicas": 2, "rollout.concurrent_tasks": 2, "grader.replicas": 1,
        "learner.engine.type": "deepspeed", "learner.engine.zero_stage": 0, "learner.world_size": 2,
        "learner.batch_groups": 2, "learner.max_steps": STEPS, "learner.checkpoint_every": 3, **over,
    })


def _learners(mesh: Mesh) -> list[Proc]:
    return sorted((p for p in mesh.procs if p.name == "learner"), key=lambda p: p.replica)


def test_world_size_is_checked_at_load(tmp_path: Path) -> None:
    base = {"run_dir": str(tmp_path), "learner.batch_groups": 1, "tasks.group_size": 4}
    assert load_config(None, {**base, "learner.world_size": 4}).learner.world_size == 4
    for bad, needle in (({"learner.world_size": 0}, "greater than or equal to 1"),
                        ({"learner.world_size": 2, "learner.engine.type": "torch"}, "deepspeed"),
                        ({"learner.world_size": 5}, "larger than a batch")):
        with pytest.raises(ConfigError, match=needle):
            load_config(None, {**base, **bad})


def test_a_rank_outside_its_group_refuses_to_train(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """learner.world_size 2 but no process group of 2 (started by hand, no RANK/WORLD_SIZE): the
    learner fails at setup instead of training alone."""
    from trajmesh.services.learner import LearnerService

    monkeypatch.delenv("RANK", raising=False)
    cfg = load_config(None, {"run_dir": str(tmp_path), "learner.world_size": 2})
    svc = LearnerService(cfg)
    assert svc.rank == 0 and svc.leader
    with pytest.raises(RuntimeError, match="joined rank 0 of 1"):
        svc._check_world()
    monkeypatch.setenv("RANK", "1")
    assert not LearnerService(cfg).leader


@pytest.mark.parametrize("zero_stage", [0, pytest.param(3, marks=pytest.mark.slow)])
def test_two_learner_ranks_train_with_exact_accounting(tmp_path: Path, tiny_model_dir: str, zero_stage: int) -> None:
    """ZeRO-0 in make test; ZeRO-3 (every rank gathers for the probe and the export) slow."""
    cfg = _build_config(tmp_path / "run", tiny_model_dir, **{"learner.engine.zero_stage": zero_stage})
    Path(cfg.run_dir).mkdir(parents=True)
    write_manifest(cfg)
    mesh = start_mesh(cfg)
    try:
        cfg = mesh.cfg
        ranks = _learners(mesh)
        assert [p.env.get("RANK") for p in ranks] == ["0", "1"]
        assert {p.env["WORLD_SIZE"] for p in ranks} == {"2"} and len({p.env["MASTER_PORT"] for p in ranks}) == 1
        for p in ranks:  # the follower leaves when the leader says stop, both cleanly
            assert p.popen.wait(timeout=400) == 0, p.log_path.read_text()[-3000:]
        assert not [p.label for p in mesh.dead() if p.popen.returncode != 0]
        assert end_run(mesh) == 0
        acct = accounting(cfg)
        rows = check_archive(cfg, acct, ETA)
        check_gate_reconciles(cfg, rows)
        check_no_stale(acct, cfg.run_dir)
    finally:
        mesh.stop_services()
        mesh.stop_infra()
    steps = learner_steps(cfg)
    assert [m["version"] for m in steps] == list(range(1, STEPS + 1))
    assert all(m["learner_ranks"] == 2 for m in steps)
    # Each step's trained trajectories are the batch's, counted once (not once per rank).
    trained = Counter(r["learner_version"] for r in rows if r["outcome"] == "trained")
    assert [trained[v] for v in range(STEPS)] == [m["trajectories_trained"] for m in steps]
    # Rank 0 alone publishes: one weights directory per version, none from the follower.
    published = Counter(int(re.match(r"v(\d+)-", d.name).group(1))  # type: ignore[union-attr]
                        for d in (Path(cfg.run_dir) / "weights").iterdir() if not d.name.startswith("."))
    assert published == Counter(range(1, STEPS + 1)), published
    follower_log = ranks[1].log_path.read_text()
    assert f"rank 1: the leader stopped the group at version {STEPS}" in follower_log
    assert "checkpoint at version" not in follower_log  # the leader's log line: rank 0 renames


@pytest.mark.slow
def test_killing_rank_1_restarts_the_group_from_its_checkpoint(tmp_path: Path, tiny_model_dir: str) -> None:
    steps_total = 8
    cfg = _build_config(tmp_path / "run", tiny_model_dir, **{"learner.max_steps": steps_total,
                                                              "learner.keep_batches": True})
    Path(cfg.run_dir).mkdir(parents=True)
    write_manifest(cfg)
    mesh = start_mesh(cfg)
    try:
        cfg = mesh.cfg
        supervise_until(mesh, lambda: len(learner_steps(cfg)) >= 4, timeout_s=300)  # past the checkpoint at 3
        victim = _learners(mesh)[1]
        kill_group(victim.popen.pid)
        victim.popen.wait(timeout=10)
        supervise_until(mesh, lambda: victim not in mesh.procs, timeout_s=60)  # the group was restarted
        assert mesh.restarts[("learner", 0)] == 1
        supervise_until(mesh, lambda: all(p.popen.poll() == 0 for p in _learners(mesh)), timeout_s=400)
        assert mesh.restarts[("learner", 0)] == 1, "the group died again after its restart"
        assert end_run(mesh) == 0
        acct = accounting(cfg)
        rows = check_archive(cfg, acct, ETA)  # nothing lost, nothing trained twice
        check_gate_reconciles(cfg, rows)
    finally:
        mesh.stop_services()
        mesh.stop_infra()
    leader_log = (Path(cfg.run_dir) / "logs" / "learner-0.log").read_text()
    assert "rank 0 resumed from checkpoint at version" in leader_log
    assert "rank 1 resumed from checkpoint at version" in (Path(cfg.run_dir) / "logs" / "learner-1.log").read_text()
    steps = learner_steps(cfg)
    # Versions advance by one; the steps replayed after the restart repeat their rows with the same version.
    assert steps[-1]["version"] == steps_total
    assert sorted({m["version"] for m in steps}) == list(range(1, steps_total + 1))
    trained = Counter(r["learner_version"] for r in rows if r["outcome"] == "trained")
    assert sum(trained.values()) == sum({m["version"]: m["trajectories_trained"] for m in steps}.values())
