"""The Helm chart run here: the CPU chart's workloads as local processes (tests/helm/local_kubelet.py)
training with exact accounting. The offline checks of the chart are tests/unit/deploy/test_helm_chart.py,
its pods' wiring run outside a mesh (vLLM's own parser, the grace periods) tests/unit/deploy/test_helm_pods.py."""

from __future__ import annotations

import asyncio
import json
import os
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml
from helm_chart import (
    HELM_TESTS,
    NAMESPACE,
    RELEASE,
    _component,
    _merged,
    _objects_of,
    _pod_spec,
    _values,
)


# ---------------------------------------------------------------- the chart, run as local processes
def _load_kubelet() -> Any:
    import importlib.util

    spec = importlib.util.spec_from_file_location("local_kubelet", HELM_TESTS / "local_kubelet.py")
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module



CHART_HELDOUT = 16

def _code_call(env_pod: Any, code: str = "print(6*7)") -> tuple[str, dict[str, Any]]:
    """A math-tool session on the environment pod's gRPC port: one sandboxed code call."""
    import grpc

    from trajmesh.v1 import services_pb2, services_pb2_grpc, trajectory_pb2

    port = next(env_pod.ports[int(p["containerPort"])] for p in env_pod.container_ports() if p.get("name") == "grpc")

    async def go() -> tuple[str, dict[str, Any]]:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = services_pb2_grpc.EnvironmentStub(channel)
            task = trajectory_pb2.Task(environment="math_tool", prompt="What is 6*7?", answer="42")
            await stub.Reset(services_pb2.ResetRequest(session_id="chart-code-call", task=task, seed=0), timeout=60)
            step = await stub.Step(services_pb2.StepRequest(session_id="chart-code-call",
                                                            action=f"<code>{code}</code>"), timeout=60)
            return step.observation, json.loads(step.info_json or "{}")

    return asyncio.run(go())


@pytest.mark.e2e
@pytest.mark.timeout(900)
def test_chart_runs_as_local_processes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The CPU chart's own workloads (commands, env, Secrets, ConfigMaps, volumes, ports) run as local
    processes (tests/helm/local_kubelet.py) and train with exact accounting; a sandboxed code call
    goes through the environment pod. A workload missing a mount, a variable or a port fails here
    (the store without the model volume did). The evaluator pod publishes held-out records per
    source; once it has two versions, the test announces a worse policy's weights (as
    tests/e2e/test_evaluator_mesh.py does) and the learner pod stops on the regression the evaluator
    measures, with stop_reason.json on the shared claim. Run as root, every trajmesh pod's processes
    run as the pod's securityContext says (uid 10001, fsGroup volumes, no capabilities,
    no_new_privs), so the code call runs the rootless sandbox as a pod would, in a cgroup the
    kubelet delegated to the pod (one cgroup per call in this host's mode); not root, that part is
    skipped."""
    import shutil
    import time

    from mesh_checks import check_archive, check_gate_reconciles
    from test_evaluator_mesh import (
        INJECTED_VERSION,
        UNREACHABLE_STEPS,
        _announce,
        _demo_model,
        _worse_policy,
        inject_while_held,
    )

    from trajmesh.config import RunConfig
    from trajmesh.infra import nats_server_binary, redis_server_binary
    from trajmesh.run.launcher import accounting
    from trajmesh.run.run_end import drain
    from trajmesh.run.train import read_metrics
    from trajmesh.sandbox import cgroups

    # The shipped demo policy (it solves some chain_sum problems, so a worse one scores measurably
    # lower); greedy on CHART_HELDOUT problems, a drop of more than 0.3 confirmed once stops the run.
    values = _merged(_values("cpu-only"), {
        "model": {"source": "pvc://trajmesh-models/demo"},
        "rollout": {"replicaCount": 1, "concurrentTasks": 2}, "environment": {"replicaCount": 1},
        "grader": {"replicaCount": 1}, "evaluator": {"enabled": True},
        "trajmesh": {"config": {
            "gate": {"eta": 1},
            "eval": {"every_versions": 1, "samples": 2, "samples_during": 1, "noise_seeds": 0,
                     "selection_metric": "greedy", "stop_regression_margin": 0.3, "stop_confirmations": 1,
                     "evaluator_nice": 0},  # a pod has CPUs of its own; here every pod shares this machine's
            "tasks": {"group_size": 2, "train_size": 300, "heldout_size": CHART_HELDOUT,
                      "sampling": {"max_new_tokens": 6}},
            # lr 1e-6: the trained policy barely moves, so only the injected worse one can fall 0.3
            # below the best (at the default lr a fast run once fell 9/16 -> 3/16 by version 7).
            "learner": {"batch_groups": 2, "max_steps": UNREACHABLE_STEPS, "checkpoint_every": 50,
                        "lr": 1e-6}}},
    })
    kubelet = _load_kubelet().LocalKubelet(_objects_of(values), tmp_path, NAMESPACE,
                                           {"nats": nats_server_binary(), "redis-server": redis_server_binary()})
    kubelet.setup()
    shutil.copytree(_demo_model(), tmp_path / "pvc" / "trajmesh-models" / "demo")
    shared = tmp_path / "pvc" / "trajmesh-shared"
    learner_run = shared / "run"  # the learner mounts the shared claim at /shared
    # Where the evaluator pod (uid 10001 as root) can read the worse policy: the shared claim.
    worse = _worse_policy(_demo_model(), shared / "worse")
    try:
        for component in ("nats", "redis"):
            kubelet.start(kubelet.pod(component))
        provision = kubelet.pod("provision")
        assert kubelet.run_to_completion(provision) == 0, kubelet.tail(provision)
        for component in ("environment", "store", "grader", "rollout", "evaluator", "learner"):
            kubelet.start(kubelet.pod(component), wait_ready_s=300, may_finish=component == "learner")
        env_pod = kubelet.pod("environment")
        seen_calls: set[str] = set()
        if kubelet.users_emulated and cgroups.detect().kind != "none":
            assert env_pod.cgroup is not None, "the kubelet delegated no cgroup to the environment pod"
            # The environment pod (uid 10001, in the cgroup the kubelet delegated to it) runs the
            # sandbox in this host's mode: the call's own cgroup appears under the pod's while the
            # call runs (the 1.5 s sleep is the call's length, not a synchronization).
            import concurrent.futures

            with concurrent.futures.ThreadPoolExecutor(1) as pool:
                call = pool.submit(_code_call, env_pod, "import time; time.sleep(1.5); print(6*7)")
                while not call.done():  # polls the call's state on the host
                    seen_calls.update(os.path.basename(p) for p in cgroups.leftovers(env_pod.cgroup))
                    time.sleep(0.01)
                observation, info = call.result()
            assert any(n.startswith(cgroups.CALL_PREFIX) for n in seen_calls), (env_pod.cgroup, seen_calls)
            assert not cgroups.leftovers(env_pod.cgroup), "the call's cgroup outlived the call"
        else:
            observation, info = _code_call(env_pod)
        assert "42" in observation and info["tool_call"]["status"] == "ok", (observation, info)
        assert not info["tool_call"].get("sandbox_error"), info  # not SANDBOX_ERROR
        users = {c: [kubelet.process_status(p) for p in kubelet.pod(c).procs]
                 for c in ("environment", "grader", "store", "rollout", "learner") if kubelet.pod(c).procs
                 and all(p.poll() is None for p in kubelet.pod(c).procs)}
        learner = kubelet.pod("learner")
        evaluator = kubelet.pod("evaluator")
        store = kubelet.pod("store")
        cfg = RunConfig.model_validate(yaml.safe_load(
            (tmp_path / "pods" / store.name / "volumes" / "runtime" / "config.yaml").read_text()))
        deadline = time.monotonic() + 300  # the evaluator's records of two versions
        while len({r["version"] for r in read_metrics(learner_run) if r.get("kind") == "eval"}) < 2:
            assert time.monotonic() < deadline and all(p.poll() is None for p in evaluator.procs), \
                kubelet.tail(evaluator)
            assert learner.procs[0].poll() is None, kubelet.tail(learner)
            time.sleep(0.5)
        # The regression: a worse policy's weights announced as a new version, as the chart's
        # admin user (the provisioning Job's credentials).
        monkeypatch.setenv("TRAJMESH_NATS_USER", "admin")
        monkeypatch.setenv("TRAJMESH_NATS_PASSWORD", kubelet.secrets[f"{RELEASE}-nats-auth"]["admin"])
        inject_while_held(learner.procs[0].pid, lambda: asyncio.run(_announce(cfg, worse, INJECTED_VERSION)),
                          lambda: any(r.get("kind") == "eval" and r["version"] == INJECTED_VERSION
                                      for r in read_metrics(learner_run)),
                          lambda: all(p.poll() is None for p in evaluator.procs), timeout_s=300)
        assert learner.procs[0].wait(timeout=600) == 0, kubelet.tail(learner)
        deadline = time.monotonic() + 300  # its record of the last version (it sees run_finished)
        while not [r for r in read_metrics(learner_run) if r.get("phase") == "after"]:
            assert time.monotonic() < deadline and all(p.poll() is None for p in evaluator.procs), \
                kubelet.tail(evaluator)
            time.sleep(0.5)
        drain(cfg)
        for component in ("rollout", "evaluator", "grader", "environment"):
            kubelet.stop(kubelet.pod(component))
        assert kubelet.stop(store, grace_s=120) == [0], kubelet.tail(store)
        acct = accounting(cfg)
        rows = check_archive(cfg, acct, eta=1)
        check_gate_reconciles(cfg, rows)
    finally:
        kubelet.stop_all()
    steps = [m for m in read_metrics(learner_run) if m.get("kind") == "learner_step"]
    assert steps and [m["version"] for m in steps] == list(range(1, len(steps) + 1))
    # The evaluator pod's records (on the shared claim beside the learner's): per source, >= 2 versions.
    evals = [m for m in read_metrics(learner_run) if m.get("kind") == "eval"]
    assert len({m["version"] for m in evals if m["version"] != INJECTED_VERSION}) >= 2, evals
    assert evals[0]["phase"] == "before" and evals[0]["version"] == 0, evals
    assert all(sorted(m["heldout"]) == ["chain_sum"] and m["heldout"]["chain_sum"]["n_tasks"] == CHART_HELDOUT
               for m in evals)
    # The worse policy was evaluated, and the learner pod stopped on that record.
    injected = next(m for m in evals if m["version"] == INJECTED_VERSION)
    assert injected["phase"] == "during" and injected["score"] < evals[0]["score"] - 0.3, (evals[0], injected)
    stop = json.loads((learner_run / "stop_reason.json").read_text())
    assert stop["reason"] == "heldout_regression" and stop["evaluated_version"] == INJECTED_VERSION, stop
    assert evals[-1]["phase"] == "after" and evals[-1]["version"] in (steps[-1]["version"], INJECTED_VERSION)
    if not kubelet.users_emulated:
        pytest.skip(f"the mesh trained as this test's user; the pods' uid part needs root: {kubelet.why_not_users}")
    # The pods ran as the chart's podSecurityContext says: the code call above ran as uid 10001 with
    # no capability and no_new_privs (allowPrivilegeEscalation: false), the sandbox in its rootless mode.
    sc = next(p for o in _objects_of(values) if _component(o) == "environment" and (p := _pod_spec(o)))["securityContext"]
    assert sc["runAsUser"] == 10001 and sc["fsGroup"] == 10001, sc
    assert "environment" in users and "grader" in users, sorted(users)
    for component, statuses in users.items():
        for st in statuses:
            assert st["Uid"].split() == ["10001"] * 4 and st["Gid"].split() == ["10001"] * 4, (component, st)
            assert st["CapEff"] == st["CapPrm"] == st["CapBnd"] == "0000000000000000", (component, st)
            assert st["NoNewPrivs"] == "1", (component, st)
    written = [p for p in learner_run.rglob("*") if p.is_file()]  # the learner wrote the shared claim as 10001
    assert written and {p.stat().st_uid for p in written} == {10001}


def _port(pod: Any, name: str) -> int:
    """The host port of a pod's named container port."""
    return int(next(pod.ports[int(p["containerPort"])] for p in pod.container_ports() if p.get("name") == name))


@pytest.mark.e2e
@pytest.mark.slow  # 104-128 s on the 2-core dev machine (make test-all); the mesh twin runs in make test
@pytest.mark.timeout(900)
def test_chart_evaluates_math_tool_through_the_environment_pod(tmp_path: Path) -> None:
    """The chart's evaluator pod evaluates a math_tool source through the environment and grader
    pods (tests/e2e/test_evaluator_sandbox.py as the chart's workloads, its NATS users included): with
    `environment.inject_sandbox_failure: evaluation` every tool run of a held-out episode fails its
    sandbox setup in the environment pod, and each shows in the evaluator pod's records as an infra
    failure, not as a wrong answer; training episodes run the environment pod's real sandbox."""
    import shutil
    import time

    from test_evaluator_sandbox import HELDOUT, SAMPLES, SOURCE, _build_tool_model, _metric

    from trajmesh.config import RunConfig
    from trajmesh.infra import nats_server_binary, redis_server_binary
    from trajmesh.run.run_end import drain
    from trajmesh.run.train import read_metrics
    from trajmesh.services.store.archive import read_archive

    values = _merged(_values("cpu-only"), {
        "model": {"source": "pvc://trajmesh-models/tool"},
        "rollout": {"replicaCount": 1, "concurrentTasks": 2}, "environment": {"replicaCount": 1},
        "grader": {"replicaCount": 1}, "evaluator": {"enabled": True},
        "trajmesh": {"config": {
            "gate": {"eta": 1},
            "eval": {"every_versions": 100, "samples": SAMPLES, "samples_during": 1, "noise_seeds": 0,
                     "temperature": 0.25, "evaluator_nice": 0},
            "tasks": {"sources": [SOURCE], "group_size": 2, "train_size": 20, "heldout_size": HELDOUT,
                      "sampling": {"max_new_tokens": 56, "max_turns": 2, "temperature": 0.25}},
            "store": {"drop_zero_variance_groups": False},
            "environment": {"inject_sandbox_failure": "evaluation"},
            "sandbox": {"allow_without_cgroup": True},
            "learner": {"batch_groups": 2, "max_steps": 2, "checkpoint_every": 2}}},
    })
    kubelet = _load_kubelet().LocalKubelet(_objects_of(values), tmp_path, NAMESPACE,
                                           {"nats": nats_server_binary(), "redis-server": redis_server_binary()})
    kubelet.setup()
    model = _build_tool_model(tmp_path / "model")
    shutil.copytree(model, tmp_path / "pvc" / "trajmesh-models" / "tool")
    learner_run = tmp_path / "pvc" / "trajmesh-shared" / "run"
    try:
        for component in ("nats", "redis"):
            kubelet.start(kubelet.pod(component))
        provision = kubelet.pod("provision")
        assert kubelet.run_to_completion(provision) == 0, kubelet.tail(provision)
        for component in ("environment", "store", "grader", "rollout", "evaluator", "learner"):
            kubelet.start(kubelet.pod(component), wait_ready_s=300, may_finish=component == "learner")
        learner, evaluator, store = kubelet.pod("learner"), kubelet.pod("evaluator"), kubelet.pod("store")
        cfg = RunConfig.model_validate(yaml.safe_load(
            (tmp_path / "pods" / store.name / "volumes" / "runtime" / "config.yaml").read_text()))
        assert learner.procs[0].wait(timeout=600) == 0, kubelet.tail(learner)
        deadline = time.monotonic() + 300  # its record of the last version (it sees run_finished)
        while not [r for r in read_metrics(learner_run) if r.get("phase") == "after"]:
            assert time.monotonic() < deadline and all(p.poll() is None for p in evaluator.procs), \
                kubelet.tail(evaluator)
            time.sleep(0.5)
        injected = _metric(_port(kubelet.pod("environment"), "metrics"), "trajmesh_environment_sandbox_violations_total",
                           {"environment": "math_tool", "subclass": "setup"})
        played = {r: _metric(_port(evaluator, "metrics"), "trajmesh_evaluator_heldout_trajectories_total",
                             {"result": r}) for r in ("graded", "infra_failure")}
        drain(cfg)
        for component in ("rollout", "evaluator", "grader", "environment"):
            kubelet.stop(kubelet.pod(component))
        assert kubelet.stop(store, grace_s=120) == [0], kubelet.tail(store)
    finally:
        kubelet.stop_all()
    evals = [m for m in read_metrics(learner_run) if m.get("kind") == "eval"]
    assert evals and evals[0]["phase"] == "before" and evals[-1]["phase"] == "after", evals
    figures = [r["heldout"]["math_tool"] for r in evals]
    infra = sum(f["greedy_infra_failures"] + f["sampled_infra_failures"] for f in figures)
    assert infra > 0 and injected == infra == played["infra_failure"], (injected, played, figures)
    assert played["graded"] + played["infra_failure"] == len(evals) * HELDOUT * (1 + SAMPLES), (played, len(evals))
    for f in figures:
        for mode, n in (("greedy", HELDOUT), ("sampled", HELDOUT * SAMPLES)):
            assert f[f"{mode}_accuracy"] is None if f[f"{mode}_infra_failures"] == n else f[f"{mode}_accuracy"] >= 0, f
    archive = read_archive(Path(cfg.run_dir) / "archive").to_pylist()  # the store pod's run dir
    assert [r for r in archive if r["outcome"] == "accepted"], "nothing trained"
    assert not [r for r in archive if r.get("terminal_reason") == "INFRA_FAILURE"], "training episodes were injected"


DELTA_TOL = 1e-4
"""Behavior log-probs (the rollout pod's torch engine, fp32 on CPU) against the learner's forward
on the same weights: two fp32 forwards of one model on one machine differ by float rounding only
(a few 1e-6 on the demo policy here); tests/unit/rollout/engines/test_engine_conformance.py holds
the torch engine to 1e-4 after a load too. Adjacent versions at the test's lr differ by far more."""


def _weights_loaded(log: Path, local_weights: Path) -> dict[int, str]:
    """Versions the rollout pod's log says its engine loaded, with the directory it loaded each
    from (services/rollout.py: "loaded weights vN from PATH"), those under `local_weights` only."""
    import re

    text = log.read_text() if log.exists() else ""
    found = re.findall(r"loaded weights v(\d+) from (\S+)", text)
    return {int(v): p for v, p in found if Path(p).is_relative_to(local_weights)}


def _recomputed(version_dir: Path, out: Path, rows: list[dict[str, Any]], temperature: float) -> list[list[float]]:
    """The learner's log-probs (tests/logprob_checks.py) of each row's sampled tokens under the
    full checkpoint of `version_dir` on the shared volume, rebuilt by the test from its anchor."""
    from logprob_checks import learner_logprobs

    from trajmesh.learner.models import load_model
    from trajmesh.weights.delta import is_delta_dir, reconstruct

    if is_delta_dir(version_dir):
        reconstruct(version_dir, out)  # from the nearest anchor: not the rollout's incremental path
        version_dir = out
    model, _ = load_model(version_dir)
    want = []
    for row in rows:
        start = row["loss_mask"].index(1)
        want.append(learner_logprobs(model, list(row["token_ids"][:start]), list(row["token_ids"][start:]),
                                     temperature))
    return want


@pytest.mark.e2e
@pytest.mark.timeout(900)
def test_chart_delta_sync_engine_loads_rebuilt_versions(tmp_path: Path) -> None:
    """The CPU chart with the delta-sync case's weights values (`weights.sync: delta`, the
    `rollout.localWeights` emptyDir): the learner pod publishes a full anchor, then deltas; the
    rollout pod rebuilds each version into its local-weights volume (trajmesh/weights/delta.py
    `LocalWeights`) and its torch engine loads it from there. Checks: at least two versions past
    v0 loaded from the mount (the rollout pod's log), none through the anchor fallback (its
    metrics), and per version, one trajectory the learner trained that the rollout sampled wholly
    at it has behavior log-probs equal (DELTA_TOL) to the learner's forward on that version's
    weights, rebuilt by the test from the shared volume, and measurably unlike the previous
    version's (so an engine left on older weights fails here)."""
    import shutil
    import time
    import urllib.request

    from test_evaluator_mesh import _demo_model

    from trajmesh.config import RunConfig
    from trajmesh.infra import nats_server_binary, redis_server_binary
    from trajmesh.run.run_end import drain
    from trajmesh.services.store.archive import read_archive
    from trajmesh.weights.layout import version_dirs, weights_root

    delta = _values("delta-sync")  # how the chart's delta-sync case turns it on
    values = _merged(_values("cpu-only"), {
        "model": {"source": "pvc://trajmesh-models/demo"},
        "rollout": {"replicaCount": 1, "concurrentTasks": 2, "localWeights": delta["rollout"]["localWeights"]},
        "environment": {"replicaCount": 1}, "grader": {"replicaCount": 1}, "evaluator": {"enabled": False},
        "trajmesh": {"config": {
            "weights": delta["trajmesh"]["config"]["weights"],  # sync delta, an anchor every 10 versions
            "gate": {"eta": 1},
            "tasks": {"group_size": 2, "train_size": 100, "heldout_size": 4, "sampling": {"max_new_tokens": 6}},
            # lr 1e-3 from the first step: adjacent versions' log-probs differ by far more than DELTA_TOL
            "learner": {"batch_groups": 2, "max_steps": 5, "checkpoint_every": 50, "lr": 1e-3,
                        "warmup_steps": 0}}},
    })
    assert values["trajmesh"]["config"]["weights"]["sync"] == "delta"
    kubelet = _load_kubelet().LocalKubelet(_objects_of(values), tmp_path, NAMESPACE,
                                           {"nats": nats_server_binary(), "redis-server": redis_server_binary()})
    kubelet.setup()
    shutil.copytree(_demo_model(), tmp_path / "pvc" / "trajmesh-models" / "demo")
    learner_run = tmp_path / "pvc" / "trajmesh-shared" / "run"
    rollout = kubelet.pod("rollout")
    local_weights = tmp_path / "pods" / rollout.name / "volumes" / "local-weights"  # the pod's emptyDir
    rollout_log = kubelet.logs / f"{rollout.name}.rollout.log"
    try:
        for component in ("nats", "redis"):
            kubelet.start(kubelet.pod(component))
        provision = kubelet.pod("provision")
        assert kubelet.run_to_completion(provision) == 0, kubelet.tail(provision)
        for component in ("environment", "store", "grader", "rollout", "learner"):
            kubelet.start(kubelet.pod(component), wait_ready_s=300, may_finish=component == "learner")
        learner, store = kubelet.pod("learner"), kubelet.pod("store")
        cfg = RunConfig.model_validate(yaml.safe_load(
            (tmp_path / "pods" / store.name / "volumes" / "runtime" / "config.yaml").read_text()))
        assert learner.procs[0].wait(timeout=600) == 0, kubelet.tail(learner)
        deadline = time.monotonic() + 120  # the rollout pod's loads of two versions past v0
        while len([v for v in _weights_loaded(rollout_log, local_weights) if v > 0]) < 2:
            assert time.monotonic() < deadline and rollout.procs[0].poll() is None, kubelet.tail(rollout)
            time.sleep(0.5)
        with urllib.request.urlopen(f"http://127.0.0.1:{_port(rollout, 'metrics')}/metrics", timeout=5) as r:
            metrics = r.read().decode()
        drain(cfg)
        for component in ("rollout", "grader", "environment"):
            kubelet.stop(kubelet.pod(component))
        assert kubelet.stop(store, grace_s=120) == [0], kubelet.tail(store)
    finally:
        kubelet.stop_all()
    loaded = _weights_loaded(rollout_log, local_weights)
    assert len([v for v in loaded if v > 0]) >= 2, (loaded, kubelet.tail(rollout))
    assert "trajmesh_rollout_weight_anchor_fallback_updates_total 0.0" in metrics, "a rebuild fell back to the anchor"
    shared = weights_root(learner_run)

    def version_dir(version: int) -> Path:  # v0 is the model the chart provisions
        found = version_dirs(shared, version)
        return found[-1] if found else tmp_path / "pvc" / "trajmesh-models" / "demo"

    assert all(Path(p).name == version_dir(v).name for v, p in loaded.items() if v > 0), loaded
    # Per version the rollout loaded from the mount: a trained trajectory sampled wholly at it.
    archive = read_archive(Path(cfg.run_dir) / "archive").to_pylist()  # the store pod's run dir
    # A "trained" row carries no tokens; the same trajectory's "accepted" row does.
    trained = {r["trajectory_id"] for r in archive if r["outcome"] == "trained"}
    sampled = [r for r in archive if r["trajectory_id"] in trained and r["loss_mask"] is not None]
    temperature = cfg.tasks.sampling.temperature
    checked = []
    for version in sorted(v for v in loaded if v > 0):
        rows = [r for r in sampled if 1 in r["loss_mask"]
                and {b for b, m in zip(r["behavior_versions"], r["loss_mask"], strict=True) if m} == {version}][:1]
        if not rows:
            continue
        start = rows[0]["loss_mask"].index(1)
        assert all(rows[0]["loss_mask"][start:]), "one sampled span (single-turn chain_sum)"
        got = [float(x) for x in rows[0]["behavior_logprobs"][start:]]
        (this,) = _recomputed(version_dir(version), tmp_path / "check" / f"v{version}", rows,
                              temperature)
        (before,) = _recomputed(version_dir(version - 1), tmp_path / "check" / f"v{version - 1}",
                                rows, temperature)
        diff = max(abs(a - b) for a, b in zip(got, this, strict=True))
        assert diff < DELTA_TOL, (version, got, this)
        assert max(abs(a - b) for a, b in zip(got, before, strict=True)) > 10 * DELTA_TOL, (version, got, before)
        checked.append(version)
    assert len(checked) >= 2, (checked, sorted(loaded))
    # v1 is the anchor (a full file); the others were rebuilt from the local copy and the deltas.
    assert [v for v in checked if not (version_dir(v) / "model.safetensors").exists()], checked
