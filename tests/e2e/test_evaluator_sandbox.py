"""Held-out evaluation plays through the services: a sandbox failure in the evaluator's episodes is
an infra failure in the eval record, never a wrong answer.

One short mesh run (real NATS JetStream, Redis, every service a process) of a math_tool source
with the evaluator (`eval.in_mesh`). The policy is a tiny ChatML model fine-tuned to open every
answer with a native ``python`` tool call (as in tests/e2e/test_e2e_envs.py), so its episodes reach
the sandbox. The environment service runs with the test-only knob
`environment.inject_sandbox_failure: evaluation`: every tool run of an episode whose task has
`evaluation` set fails its sandbox setup there, as a pod without the sandbox's security context
would; training episodes run the real sandbox.

Checks: every infra failure the eval records report is a sandbox setup failure the environment
service counted (its own metric; the evaluator process never ran the tool), every held-out episode
the evaluator played is in its record as graded or infra failure, an accuracy is over the graded
episodes only (None where the whole pass failed), and the training trajectories in the archive
were not touched by the knob.
"""

from __future__ import annotations

import re
import urllib.request
from pathlib import Path
from typing import Any

import pytest
from mesh_checks import write_manifest

from trajmesh.config import load_config
from trajmesh.run.launcher import start_mesh
from trajmesh.run.run_end import end_run
from trajmesh.run.train import read_metrics, wait_final_eval
from trajmesh.services.store.archive import read_archive
from trajmesh.tasks import load_split
from trajmesh.tool_calls import ToolCall, render_tool_calls

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(600)]

SOURCE = {"type": "math_tool", "max_tool_calls": 2, "call_timeout_s": 3.0, "tool_format": "native"}
FIRST_ACTION = render_tool_calls([ToolCall("call_0", "python", {"code": "print(1)"})])
HELDOUT, SAMPLES = 4, 2


def _build_tool_model(root: Path) -> str:
    """A tiny ChatML model that answers a math_tool prompt with the canned python call."""
    from chatml_model import build_chatml_model

    from trajmesh.learner.models import sft
    from trajmesh.rollout.agents.chat_format import ChatFormat

    cfg = load_config(None, {"tasks.sources": [SOURCE]})
    train = load_split(cfg.tasks.sources[0], 30, 5)[0]
    build_chatml_model(root / "init", [t.prompt for t in train] + [FIRST_ACTION] * 30, max_positions=1024)
    chat = ChatFormat.load(root / "init")
    assert chat is not None
    sft(root / "init", [{"prompt": chat.prompt(t.prompt), "answer": FIRST_ACTION} for t in train],
        steps=120, batch_size=16, lr=1e-2, out_dir=root / "sft", warmup_steps=5)
    return str(root / "sft")


def _metric(port: int, name: str, labels: dict[str, str]) -> float:
    """One sample of a service's /metrics (0 when the series is absent)."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as resp:
        text = resp.read().decode()
    for line in text.splitlines():
        m = re.match(rf"{name}{{(.*)}} (\S+)$", line)
        if m and all(f'{k}="{v}"' in m.group(1) for k, v in labels.items()):
            return float(m.group(2))
    return 0.0


def test_sandbox_failure_in_evaluation_is_an_infra_failure(tmp_path: Path) -> None:
    model = _build_tool_model(tmp_path / "model")
    cfg = load_config(None, {
        "run_dir": str(tmp_path / "run"), "model.path": model, "gate.eta": 1,
        "tasks.sources": [SOURCE], "tasks.group_size": 2, "tasks.train_size": 20, "tasks.heldout_size": HELDOUT,
        "tasks.sampling.max_new_tokens": 56, "tasks.sampling.max_turns": 2, "tasks.sampling.temperature": 0.25,
        "rollout.replicas": 1, "rollout.concurrent_tasks": 2, "grader.replicas": 1,
        "store.drop_zero_variance_groups": False,
        "learner.engine.type": "torch", "learner.batch_groups": 2, "learner.max_steps": 2,
        "learner.checkpoint_every": 2,
        "eval.in_mesh": True, "eval.every_versions": 100, "eval.samples": SAMPLES, "eval.samples_during": 1,
        "eval.noise_seeds": 0, "eval.temperature": 0.25,
        "environment.inject_sandbox_failure": "evaluation",
        "sandbox.allow_without_cgroup": True,
    })
    Path(cfg.run_dir).mkdir(parents=True)
    write_manifest(cfg)
    mesh = start_mesh(cfg)
    try:
        learner = next(p for p in mesh.procs if p.name == "learner")
        assert learner.popen.wait(timeout=400) == 0, learner.log_path.read_text()[-3000:]
        evaluator = next(p for p in mesh.procs if p.name == "evaluator")
        assert wait_final_eval(mesh, timeout_s=180) is not None, evaluator.log_path.read_text()[-3000:]
        environment = next(p for p in mesh.procs if p.name == "environment")
        injected = _metric(environment.metrics_port, "trajmesh_environment_sandbox_violations_total",
                           {"environment": "math_tool", "subclass": "setup"})
        played = {r: _metric(evaluator.metrics_port, "trajmesh_evaluator_heldout_trajectories_total", {"result": r})
                  for r in ("graded", "infra_failure")}
        assert end_run(mesh) == 0
    finally:
        mesh.stop_services()
        mesh.stop_infra()

    evals = [r for r in read_metrics(Path(cfg.run_dir)) if r.get("kind") == "eval"]
    assert evals and evals[0]["phase"] == "before" and evals[-1]["phase"] == "after", evals
    figures: list[dict[str, Any]] = [r["heldout"]["math_tool"] for r in evals]
    infra = sum(f["greedy_infra_failures"] + f["sampled_infra_failures"] for f in figures)
    # The policy calls its tool: the injected sandbox failures happened, in the environment
    # service, and each one is an infra failure in the records (and nothing else is).
    assert infra > 0, figures
    assert injected == infra, (injected, figures)
    assert played["infra_failure"] == infra, (played, figures)
    # Every episode the evaluator played is in a record: per evaluation a greedy pass of one sample
    # and a sampled pass of SAMPLES per task.
    assert played["graded"] + played["infra_failure"] == len(evals) * HELDOUT * (1 + SAMPLES), (played, len(evals))
    for f in figures:
        for mode, n in (("greedy", HELDOUT), ("sampled", HELDOUT * SAMPLES)):
            if f[f"{mode}_infra_failures"] == n:  # nothing graded: no accuracy, not 0
                assert f[f"{mode}_accuracy"] is None, f
            else:
                assert 0.0 <= f[f"{mode}_accuracy"] <= 1.0, f
    # Training episodes ran the real sandbox: no trajectory of the run failed its setup.
    archive = read_archive(Path(cfg.run_dir) / "archive").to_pylist()
    assert [r for r in archive if r["outcome"] == "accepted"], "nothing trained"
    assert not [r for r in archive if r.get("terminal_reason") == "INFRA_FAILURE"], "training episodes were injected"
