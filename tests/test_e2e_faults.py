"""Faults during a training run, with real processes (issue: reliability).

One run; in turn: kill -9 a rollout, the environment, a grader, the trajectory store and the
learner (each restarted by the launcher's supervisor, as Kubernetes would restart a pod), then
restart the NATS server and the Redis server (same ports and data dirs). After each fault the run
must make progress again, and at the end:

- every admitted trajectory ends as exactly one archived outcome (trained, filtered, quarantined,
  failed_infra); none is lost, none trained twice;
- every trained token's lag ≤ η, and the gate's bound held after recovery;
- the learner resumed from its checkpoint (replaying the batches it had trained since) reaches
  bitwise the same weights as an uninterrupted learner fed the same batches in the same order.
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest
import torch
from mesh_checks import check_archive
from safetensors.torch import load_file

from trajmesh.config import RunConfig, load_config
from trajmesh.gate import StalenessGate
from trajmesh.keys import RedisKeys
from trajmesh.launcher import Mesh, accounting, drain, start_mesh
from trajmesh.security import redis_sync_client
from trajmesh.train import _write_manifest, read_metrics

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(900)]

ETA = 1
STEPS = 40


def _build_config(run_dir: Path, model_dir: str) -> RunConfig:
    return load_config(None, {
        "run_dir": str(run_dir), "model.path": model_dir, "gate.eta": ETA,
        "tasks.group_size": 4, "tasks.heldout_size": 20, "tasks.train_size": 300,
        "tasks.sampling.max_new_tokens": 6, "store.drop_zero_variance_groups": False,
        "store.intake_ack_wait_s": 4.0, "rollout.task_ack_wait_s": 4.0,
        "rollout.replicas": 2, "rollout.concurrent_tasks": 2, "grader.replicas": 2,
        "learner.engine.type": "torch", "learner.batch_groups": 2, "learner.max_steps": STEPS,
        "learner.checkpoint_every": 3, "learner.keep_batches": True,
    })


def _steps(cfg: RunConfig) -> int:
    steps = [m for m in read_metrics(Path(cfg.run_dir)) if m.get("kind") == "learner_step"]
    return steps[-1]["step"] if steps else 0


def _supervise_until(mesh: Mesh, cond, timeout_s: float = 180.0) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout_s
    while not cond():
        mesh.restart_dead()
        assert time.monotonic() < deadline, "no progress after a fault"
        time.sleep(0.3)


def _kill(mesh: Mesh, name: str) -> None:
    victim = next(p for p in mesh.procs if p.name == name and p.popen.poll() is None)
    os.killpg(victim.popen.pid, signal.SIGKILL)  # the process and its children (rollout's engine)
    victim.popen.wait(timeout=10)


def _gate_bound_holds(cfg: RunConfig) -> bool:
    r = redis_sync_client(cfg)
    try:
        c = StalenessGate(r, key_prefix=RedisKeys(cfg.infra.namespace).gate_prefix, eta=ETA,
                          batch_size=cfg.batch_trajectories).counters()
    finally:
        r.close()
    return c.accepted + c.running <= (ETA + c.version + 1) * cfg.batch_trajectories


def test_faults_lose_nothing_and_train_nothing_twice(tmp_path: Path, tiny_model_dir: str) -> None:
    cfg = _build_config(tmp_path / "run", tiny_model_dir)
    Path(cfg.run_dir).mkdir(parents=True)
    _write_manifest(cfg)
    mesh = start_mesh(cfg)
    try:
        cfg = mesh.cfg
        for name in ("rollout", "environment", "grader", "store", "learner"):
            _supervise_until(mesh, lambda: _steps(cfg) >= 2)
            before = _steps(cfg)
            _kill(mesh, name)
            _supervise_until(mesh, lambda b=before: _steps(cfg) >= b + 2)
            assert _gate_bound_holds(cfg), f"gate bound broken after killing {name}"
        for server in (mesh.nats, mesh.redis):
            assert server is not None
            before = _steps(cfg)
            server.kill()
            server.restart()
            _supervise_until(mesh, lambda b=before: _steps(cfg) >= b + 2)
            assert _gate_bound_holds(cfg)
        learner = next(p for p in mesh.procs if p.name == "learner")
        _supervise_until(mesh, lambda: learner.popen.poll() == 0, timeout_s=400)
        assert drain(cfg) == 0
        mesh.stop_services()
        acct = accounting(cfg)
    finally:
        mesh.stop_services()
        mesh.stop_infra()

    check_archive(cfg, acct, ETA)

    _assert_replay_is_bitwise(cfg)


def _assert_replay_is_bitwise(cfg: RunConfig) -> None:
    """An uninterrupted learner fed the run's batches in order ends with the run's final weights."""
    from trajmesh.services.learner import LearnerService

    from trajmesh.contract import Trajectory
    from trajmesh.v1 import services_pb2

    torch.set_num_threads(1)  # the services run with one thread: same reduction order
    run_dir = Path(cfg.run_dir)
    replay = LearnerService(cfg)
    replay._build_trainer()
    replay.version, replay.steps_done, replay.trajectories_trained = 0, 0, 0
    temperature = cfg.tasks.sampling.temperature or 1.0
    for path in sorted((run_dir / "learner_batches").glob("step-*.pb")):
        resp = services_pb2.NextBatchResponse.FromString(path.read_bytes())
        replay._train_step([Trajectory(pb) for pb in resp.trajectories], cfg.effective_eta, temperature)
    assert replay.steps_done == STEPS
    final = sorted((run_dir / "weights").glob(f"v{STEPS:06d}-*"))[-1]
    saved = load_file(str(final / "model.safetensors"))
    mine = replay.engine.full_state_dict()
    for name, tensor in saved.items():
        assert torch.equal(tensor, mine[name]), f"{name} differs from the uninterrupted replay"
