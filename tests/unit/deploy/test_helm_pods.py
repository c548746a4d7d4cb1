"""The chart's pods' wiring, checked outside a mesh: the vLLM rollout pod's container args under vLLM's
own parser with the init container's copy of the worker extension, the grace periods the kubelet
gives the pods against their services' bounded stop, and, with weights.sync delta, the volume the
agent rebuilds checkpoints on and its engine loads them from. The chart run as local processes is
tests/e2e/test_helm_local.py; the offline render checks tests/unit/deploy/test_helm_chart.py."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml
from helm_chart import (
    CASES,
    CUSTOM_KINDS,
    IMAGES,
    KUBE_VERSION,
    _component,
    _container,
    _merged,
    _objects,
    _objects_of,
    _pod_spec,
    _rollout_pod,
    _values,
    kubernetes_validate,
)
from repo_paths import REPO

_VLLM_POD_CHECK = """
import json, sys
from vllm.engine.arg_utils import AsyncEngineArgs
from vllm.entrypoints.launchers.cli_args import make_arg_parser, validate_parsed_serve_args
from vllm.utils.argparse_utils import FlexibleArgumentParser
from vllm.utils.import_utils import resolve_obj_by_qualname
args = make_arg_parser(FlexibleArgumentParser()).parse_args(json.loads(sys.argv[1]))
validate_parsed_serve_args(args)
engine = AsyncEngineArgs.from_cli_args(args)
ext = resolve_obj_by_qualname(engine.worker_extension_cls)
print(json.dumps({"scale_out": args.enable_scale_out, "chunked": engine.enable_chunked_prefill,
                  "batched": engine.max_num_batched_tokens, "max_model_len": engine.max_model_len,
                  "logprobs_mode": str(engine.logprobs_mode), "ext_file": sys.modules[ext.__module__].__file__,
                  "retie": callable(getattr(ext, "retie_lm_head", None))}))
"""


@pytest.mark.timeout(600)
def test_vllm_pod_wiring_runs(tmp_path: Path) -> None:
    """The vLLM pod's wiring, run here (no GPU, no cluster): the init container's script copies the
    worker extension out of the installed trajmesh package into the shared directory; with the
    container's PYTHONPATH pointing there, vLLM's own `vllm serve` parser and validation accept the
    container's args, and the --worker-extension-cls resolves to that copy."""
    from vllm_server import require_vllm

    python = require_vllm()
    pod = _rollout_pod(_values("vllm"))
    init, vllm = _container(pod, "vllm-extension"), _container(pod, "vllm")
    target = tmp_path / "vllm-extension"
    target.mkdir()
    init_env = {**os.environ, **{e["name"]: e["value"] for e in init["env"]}, "TARGET": str(target)}
    assert init["command"][0] == "python"  # the trajmesh image's interpreter; here this test's
    subprocess.run([sys.executable, *init["command"][1:], *init["args"]], env=init_env, check=True, timeout=60)
    copied = target / "vllm_worker.py"
    assert copied.read_bytes() == (REPO / "rollout" / "engines" / "vllm_worker.py").read_bytes()
    env = {**os.environ, "PYTHONPATH": str(target), "VLLM_SERVER_DEV_MODE": "1"}
    done = subprocess.run([str(python), "-c", _VLLM_POD_CHECK, json.dumps(vllm["args"])], env=env,
                          capture_output=True, text=True, timeout=540)
    assert done.returncode == 0, done.stderr[-4000:]
    seen = json.loads(done.stdout.strip().splitlines()[-1])
    assert seen["scale_out"] is True and seen["chunked"] is False and seen["retie"] is True, seen
    assert (seen["batched"], seen["max_model_len"]) == (8192, 4096), seen
    assert seen["logprobs_mode"].endswith("processed_logprobs"), seen
    assert Path(seen["ext_file"]).resolve() == copied.resolve(), seen


@pytest.mark.parametrize("component,service", [("store", "trajmesh.services.store.service:TrajectoryStore"),
                                               ("learner", "trajmesh.services.learner:LearnerService")])
def test_pods_outwait_their_services_bounded_stop(component: str, service: str) -> None:
    """The kubelet SIGKILLs a pod after terminationGracePeriodSeconds; a service's own stop may take
    service.stop_timeout_s + its stop_work_s + the watchdog's grace before it exits by itself, so a
    grace period below that would kill a store mid-finalization or a learner mid-checkpoint."""
    import importlib

    from trajmesh.config import ServiceConfig
    from trajmesh.service import EXIT_GRACE_S

    if component == "learner":
        pytest.importorskip("torch")
    module, _, cls = service.partition(":")
    bound = ServiceConfig().stop_timeout_s + getattr(importlib.import_module(module), cls).stop_work_s + EXIT_GRACE_S
    dep = next(o for o in _objects_of(_values("default"))
               if o["kind"] in {"Deployment", "StatefulSet"} and _component(o) == component)
    assert dep["spec"]["template"]["spec"]["terminationGracePeriodSeconds"] > bound


# ---------------------------------------------------------------- weights.sync delta: the local copy
ENGINE_PODS = {"rollout", "evaluator"}
"""Components whose trajmesh process rebuilds delta checkpoints (services/rollout.py; the evaluator
inherits its weights loop)."""
ENGINE_CONTAINERS = {"sglang", "vllm"}
DELTA = {"trajmesh": {"config": {"weights": {"sync": "delta"}}}}


def _config(objs: list[dict[str, Any]]) -> dict[str, Any]:
    cm = next(o for o in objs if o["kind"] == "ConfigMap" and "config.yaml" in o.get("data", {}))
    return dict(yaml.safe_load(cm["data"]["config.yaml"]))


def _deployment_pod(objs: list[dict[str, Any]], component: str) -> dict[str, Any]:
    dep = next(o for o in objs if o["kind"] == "Deployment" and _component(o) == component)
    return dict(dep["spec"]["template"]["spec"])


def _local_weights_wiring(objs: list[dict[str, Any]]) -> set[tuple[str, str]]:
    """Asserts that every engine pod mounts one emptyDir at the config's weights.local_dir in its
    trajmesh container (writable: it rebuilds there) and in its SGLang/vLLM container (which loads
    what it rebuilt); returns the (component, container) pairs that mount it."""
    local_dir = _config(objs).get("weights", {}).get("local_dir")
    assert local_dir, "the run config names no weights.local_dir"
    wired = set()
    for obj in objs:
        comp = _component(obj)
        pod = _pod_spec(obj)
        if pod is None or comp not in ENGINE_PODS:
            continue
        volumes = {v["name"]: v for v in pod["volumes"]}
        names = set()
        for c in pod["containers"]:
            if c["name"] != comp and c["name"] not in ENGINE_CONTAINERS:
                continue
            at = [m for m in c.get("volumeMounts", []) if m["mountPath"] == local_dir]
            assert len(at) == 1, (comp, c["name"], "nothing mounted at", local_dir)
            assert c["name"] in ENGINE_CONTAINERS or not at[0].get("readOnly"), (comp, "the agent cannot write")
            names.add(at[0]["name"])
            wired.add((comp, c["name"]))
        assert len(names) == 1, (comp, "different volumes at", local_dir, names)
        assert "emptyDir" in volumes[names.pop()], comp
    return wired


@pytest.mark.parametrize(("case", "engine"), [("delta-sync", "sglang"), ("vllm", "vllm"), ("cpu-only", "torch")])
def test_delta_sync_agent_and_engine_share_the_local_weights_volume(case: str, engine: str) -> None:
    """weights.sync delta: the rollout agent and the evaluator rebuild each checkpoint in
    weights.local_dir and point their engine there, so the chart's config names a path on a volume
    that the trajmesh container and the SGLang/vLLM container mount alike (the torch engine runs
    inside the trajmesh container). Every object of the render is valid Kubernetes."""
    values = _merged(_merged(_values(case), DELTA), {"evaluator": {"enabled": True}})
    objs = _objects_of(values)
    sidecars = {engine} & ENGINE_CONTAINERS
    assert _local_weights_wiring(objs) == {(comp, c) for comp in ENGINE_PODS for c in {comp, *sidecars}}
    for obj in objs:
        if obj["kind"] not in CUSTOM_KINDS:
            kubernetes_validate.validate(obj, KUBE_VERSION, strict=True)
    given = values["trajmesh"]["config"]["weights"]
    assert _config(objs)["weights"] == {**given, "local_dir": "/local-weights"}
    for obj in objs:
        if _component(obj) not in ENGINE_PODS and (pod := _pod_spec(obj)) is not None:
            assert "local-weights" not in {v["name"] for v in pod.get("volumes", [])}, _component(obj)


def test_the_wiring_check_fails_without_a_mount_or_the_config_key() -> None:
    """The check above catches a render that lacks the engine's mount, the agent's or the config key."""
    objs = _objects("delta-sync")  # the evaluator is on by default: its pod is wired too
    assert _local_weights_wiring(objs) == {(comp, c) for comp in ENGINE_PODS for c in (comp, "sglang")}
    for drop in ("sglang", "rollout"):
        broken = json.loads(json.dumps(objs))
        c = _container(_deployment_pod(broken, "rollout"), drop)
        c["volumeMounts"] = [m for m in c["volumeMounts"] if m["name"] != "local-weights"]
        with pytest.raises(AssertionError, match="nothing mounted at"):
            _local_weights_wiring(broken)
    broken = json.loads(json.dumps(objs))
    cm = next(o for o in broken if o["kind"] == "ConfigMap" and "config.yaml" in o.get("data", {}))
    cfg = yaml.safe_load(cm["data"]["config.yaml"])
    del cfg["weights"]["local_dir"]
    cm["data"]["config.yaml"] = yaml.safe_dump(cfg)
    with pytest.raises(AssertionError, match="no weights.local_dir"):
        _local_weights_wiring(broken)


@pytest.mark.parametrize("case", CASES)
def test_full_sync_renders_no_local_weights(case: str) -> None:
    """weights.sync full (every case but delta-sync): no local-weights volume, no weights.local_dir."""
    objs = _objects(case)
    delta = case == "delta-sync"
    assert ("local_dir" in _config(objs).get("weights", {})) == delta, case
    for obj in objs:
        if (pod := _pod_spec(obj)) is not None:
            has = "local-weights" in {v["name"] for v in pod.get("volumes", [])}
            assert has == (delta and _component(obj) in ENGINE_PODS), (case, _component(obj))


def test_local_weights_volume_values() -> None:
    """rollout.localWeights: the volume on the node's disk by default, tmpfs with medium Memory, its
    sizeLimit, and another mountPath moves the mounts and weights.local_dir together; a
    weights.local_dir the chart does not mount fails the render, the mounted path itself is accepted."""
    def volume(objs: list[dict[str, Any]]) -> dict[str, Any]:
        return next(v for v in _deployment_pod(objs, "rollout")["volumes"] if v["name"] == "local-weights")

    assert volume(_objects("delta-sync")) == {"name": "local-weights", "emptyDir": {"sizeLimit": "32Gi"}}
    memory = _objects_of(_merged(_merged(IMAGES, DELTA), {"rollout": {"localWeights": {"medium": "Memory",
                                                                                        "sizeLimit": "4Gi"}}}))
    assert volume(memory)["emptyDir"] == {"medium": "Memory", "sizeLimit": "4Gi"}
    moved = _objects_of(_merged(_merged(IMAGES, DELTA), {"rollout": {"localWeights": {"mountPath": "/ckpt/local"}}}))
    assert _config(moved)["weights"]["local_dir"] == "/ckpt/local"
    assert _local_weights_wiring(moved) == {(comp, c) for comp in ENGINE_PODS for c in (comp, "sglang")}
    elsewhere = {"trajmesh": {"config": {"weights": {"sync": "delta", "local_dir": "/tmp/weights"}}}}
    with pytest.raises(Exception, match="rollout.localWeights.mountPath") as err:  # noqa: B017 - the SDK wraps Helm's error
        _objects_of(_merged(IMAGES, elsewhere))
    assert "trajmesh.config.weights.local_dir" in str(err.value) and "/tmp/weights" in str(err.value)
    same = _objects_of(_merged(IMAGES, {"trajmesh": {"config": {"weights": {"sync": "delta",
                                                                            "local_dir": "/local-weights/"}}}}))
    assert _config(same)["weights"]["local_dir"] == "/local-weights"
    full = _objects_of(_merged(IMAGES, {"trajmesh": {"config": {"weights": {"local_dir": "/tmp/weights"}}}}))
    assert _config(full)["weights"] == {"local_dir": "/tmp/weights"}  # unused with full: left as given
