"""Ctrl-C during a long learner step: the step finishes, is reported and checkpointed, and nothing
is lost, however long the step is (a real model's step on a CPU takes minutes).

The learner's step is slowed on purpose (`learner.simulated_step`: 45 s, longer than the launcher's
30 s stop grace, which killed the learner mid-step before the stop followed the step's length). The
interrupt lands right after the learner logs that step 0 began (the event, read from its log)."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from trajmesh.run.inspect import inspect_run
from trajmesh.run.train import read_metrics
from trajmesh.service import STOP_NOTICE

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(600)]

STEP_S = 45.0


def test_ctrl_c_during_a_long_step_finishes_and_checkpoints_it(tmp_path: Path, tiny_model_dir: str) -> None:
    run_dir = tmp_path / "run"
    cfg = {
        "run_dir": str(run_dir), "model": {"path": tiny_model_dir}, "gate": {"eta": 1},
        "tasks": {"group_size": 4, "heldout_size": 8, "train_size": 200, "sampling": {"max_new_tokens": 6}},
        "rollout": {"replicas": 1, "concurrent_tasks": 2}, "grader": {"replicas": 1},
        "store": {"drop_zero_variance_groups": False},
        "learner": {"engine": {"type": "torch"}, "batch_groups": 2, "max_steps": 5, "checkpoint_every": 10,
                    "simulated_step": {"seconds_per_step": STEP_S}},
        "eval": {"in_mesh": False, "samples": 1, "noise_seeds": 0},
    }
    path = tmp_path / "cfg.yaml"
    path.write_text(yaml.safe_dump(cfg))
    proc = subprocess.Popen([sys.executable, "-m", "trajmesh.run.cli", "train", str(path), "--eval-every", "0"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    log = run_dir / "logs" / "learner-0.log"
    deadline = time.monotonic() + 300
    while not (log.exists() and "step 0: training on" in log.read_text(errors="replace")):
        assert proc.poll() is None, proc.stdout.read().decode() if proc.stdout else ""
        assert time.monotonic() < deadline, "the learner never began a step"
        time.sleep(0.2)
    interrupted = time.monotonic()
    proc.send_signal(signal.SIGINT)
    out = proc.communicate(timeout=300)[0].decode()
    took = time.monotonic() - interrupted
    assert proc.returncode == 130, out[-3000:]
    learner_log = log.read_text(errors="replace")
    assert "did not stop" not in out + learner_log, out[-3000:]
    notice = json.loads((run_dir / STOP_NOTICE).read_text())
    assert notice["in_step"] is True
    # the step ran to its end after the interrupt (not cut, not skipped), then the checkpoint
    assert took > STEP_S - 15, took
    steps = [r for r in read_metrics(run_dir) if r.get("kind") == "learner_step"]
    assert [s["step"] for s in steps] == [1], steps
    assert (run_dir / "checkpoints" / "latest").exists()
    # nothing lost: the step's batch is trained and reported; what was admitted but not trained
    # stays accepted in the store for `--resume` (tests/e2e/test_e2e_resume.py trains it to the end)
    info = inspect_run(str(run_dir))
    outcomes = info["outcomes"]
    assert outcomes.get("trained", 0) == 2 * 4, outcomes
    assert set(outcomes) <= {"trained", "accepted", "filtered", "quarantined", "failed_infra"}, info["by_reason"]
