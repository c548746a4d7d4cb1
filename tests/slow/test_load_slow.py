"""Sustained load (slow suite): 8 rollout processes with the synthetic engine feed the real mesh for
TRAJMESH_LOAD_SECONDS (default 1200 s = 20 min). Every 10 s it samples, per service process, the
resident memory, open file descriptors and child processes, and the JetStream backlogs; the curve
is written to RUN_DIR/load_curve.jsonl. Bounded means: after warm-up, no process's memory grows by
more than 50 % + 64 MiB, fds by more than 32, children never grow, and the queues stay under the
gate's bound.
"""

from __future__ import annotations

import asyncio
import json
import os
import time
from pathlib import Path

import pytest

from trajmesh import bus as busmod
from trajmesh.config import load_config
from trajmesh.run.launcher import Mesh, start_mesh
from trajmesh.run.train import _write_manifest
from trajmesh.security import connect_bus

pytestmark = [pytest.mark.slow, pytest.mark.e2e, pytest.mark.timeout(4 * 3600)]

SECONDS = float(os.environ.get("TRAJMESH_LOAD_SECONDS", "1200"))
SAMPLE_S = 10.0


def _proc_stats(pid: int) -> dict[str, int]:
    status = Path(f"/proc/{pid}/status").read_text()
    rss_kb = int(next(line.split()[1] for line in status.splitlines() if line.startswith("VmRSS:")))
    fds = len(os.listdir(f"/proc/{pid}/fd"))
    children = len(Path(f"/proc/{pid}/task/{pid}/children").read_text().split())
    return {"rss_bytes": rss_kb * 1024, "fds": fds, "children": children}


async def _backlogs(cfg) -> dict[str, int]:  # type: ignore[no-untyped-def]
    bus = await connect_bus(cfg, "admin", name="load-probe")
    try:
        out = {}
        for stream, durable in ((busmod.STREAM_TASKS, "rollout"), (busmod.STREAM_TRAJ_RAW, "grader"),
                                (busmod.STREAM_TRAJ_GRADED, "store")):
            out[stream] = (await bus.pending(stream, durable)).backlog
        return out
    finally:
        await bus.close()


def test_sustained_load_stays_bounded(tmp_path: Path, tiny_model_dir: str) -> None:
    cfg = load_config(None, {
        "run_dir": str(tmp_path / "run"), "model.path": tiny_model_dir, "gate.eta": 2,
        "tasks.group_size": 4, "tasks.heldout_size": 20, "tasks.train_size": 2000,
        "tasks.sampling.max_new_tokens": 16, "rollout.engine.type": "synthetic",
        "rollout.replicas": 8, "rollout.concurrent_tasks": 2, "grader.replicas": 2,
        "store.drop_zero_variance_groups": False, "learner.engine.type": "torch",
        "learner.batch_groups": 4, "learner.max_steps": 10**9, "learner.max_seconds": SECONDS + 60,
        "learner.checkpoint_every": 50,
    })
    Path(cfg.run_dir).mkdir(parents=True)
    _write_manifest(cfg)
    mesh: Mesh = start_mesh(cfg)
    curve = []
    try:
        start = time.monotonic()
        while time.monotonic() - start < SECONDS:
            time.sleep(SAMPLE_S)
            assert not mesh.dead(), [p.label for p in mesh.dead()]
            sample = {"t": round(time.monotonic() - start, 1),
                      "procs": {p.label: _proc_stats(p.popen.pid) for p in mesh.procs},
                      "backlog": asyncio.run(_backlogs(mesh.cfg))}
            curve.append(sample)
        (Path(cfg.run_dir) / "load_curve.jsonl").write_text("".join(json.dumps(s) + "\n" for s in curve))
    finally:
        mesh.stop_services()
        mesh.stop_infra()

    warm = curve[len(curve) // 4]
    bound = (cfg.effective_eta + 2) * cfg.batch_trajectories * 4  # generous: far below "unbounded"
    for s in curve[len(curve) // 4:]:
        for label, st in s["procs"].items():
            w = warm["procs"][label]
            assert st["rss_bytes"] <= 1.5 * w["rss_bytes"] + 64 * 2**20, (label, s["t"], st, w)
            assert st["fds"] <= w["fds"] + 32, (label, s["t"], st, w)
            assert st["children"] <= w["children"], (label, s["t"], st, w)
        assert all(v <= bound for v in s["backlog"].values()), s["backlog"]
