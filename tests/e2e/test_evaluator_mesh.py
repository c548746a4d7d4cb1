"""The evaluator service in the mesh: real processes, real NATS JetStream and Redis.

One short run with `eval.in_mesh` (the evaluator process and its own torch engine beside the five
services), starting from the shipped demo policy (it solves some chain_sum problems, so a worse
policy scores measurably lower). The evaluator starts once the learner has announced a version.
Checks: it evaluates the base model first ("before", version 0), publishes one record per
evaluated version with figures per source on EVAL and in metrics.jsonl, and exports them as
gauges per source; a
worse policy's weights published mid-run (re-initialized, announced as a new version) are
evaluated and the learner stops on the confirmed regression with stop_reason.json; eval traffic
never enters the store's accounting (every admitted trajectory has exactly one final outcome, and
nothing else has one); the evaluator loads only the versions it evaluates; the store's draws
follow the two sources' mixture weights (1:1) within a stated bound.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import shutil
import signal
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path

import pytest
from mesh_checks import FINAL_OUTCOMES, store_draws, wait_stopped, write_manifest
from repo_paths import REPO

from trajmesh import bus as busmod
from trajmesh import security
from trajmesh.config import RunConfig, load_config
from trajmesh.run.launcher import SERVICE_ORDER, accounting, start_mesh
from trajmesh.run.run_end import end_run
from trajmesh.run.train import read_metrics, wait_final_eval
from trajmesh.services.store.archive import read_archive
from trajmesh.weights import announce

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(420)]

INJECTED_VERSION = 10_000
UNREACHABLE_STEPS = 100_000
"""A learner budget no test run reaches: only the regression on the injected version stops it."""
SOURCES = ("chain_sum", "chain_sum_b")
MIXTURE_BOUND, MIN_DRAWS = 0.1, 40
"""The two sources have weight 1 each: the store's draws split 1:1 within MIXTURE_BOUND once it has
drawn MIN_DRAWS tasks. (The seeded draw sequence of this config is off 1:1 by at most 0.084 over
its first N draws for any N >= 40, 0.042 for N >= 200; 20,000 draws: tests/unit/trajmesh/test_curriculum.py.)"""


def _demo_model() -> str:
    found = sorted(REPO.glob("examples/demo-start/*/sft/config.json"))
    assert found, "no shipped demo start under examples/demo-start"
    return str(found[0].parent)


def _config(run_dir: Path) -> RunConfig:
    return load_config(None, {
        "run_dir": str(run_dir), "model.path": _demo_model(), "gate.eta": 1,
        "tasks.sources": [{"type": "reasoning_gym"}, {"type": "reasoning_gym", "name": "chain_sum_b"}],
        "tasks.group_size": 4, "tasks.heldout_size": 16, "tasks.train_size": 300,
        "tasks.sampling.max_new_tokens": 6,
        "rollout.replicas": 1, "rollout.concurrent_tasks": 2, "grader.replicas": 1,
        # No budget the learner can reach under load before the injected version is evaluated: the
        # regression on it is what stops the run (the test's timeouts bound it).
        "learner.engine.type": "torch", "learner.batch_groups": 2, "learner.max_steps": UNREACHABLE_STEPS,
        "learner.max_seconds": 86_400, "learner.checkpoint_every": 50,
        # lr 1e-6: the trained policy barely moves, so only the injected worse one falls by the margin
        "learner.lr": 1e-6,
        "eval.in_mesh": True, "eval.every_versions": 2, "eval.samples": 2, "eval.samples_during": 1,
        "eval.noise_seeds": 0, "eval.selection_metric": "greedy",
        "eval.stop_regression_margin": 0.3, "eval.stop_confirmations": 1,
    })


def _worse_policy(model_dir: str, out: Path) -> Path:
    """The demo model's architecture and tokenizer with freshly initialized weights."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(1234)
    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(model_dir))
    model.save_pretrained(out)
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        if (Path(model_dir) / name).exists():
            shutil.copy(Path(model_dir) / name, out / name)
    return out


async def _announce(cfg: RunConfig, path: Path, version: int) -> None:
    bus = await security.connect_bus(cfg, "admin", name="test-injector")
    try:
        await announce.publish(bus, announce.announcement(version, path, ""))
    finally:
        await bus.close()


def inject_while_held(learner_pid: int, announce: Callable[[], None], evaluated: Callable[[], bool],
                      alive: Callable[[], bool], timeout_s: float = 180.0) -> None:
    """Announces the worse policy (`announce`) with the learner's process group held (SIGSTOP)
    until the evaluator has recorded its evaluation (`evaluated`). Held, the learner announces
    nothing (the evaluator keeps only the newest announcement while it evaluates: a learner version
    announced meanwhile replaced the injected one, which was then never loaded) and cannot finish
    its run (the injected version is evaluated "during" the run, never as its "after"). `alive`:
    the evaluator still runs."""
    os.killpg(learner_pid, signal.SIGSTOP)
    try:
        wait_stopped(learner_pid)
        announce()
        deadline = time.monotonic() + timeout_s
        while not evaluated():
            assert alive(), "the evaluator died before it evaluated the injected version"
            assert time.monotonic() < deadline, f"the injected version was not evaluated in {timeout_s:.0f} s"
            time.sleep(0.5)
    finally:
        os.killpg(learner_pid, signal.SIGCONT)


async def _eval_stream_messages(cfg: RunConfig) -> int:
    bus = await security.connect_bus(cfg, "admin", name="test-reader")
    try:
        return int((await bus.stream_info(busmod.STREAM_EVAL)).state.messages)
    finally:
        await bus.close()


def _evals(run_dir: Path) -> list[dict]:  # type: ignore[type-arg]
    return [r for r in read_metrics(run_dir) if r.get("kind") == "eval"]


def test_evaluator_records_per_source_and_a_regression_stops_the_learner(tmp_path: Path) -> None:
    cfg = _config(tmp_path / "run")
    run_dir = Path(cfg.run_dir)
    run_dir.mkdir(parents=True)
    write_manifest(cfg)
    bad = _worse_policy(cfg.model.path or "", tmp_path / "worse")
    mesh = start_mesh(cfg, services=tuple(s for s in SERVICE_ORDER if s != "evaluator"))
    try:
        cfg = mesh.cfg
        learner = next(p for p in mesh.procs if p.name == "learner")
        # The evaluator starts after the learner announced its first version (a slow engine start
        # or a restart does that): it still evaluates the base model first, as "before".
        deadline = time.monotonic() + 150
        while not [r for r in read_metrics(run_dir) if r.get("kind") == "learner_step"]:
            assert time.monotonic() < deadline and not mesh.dead(), \
                [(p.label, p.log_path.read_text()[-2000:]) for p in mesh.dead()]
            time.sleep(0.5)
        evaluator = mesh.start_service("evaluator", 0)
        mesh.wait_healthy([evaluator])
        deadline = time.monotonic() + 150
        while len({r["version"] for r in _evals(run_dir)}) < 2:
            assert time.monotonic() < deadline, evaluator.log_path.read_text()[-3000:]
            assert not mesh.dead(), [(p.label, p.log_path.read_text()[-2000:]) for p in mesh.dead()]
            time.sleep(0.5)
        with urllib.request.urlopen(f"http://127.0.0.1:{evaluator.metrics_port}/metrics", timeout=5) as resp:
            exported = resp.read().decode()
        inject_while_held(learner.popen.pid, lambda: asyncio.run(_announce(cfg, bad, INJECTED_VERSION)),
                          lambda: any(r["version"] == INJECTED_VERSION for r in _evals(run_dir)),
                          lambda: evaluator.popen.poll() is None)
        assert learner.popen.wait(timeout=180) == 0, learner.log_path.read_text()[-3000:]
        assert wait_final_eval(mesh, timeout_s=120) is not None, evaluator.log_path.read_text()[-3000:]
        assert end_run(mesh) == 0
        acct = accounting(cfg)
        on_stream = asyncio.run(_eval_stream_messages(cfg))
        assert evaluator.popen.returncode == 0, evaluator.log_path.read_text()[-3000:]  # stopped by end_run
        loaded = {int(v) for v in re.findall(r"loaded weights v(\d+)", evaluator.log_path.read_text())}
    finally:
        mesh.stop_services()
        mesh.stop_infra()

    evals = _evals(run_dir)
    first = evals[0]
    assert first["phase"] == "before" and first["version"] == 0
    assert first["heldout"]["chain_sum"]["greedy_accuracy"] > 0.1, first  # the shipped policy solves some
    for r in evals:
        assert sorted(r["heldout"]) == sorted(SOURCES)
        for name in SOURCES:
            fig = r["heldout"][name]
            assert fig["n_tasks"] == 16 and 0.0 <= fig["greedy_accuracy"] <= 1.0
            assert "sampled_pass_at_1" in fig
    assert len({r["version"] for r in evals if r["version"] != INJECTED_VERSION}) >= 2
    for name in SOURCES:
        assert f'trajmesh_evaluator_heldout_accuracy_ratio{{mode="greedy",source="{name}"}}' in exported
    # The evaluator loads only the versions it evaluates (of the learner's every version).
    assert loaded and loaded <= {r["version"] for r in evals}, (sorted(loaded), [r["version"] for r in evals])
    # One record per evaluated version (and phase) on EVAL, the same ones as in metrics.jsonl.
    assert on_stream == len(evals) == len({(r["version"], r["phase"]) for r in evals})

    # The worse policy was evaluated and the learner stopped on it; the last version got its record.
    injected = next(r for r in evals if r["version"] == INJECTED_VERSION)
    assert injected["phase"] == "during"
    assert injected["score"] < first["score"] - 0.1
    stop = json.loads((run_dir / "stop_reason.json").read_text())
    assert stop["reason"] == "heldout_regression" and stop["evaluated_version"] == INJECTED_VERSION
    assert stop["best"]["score"] >= first["score"]
    steps = [m for m in read_metrics(run_dir) if m.get("kind") == "learner_step"]
    assert steps and steps[-1]["version"] < INJECTED_VERSION
    # The last record is the newest announced version's: the learner's last one, or the injected one
    # when the learner stopped before it announced another.
    assert evals[-1]["phase"] == "after" and evals[-1]["version"] in (steps[-1]["version"], INJECTED_VERSION)

    # The mixture: the sources' shares of the store's draws (from the archive) are their weights'.
    drawn = store_draws(read_archive(run_dir / "archive").to_pylist())
    assert len(drawn) >= MIN_DRAWS, len(drawn)
    for name in SOURCES:
        share = sum(source == name for source in drawn.values()) / len(drawn)
        assert abs(share - 1 / len(SOURCES)) <= MIXTURE_BOUND, (name, share, len(drawn))

    # Eval traffic is not in the accounting: admitted = the final outcomes, exactly.
    outcomes = acct["outcomes"]
    assert outcomes.get("accepted", 0) == 0, json.dumps(acct)
    assert acct["admitted"] > 0
    assert sum(outcomes.get(k, 0) for k in FINAL_OUTCOMES) == acct["admitted"], json.dumps(acct)
