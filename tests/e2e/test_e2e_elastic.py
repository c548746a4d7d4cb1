"""Elastic rollout on the local mesh: rollout processes join and leave while training runs.

1. A rollout process started mid-run (`mesh.start_service("rollout", 2)`) starts from the latest
   weights announced in the KV bucket (its `trajmesh_rollout_policy_version` gauge, set before it
   reports healthy, is at least the version announced just before it started; it never logs
   loading an older version), and it produces trajectories.
2. `kill -9` of another rollout process (with its engine: the whole process group, as a pod dies)
   loses no admitted task: its unacked tasks come back from JetStream after `ack_wait` and every
   admitted trajectory ends as exactly one archived outcome.

The test sets `rollout.task_ack_wait_s` short, so the dead rollout's tasks come back quickly (live
rollouts keep theirs with in-progress heartbeats).

The runs train with `learner.truncation.policy: mask`: each step trains exactly the loss tokens of
its trajectories that ended before the token budget, by the archive, and none of those that hit it
(MAX_TOKENS). And they sample toward a pass-rate band: a profile the test writes puts every other
training task in the band [0.25, 0.75] (pass rate 1/2) and the rest below it (0/2), weighted
OUTSIDE_WEIGHT; the tasks the store admitted are in the band far more often than the pool's half.
"""

from __future__ import annotations

import asyncio
import os
import re
import signal
import time
import urllib.request
import warnings
from pathlib import Path

import pytest
from mesh_checks import check_archive, learner_steps, store_draws, write_manifest

from trajmesh import security
from trajmesh.config import RunConfig, load_config
from trajmesh.run.launcher import accounting, start_mesh
from trajmesh.run.run_end import drain, end_run
from trajmesh.services.store.repo import base_task_id
from trajmesh.tasks import load_split, profile_key, write_profile
from trajmesh.weights import announce

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300)]

ETA = 2
STEPS = 12
JOIN_STEPS = 24
SHORT_ACK_WAIT_S = 3.0
BAND, OUTSIDE_WEIGHT = (0.25, 0.75), 0.05
"""The curriculum: in-band share of draws 1 / (1 + OUTSIDE_WEIGHT) = 0.952 against the pool's 0.5."""
MIN_IN_BAND_SHARE = 0.8
"""What the admitted tasks' in-band share must reach. The sampler's sequence is seeded, so only the
number of draws varies between runs; every prefix of it from 20 draws on is above this."""


def _build_config(run_dir: Path, model_dir: str, steps: int = STEPS) -> RunConfig:
    return load_config(None, {
        "run_dir": str(run_dir), "model.path": model_dir, "gate.eta": ETA,
        "tasks.group_size": 4, "tasks.heldout_size": 20, "tasks.train_size": 300,
        "tasks.sampling.max_new_tokens": 6,
        "rollout.replicas": 2, "rollout.concurrent_tasks": 2, "grader.replicas": 1,
        "learner.engine.type": "torch", "learner.batch_groups": 4, "learner.max_steps": steps,
        "learner.checkpoint_every": 4, "rollout.task_ack_wait_s": SHORT_ACK_WAIT_S,
        "learner.truncation.policy": "mask", "tasks.profile": str(run_dir.with_name("profile.json")),
        "tasks.sources": [{"type": "reasoning_gym", "curriculum": {"target_band": list(BAND),
                                                                  "outside_band_weight": OUTSIDE_WEIGHT}}],
    })


def _write_profile(cfg: RunConfig) -> set[str]:
    """The profile the run samples on: every other training task in the band; returns their ids."""
    (src,) = cfg.tasks.sources
    train, _ = load_split(src, cfg.tasks.train_size, cfg.tasks.heldout_size)
    in_band = {t.task_id for t in train[::2]}
    write_profile(cfg.tasks.profile, {profile_key(t.source, t.task_id): (1 if t.task_id in in_band else 0, 2)
                                      for t in train}, source="test_e2e_elastic")
    return in_band


def _check_admitted_toward_the_band(rows: list[dict], in_band: set[str]) -> None:  # type: ignore[type-arg]
    """Each task the store drew is in the band at least MIN_IN_BAND_SHARE of the time; half the
    pool is."""
    drawn = store_draws(rows)
    assert len(drawn) >= 20, len(drawn)
    share = sum(base_task_id(t) in in_band for t in drawn) / len(drawn)
    assert share >= MIN_IN_BAND_SHARE, (share, len(drawn))


def _check_truncated_responses_masked(cfg: RunConfig, rows: list[dict]) -> None:  # type: ignore[type-arg]
    """`mask`: each step's trained tokens are the loss tokens of its trained trajectories from the
    archive, less every token of those that ended at the token budget; at least one was masked."""
    intake = {r["trajectory_id"]: r for r in rows if r["outcome"] == "accepted"}
    steps = learner_steps(cfg)
    assert steps
    masked = 0
    for m in steps:
        batch = [intake[r["trajectory_id"]] for r in rows
                 if r["outcome"] == "trained" and r["learner_version"] == m["version"] - 1]
        assert len(batch) == m["trajectories_trained"], m["version"]
        want = sum(sum(a["loss_mask"]) for a in batch if a["terminal_reason"] != "MAX_TOKENS")
        assert m["tokens_trained"] == want, (m["version"], m["tokens_trained"], want)
        masked += sum(a["terminal_reason"] == "MAX_TOKENS" for a in batch)
    assert masked, "no trained trajectory hit the token budget: the mask never acted"


async def _latest_version(cfg: RunConfig) -> int:
    bus = await security.connect_bus(cfg, "admin", name="test-elastic")  # the run's admin credentials
    try:
        return await announce.latest_version(bus)
    finally:
        await bus.close()


def _metric(port: int, name: str) -> float:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
        text = r.read().decode()
    values = [float(m.group(1)) for m in re.finditer(rf"^{name}(?:{{[^}}]*}})? (\S+)$", text, re.M)]
    assert values, f"{name} not exported"
    return sum(values)


def _wait_for_version(cfg: RunConfig, version: int, learner_alive: object, timeout_s: float = 120) -> int:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        v = asyncio.run(_latest_version(cfg))
        if v >= version:
            return v
        assert learner_alive(), "learner exited early"
        time.sleep(0.5)
    raise TimeoutError(f"weights v{version} not announced in {timeout_s}s")


@pytest.mark.slow  # the joining run below kills a rollout the same way and checks the same accounting
def test_killed_rollout_loses_no_admitted_task(tmp_path: Path, tiny_model_dir: str) -> None:
    _run(tmp_path, tiny_model_dir, join=False)


def test_rollout_joins_mid_run_from_latest_weights(tmp_path: Path, tiny_model_dir: str) -> None:
    _run(tmp_path, tiny_model_dir, join=True)


def _run(tmp_path: Path, tiny_model_dir: str, *, join: bool) -> None:
    # After the joiner started (the learner held meanwhile) it needs a few steps to take part.
    cfg = _build_config(tmp_path / "run", tiny_model_dir, steps=JOIN_STEPS if join else STEPS)
    in_band = _write_profile(cfg)
    Path(cfg.run_dir).mkdir(parents=True)
    write_manifest(cfg)
    mesh = start_mesh(cfg)
    try:
        cfg = mesh.cfg
        learner = next(p for p in mesh.procs if p.name == "learner")
        victim = next(p for p in mesh.procs if p.name == "rollout" and p.replica == 0)

        # A rollout process dies mid-run, engine and all (as a pod does), holding unacked tasks.
        _wait_for_version(cfg, 1, lambda: learner.popen.poll() is None)
        os.killpg(victim.popen.pid, signal.SIGKILL)
        victim.popen.wait(timeout=10)

        if not join:
            assert learner.popen.wait(timeout=240) == 0, learner.log_path.read_text()[-3000:]
            assert not [p.label for p in mesh.dead() if p not in (learner, victim)]
            assert drain(cfg) == 0
            mesh.stop_services()
            rows = check_archive(cfg, accounting(cfg), ETA)
            _check_truncated_responses_masked(cfg, rows)
            _check_admitted_toward_the_band(rows, in_band)
            return
        # A new rollout process joins and starts from the latest announced weights. The learner is
        # held (SIGSTOP) while the joiner starts (longer than a short run would last on a loaded
        # machine), so the joiner always takes part in the rest of the run.
        os.kill(learner.popen.pid, signal.SIGSTOP)
        try:
            announced = asyncio.run(_latest_version(cfg))
            joiner = mesh.start_service("rollout", 2)
            mesh.wait_healthy([joiner])
            deadline = time.monotonic() + 60
            while _metric(joiner.metrics_port, "trajmesh_rollout_policy_version") < announced:
                assert time.monotonic() < deadline, "the joiner did not load the announced weights"
                time.sleep(0.2)
        finally:
            os.kill(learner.popen.pid, signal.SIGCONT)
        assert announced >= 1
        assert learner.popen.poll() is None, "the learner finished before the joiner took part"

        assert learner.popen.wait(timeout=240) == 0, learner.log_path.read_text()[-3000:]
        others_dead = [p.label for p in mesh.dead() if p not in (learner, victim)]
        assert not others_dead, others_dead
        assert drain(cfg) == 0
        joiner_trajectories = _metric(joiner.metrics_port, "trajmesh_rollout_trajectories_total")
        # The stop path `trajmesh train` runs: a store whose finalizing stop did not exit 0 is
        # started again to finalize (a bare stop_services() left that failure silent, and the
        # groups the store held ended "accepted", with no final outcome).
        store = next(p for p in mesh.procs if p.name == "store")
        assert end_run(mesh, drain_s=0.0) == 0
        if store.popen.returncode != 0:  # end_run finalized with a fresh store; keep why the first failed
            warnings.warn(f"the store's stop exited {store.popen.returncode}: "
                          f"{store.log_path.read_text()[-2000:]}", stacklevel=1)
        acct = accounting(cfg)
    finally:
        mesh.stop_services()
        mesh.stop_infra()

    # The joiner's first load was the announced version (or newer), never an older one.
    loaded = [int(v) for v in re.findall(r"loaded weights v(\d+)", joiner.log_path.read_text())]
    assert loaded and loaded[0] >= announced and loaded == sorted(loaded), (announced, loaded)
    assert joiner_trajectories > 0, "the late joiner produced no trajectories"

    rows = check_archive(cfg, acct, ETA)
    _check_truncated_responses_masked(cfg, rows)
    _check_admitted_toward_the_band(rows, in_band)
