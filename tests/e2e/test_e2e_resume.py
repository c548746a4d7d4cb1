"""Ctrl-C stops a `trajmesh train` run cleanly (no process left) and `--resume` continues it:
the version keeps counting from the checkpoint, and the run reaches its step budget.

Both runs have stdout a pipe, as in CI, `make demo > log` or a pod: what a person watching the log
sees is checked on them too: plain progress lines as the run goes (not a table at the end), and no
library progress bar in the services' logs (transformers' "Loading weights" at each weight load of
the torch engine)."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml
from mesh_checks import pids_of, signal_pending, wait_stopped

from trajmesh.run.train import progress_line, read_metrics

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(600)]

STEPS = 10
"""The run's budget. The learner is held (SIGSTOP) from its third step until the launcher's SIGTERM
is pending for it, so the interrupt always lands mid-run however loaded the machine is."""
PROGRESS = re.compile(r"^progress step=(\S+) version=(\S+) reward=(\S+) heldout=(\S+) lag=(\S+) ess=(\S+) "
                      r"traj/s=(\S+) elapsed=(\d+)s$")
"""A progress line of `trajmesh train` (trajmesh/run/train.py `progress_line`)."""


def _learner_steps(run_dir: Path) -> list[dict]:
    return [r for r in read_metrics(run_dir) if r.get("kind") == "learner_step"]


def _leftover(pattern: str) -> list[str]:
    res = subprocess.run(["pgrep", "-af", pattern], capture_output=True, text=True)
    return [line for line in res.stdout.splitlines() if "pgrep" not in line]


def _sigterm_pending(pid: int, run_dir: Path) -> bool:
    """The held learner's SIGTERM is pending; a learner that is gone (it had died before it was
    held, and the launcher reaped it) fails the test with its log."""
    try:
        return signal_pending(pid, signal.SIGTERM)
    except FileNotFoundError:
        logs = sorted((run_dir / "logs").glob("learner-*.log"))
        tail = logs[0].read_text()[-3000:] if logs else "(no learner log)"
        raise AssertionError(f"learner pid {pid} is gone while held; its log:\n{tail}") from None


def _write_config(tmp_path: Path, model_dir: str) -> Path:
    cfg = {
        "run_dir": str(tmp_path / "run"), "model": {"path": model_dir}, "gate": {"eta": 1},
        "tasks": {"group_size": 4, "heldout_size": 8, "train_size": 300, "sampling": {"max_new_tokens": 6}},
        "rollout": {"replicas": 1, "concurrent_tasks": 2}, "grader": {"replicas": 1},
        "store": {"drop_zero_variance_groups": False},
        "learner": {"engine": {"type": "torch"}, "batch_groups": 2, "max_steps": STEPS, "checkpoint_every": 2},
        # The launcher's evaluation (--eval-every 0: before and after only), as small as it goes:
        # this test checks the stop and the resume, not the figures.
        "eval": {"in_mesh": False, "samples": 1, "noise_seeds": 0},
    }
    path = tmp_path / "cfg.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def test_progress_line_names_every_figure() -> None:
    steps = [{"step": 4, "version": 4, "reward_mean": 0.25, "max_token_lag": 1, "trajectories_trained": 8,
              "trajmesh_learner_effective_sample_size_ratio": 0.9}]
    evals = [{"heldout": {"chain_sum": {"greedy_accuracy": 0.5, "sampled_accuracy": 0.375},
                          "search": {"greedy_accuracy": 0.0, "sampled_accuracy": 0.125}}}]
    m = PROGRESS.match(progress_line(steps, evals, started=0.0))
    assert m, progress_line(steps, evals, started=0.0)
    assert m.groups()[:6] == ("4", "4", "0.250", "chain_sum:0.50/0.38,search:0.00/0.12", "1", "0.900")
    empty = PROGRESS.match(progress_line([], [], started=0.0))
    assert empty and empty.groups()[:6] == ("-",) * 6  # nothing known yet


def _check_the_log_a_person_sees(stdout: str, run_dir: Path) -> None:
    """Progress lines during the run (more than one: not only at its end), the last at the budget
    with the held-out figure per source; the services' logs have no progress bar."""
    progress = [m for line in stdout.splitlines() if (m := PROGRESS.match(line))]
    assert len(progress) >= 2, stdout[-3000:]
    assert progress[-1].group(1) == str(STEPS) and progress[-1].group(2) == str(STEPS), progress[-1].group(0)
    assert progress[-1].group(4).startswith("chain_sum:")  # the held-out figure before RL, per source
    logs = {p.name: p.read_text(errors="replace") for p in (run_dir / "logs").glob("*.log")}
    assert "loaded weights v" in logs["rollout-0.log"]  # the engine loaded new weights during the run
    assert "engine-0.log" in logs
    barred = [name for name, text in logs.items() if "Loading weights" in text or "it/s]" in text]
    assert barred == [], {name: logs[name][-2000:] for name in barred}


def test_ctrl_c_then_resume(tmp_path: Path, tiny_model_dir: str, monkeypatch: pytest.MonkeyPatch) -> None:
    cfg_path = _write_config(tmp_path, tiny_model_dir)
    run_dir = tmp_path / "run"
    cmd = [sys.executable, "-m", "trajmesh.run.cli", "train", str(cfg_path), "--eval-every", "0"]
    monkeypatch.setenv("TRAJMESH_PROGRESS_EVERY_S", "1")
    for name in ("HF_HUB_DISABLE_PROGRESS_BARS", "TQDM_DISABLE"):
        monkeypatch.delenv(name, raising=False)  # whatever the caller's shell says, the services turn the bars off
    # SIGINT at its default in the run: a test process started in the background of a
    # non-interactive shell (`cmd &`, as CI harnesses do) inherits SIGINT ignored, and so would
    # `trajmesh train`, which then trained its whole budget through the interrupt.
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    deadline = time.monotonic() + 240
    while len(_learner_steps(run_dir)) < 3:
        assert proc.poll() is None, proc.stdout.read().decode() if proc.stdout else ""
        assert time.monotonic() < deadline, "no learner progress"
        time.sleep(0.3)
    # Hold the learner where it is, interrupt the run, and let the learner go only once the
    # launcher's SIGTERM is pending for it: it cannot train on between the SIGINT and its stop.
    learners = pids_of("trajmesh.run.cli serve learner", str(run_dir))
    assert len(learners) == 1, learners
    os.kill(learners[0], signal.SIGSTOP)
    try:
        wait_stopped(learners[0])  # else a SIGTERM sent meanwhile is handled, never pending
        held_at = _learner_steps(run_dir)[-1]["step"]
        assert held_at < STEPS, held_at
        proc.send_signal(signal.SIGINT)
        while not _sigterm_pending(learners[0], run_dir):
            assert proc.poll() is None, proc.stdout.read().decode() if proc.stdout else ""
            assert time.monotonic() < deadline, "the launcher never sent the learner SIGTERM"
            time.sleep(0.05)
    finally:
        os.kill(learners[0], signal.SIGCONT)
    out = proc.communicate(timeout=180)[0].decode()
    assert proc.returncode == 130, out[-3000:]
    assert "--resume" in out
    assert _leftover(str(run_dir)) == [], "a service or server outlived Ctrl-C"
    assert (run_dir / "checkpoints" / "latest").exists()
    steps_before = _learner_steps(run_dir)
    assert steps_before[-1]["step"] < STEPS

    # Without --resume the existing run dir is refused with the fix in the message.
    refused = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert refused.returncode == 2 and "--resume" in refused.stderr

    done = subprocess.run([*cmd, "--resume"], capture_output=True, text=True, timeout=400)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    steps = _learner_steps(run_dir)
    versions = [s["version"] for s in steps]
    assert versions == sorted(versions) and len(set(versions)) == len(versions), versions
    assert versions[-1] == STEPS
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["rl_steps"] == STEPS and summary["final_version"] == STEPS
    _check_the_log_a_person_sees(done.stdout, run_dir)
    assert _leftover(str(run_dir)) == []
