"""The mesh with ``weights.sync: delta``: the learner publishes anchors and deltas, each rollout
rebuilds every version on its local disk and its torch engine loads that copy. Checked: every load
after the base model is a local rebuild, the engine-consistency probe finds the engines' log-probs
equal to the learner's on every probed version (weights bitwise equal), delta versions hold no full
file, and each engine's last copy is byte for byte the full export of the learner's final weights
(from its checkpoint, through the ``weights.sync: full`` export)."""

from __future__ import annotations

import hashlib
import re
import time
import urllib.request
from pathlib import Path

import pytest
import torch
from mesh_checks import write_manifest
from transformers import AutoModelForCausalLM

from trajmesh.config import load_config
from trajmesh.learner import consistency
from trajmesh.learner.logprobs import PolicyLogprobs
from trajmesh.learner.weights import export_policy
from trajmesh.run.launcher import Proc, start_mesh
from trajmesh.run.run_end import end_run
from trajmesh.run.train import read_metrics
from trajmesh.weights.delta import DELTA_NAME, SAFETENSORS_NAME

pytestmark = [pytest.mark.e2e, pytest.mark.slow, pytest.mark.timeout(300)]

STEPS = 4


def _loaded_version(proc: Proc) -> int:
    """trajmesh_rollout_policy_version from the process's /metrics (-1 before it answers)."""
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{proc.metrics_port}/metrics", timeout=5) as resp:
            text = resp.read().decode()
    except OSError:
        return -1
    m = re.search(r"^trajmesh_rollout_policy_version (\S+)$", text, re.M)
    return int(float(m.group(1))) if m else -1


def _wait_loaded(proc: Proc, version: int, deadline_s: float = 60.0) -> None:
    """Until the rollout's engine holds `version` (no event crosses the process boundary)."""
    deadline = time.monotonic() + deadline_s
    while _loaded_version(proc) != version:
        assert time.monotonic() < deadline, f"{proc.label} never loaded v{version}: {proc.log_path.read_text()[-2000:]}"
        time.sleep(0.2)


def test_mesh_with_delta_sync_loads_the_learners_weights_bitwise(tmp_path: Path, tiny_model_dir: str) -> None:
    local = tmp_path / "local"
    cfg = load_config(None, {
        "run_dir": str(tmp_path / "run"), "model.path": tiny_model_dir, "gate.eta": 1,
        "tasks.group_size": 4, "tasks.heldout_size": 20, "tasks.train_size": 300,
        "tasks.sampling.max_new_tokens": 6, "rollout.replicas": 2, "rollout.concurrent_tasks": 2,
        "grader.replicas": 1, "learner.engine.type": "torch", "learner.batch_groups": 2,
        "learner.max_steps": STEPS, "learner.lr": 1e-5, "learner.checkpoint_every": 100,
        "weights.sync": "delta", "weights.anchor_every": 3, "weights.local_dir": str(local)})
    Path(cfg.run_dir).mkdir(parents=True)
    write_manifest(cfg)
    mesh = start_mesh(cfg)
    try:
        learner = next(p for p in mesh.procs if p.name == "learner")
        rollouts = [p for p in mesh.procs if p.name == "rollout"]
        assert learner.popen.wait(timeout=240) == 0, learner.log_path.read_text()[-3000:]
        copies = {}
        for r in rollouts:  # each engine's copy of the last version, before stop deletes it
            _wait_loaded(r, STEPS)
            last = [m.group(1) for m in re.finditer(rf"loaded weights v{STEPS} from (\S+)", r.log_path.read_text())]
            copies[r.label] = hashlib.sha256((Path(last[-1]) / SAFETENSORS_NAME).read_bytes()).hexdigest()
        assert end_run(mesh) == 0
    finally:
        mesh.stop_services()
        mesh.stop_infra()
    run_dir = Path(cfg.run_dir)
    for r in rollouts:
        loads = re.findall(r"loaded weights v(\d+) from (\S+)", r.log_path.read_text())
        assert loads, f"{r.label} loaded no version"
        assert all(Path(path).parent.parent == local for v, path in loads if int(v) > 0), loads
    deltas = [d for d in (run_dir / "weights").glob("v*") if not (d / SAFETENSORS_NAME).exists()]
    assert deltas and all((d / DELTA_NAME).is_file() for d in deltas)
    steps = [m for m in read_metrics(run_dir) if m.get("kind") == "learner_step"]
    probed = [m for m in steps if m.get(consistency.TOKENS, 0) > 0]
    assert any(m["version"] > 2 for m in probed), steps  # a version the engines rebuilt from a delta
    assert all(m[consistency.MAX_ABS] < 1e-5 for m in probed), [m[consistency.MAX_ABS] for m in probed]
    # The learner's final weights, exported in full (weights.sync: full) from its checkpoint.
    payload = torch.load(run_dir / "checkpoints" / "latest" / "torch_engine.pt", map_location="cpu",
                         weights_only=False)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    PolicyLogprobs(model).load_state_dict(payload["model"])
    export_policy(model, tmp_path / "expected", dtype=torch.float32)
    expected = hashlib.sha256((tmp_path / "expected" / SAFETENSORS_NAME).read_bytes()).hexdigest()
    assert set(copies.values()) == {expected}, copies
