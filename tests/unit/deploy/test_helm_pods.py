"""The chart's pods' wiring, checked outside a mesh: the vLLM rollout pod's container args under vLLM's
own parser with the init container's copy of the worker extension, and the grace periods the kubelet
gives the pods against their services' bounded stop. The chart run as local processes is
tests/e2e/test_helm_local.py; the offline render checks tests/unit/deploy/test_helm_chart.py."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from helm_chart import _component, _container, _objects_of, _rollout_pod, _values
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
    assert copied.read_bytes() == (REPO / "rollout" / "vllm_worker.py").read_bytes()
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
