"""What a person watching a run in a log sees: `trajmesh train` with stdout a pipe (CI, `make demo >
log`, a pod) prints plain progress lines as the run goes, not a table at the end, and the services'
logs hold no library progress bars (transformers' "Loading weights" at each weight load of the torch
engine), on a real local run of the tiny model."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from trajmesh.run.train import progress_line

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(600)]

STEPS = 3
LINE = re.compile(r"^progress step=(\S+) version=(\S+) reward=(\S+) heldout=(\S+) lag=(\S+) ess=(\S+) "
                  r"traj/s=(\S+) elapsed=(\d+)s$")


def test_progress_line_names_every_figure() -> None:
    steps = [{"step": 4, "version": 4, "reward_mean": 0.25, "max_token_lag": 1, "trajectories_trained": 8,
              "trajmesh_learner_effective_sample_size_ratio": 0.9}]
    evals = [{"heldout": {"chain_sum": {"greedy_accuracy": 0.5, "sampled_accuracy": 0.375},
                          "search": {"greedy_accuracy": 0.0, "sampled_accuracy": 0.125}}}]
    m = LINE.match(progress_line(steps, evals, started=0.0))
    assert m, progress_line(steps, evals, started=0.0)
    assert m.groups()[:6] == ("4", "4", "0.250", "chain_sum:0.50/0.38,search:0.00/0.12", "1", "0.900")
    empty = LINE.match(progress_line([], [], started=0.0))
    assert empty and empty.groups()[:6] == ("-",) * 6  # nothing known yet


def test_a_run_with_stdout_a_pipe_prints_progress_lines_and_no_bars(tmp_path: Path, tiny_model_dir: str) -> None:
    run = tmp_path / "run"
    config = tmp_path / "run.yaml"
    config.write_text(yaml.safe_dump({
        "run_dir": str(run), "model": {"path": tiny_model_dir}, "gate": {"eta": 1},
        "tasks": {"group_size": 4, "heldout_size": 4, "train_size": 200, "sampling": {"max_new_tokens": 6}},
        "rollout": {"replicas": 1, "concurrent_tasks": 2}, "grader": {"replicas": 1},
        "learner": {"engine": {"type": "torch"}, "batch_groups": 2, "max_steps": STEPS},
        "eval": {"samples": 1, "noise_seeds": 0, "in_mesh": False}}))  # the launcher's evaluation: "before" first
    env = {**os.environ, "TRAJMESH_PROGRESS_EVERY_S": "1"}
    for name in ("HF_HUB_DISABLE_PROGRESS_BARS", "TQDM_DISABLE"):
        env.pop(name, None)  # whatever the caller's shell says, the services turn the bars off themselves
    proc = subprocess.Popen([sys.executable, "-m", "trajmesh.run.cli", "train", str(config), "--eval-every", "0"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    assert proc.stdout is not None
    lines = []
    for line in proc.stdout:  # read as it comes: the lines are printed during the run
        lines.append(line.rstrip("\n"))
    assert proc.wait(timeout=60) == 0, "\n".join(lines[-40:])
    progress = [m for line in lines if (m := LINE.match(line))]
    assert len(progress) >= 2, "\n".join(lines[-40:])  # during the run, not only at its end
    assert progress[-1].group(1) == str(STEPS) and progress[-1].group(2) == str(STEPS)
    assert progress[-1].group(4).startswith("chain_sum:")  # the held-out figure before RL, per source
    logs = {p.name: p.read_text(errors="replace") for p in (run / "logs").glob("*.log")}
    assert "loaded weights v" in logs["rollout-0.log"]  # the engine loaded new weights during the run
    assert "engine-0.log" in logs
    barred = [name for name, text in logs.items() if "Loading weights" in text or "it/s]" in text]
    assert barred == [], {name: logs[name][-2000:] for name in barred}
