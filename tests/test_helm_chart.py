"""The Helm chart, proven offline: rendered by the real Helm library (helm-python-sdk bundles Helm
v4), linted strictly, every object checked against Kubernetes schemas (kubernetes-validate, strict)
and every custom resource against its CRD's OpenAPI schema kept in tests/helm/crds/, the values
schema's negative cases, and golden renders (UPDATE_GOLDEN=1 regenerates them).

Objects built from files another component owns (dashboards/*.json, files/prometheus-rules.yaml)
are checked on their own and left out of the goldens, so adding a dashboard does not churn them.
"""

from __future__ import annotations

import json
import os
import re
from functools import cache
from pathlib import Path
from typing import Any

import pytest
import yaml

helm = pytest.importorskip("helm_python")
kubernetes_validate = pytest.importorskip("kubernetes_validate")
jsonschema = pytest.importorskip("jsonschema")

ROOT = Path(__file__).resolve().parents[1]
CHART = ROOT / "deploy" / "helm" / "trajmesh"
HELM_TESTS = Path(__file__).resolve().parent / "helm"
GOLDEN = HELM_TESTS / "golden"
CRDS = HELM_TESTS / "crds"
RELEASE, NAMESPACE = "trajmesh", "rl"
KUBE_VERSION = "1.31.0"
CI_VALUES = sorted(p.stem.removesuffix("-values") for p in (CHART / "ci").glob("*-values.yaml"))
CASES = ["default", *CI_VALUES]
GPU_COMPONENTS = {"rollout", "learner"}
CUSTOM_KINDS = {"ServiceMonitor", "PodMonitor", "PrometheusRule", "ScaledObject"}


def _values(case: str) -> dict[str, Any]:
    if case == "default":
        return {}
    return yaml.safe_load((CHART / "ci" / f"{case}-values.yaml").read_text()) or {}


@cache
def _chart() -> Any:
    return helm.Chart.load(str(CHART))


@cache
def _render(case: str) -> dict[str, str]:
    return _chart().render(values=_values(case), name=RELEASE, namespace=NAMESPACE, is_install=True)


def _objects(case: str) -> list[dict[str, Any]]:
    out = []
    for path, text in sorted(_render(case).items()):
        if path.endswith("NOTES.txt"):
            continue
        for doc in yaml.safe_load_all(text):
            if doc:
                doc.setdefault("metadata", {}).setdefault("annotations", {})
                doc["_template"] = path
                out.append(doc)
    return out


def _clean(obj: dict[str, Any]) -> dict[str, Any]:
    out = {k: v for k, v in obj.items() if k != "_template"}
    if not out["metadata"]["annotations"]:
        out["metadata"] = {k: v for k, v in out["metadata"].items() if k != "annotations"}
    return out


def _from_other_files(obj: dict[str, Any]) -> bool:
    return obj["_template"].endswith(("dashboards.yaml",)) or obj["kind"] == "PrometheusRule"


def _pod_spec(obj: dict[str, Any]) -> dict[str, Any] | None:
    if obj["kind"] in {"Deployment", "StatefulSet"}:
        return obj["spec"]["template"]["spec"]
    if obj["kind"] == "Pod":
        return obj["spec"]
    return None


def _component(obj: dict[str, Any]) -> str:
    return obj["metadata"].get("labels", {}).get("app.kubernetes.io/component", "")


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
    assert kinds["gpu-cluster"].count("ServiceMonitor") == 5 and "PodMonitor" in kinds["gpu-cluster"]
    assert kinds["autoscaling-on"].count("ScaledObject") == 3
    assert kinds["external-nats-redis"].count("ScaledObject") == 1


def test_service_monitors_need_the_api() -> None:
    """Opt-in and guarded: enabled without monitoring.coreos.com/v1 available renders none."""
    out = _chart().render(values={"monitoring": {"serviceMonitor": {"enabled": True}}},
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
        ({"learner": {"replicaCount": 4}}, "/learner/replicaCount"),
        ({"grader": {"image": {"tag": "latest"}}}, "/grader/image/tag"),
        ({"keda": {"enabled": "yes"}}, "/keda/enabled"),
        ({"model": {"source": "s3://bucket/model"}}, "/model/source"),
        ({"rollout": {"engine": "vllm"}}, "/rollout/engine"),
    ],
)
def test_values_schema_rejects_bad_values(values: dict[str, Any], where: str) -> None:
    with pytest.raises(helm.HelmValuesError) as err:
        _chart().render(values=values, name=RELEASE, namespace=NAMESPACE)
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
        if obj["kind"] != "Pod":
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
        gpu_wanted = comp in GPU_COMPONENTS and not (
            (comp == "rollout" and vals.get("rollout", {}).get("engine") == "torch")
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
        assert ("runtimeClassName" in pod) == bool(vals.get(comp, {}).get("runtimeClassName"))


@pytest.mark.parametrize("case", CASES)
def test_probes_on_named_metrics_port(case: str) -> None:
    for obj in _objects(case):
        pod = _pod_spec(obj)
        comp = _component(obj)
        if pod is None or comp in {"nats", "redis", "test"}:
            continue
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
        assert cfg.infra.store_address.startswith(f"{RELEASE}-store.{NAMESPACE}.svc:")
        assert "password" not in cm["data"]["config.yaml"]


def test_secrets_only_when_created() -> None:
    assert not [o for c in CASES for o in _objects(c) if o["kind"] == "Secret"]
    out = _chart().render(values={"redis": {"auth": {"enabled": True, "create": True, "password": "s3cret"}}},
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
    custom = _chart().render(values={"monitoring": {"dashboards": {"label": "my_dash", "labelValue": "yes"}}},
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


# ---------------------------------------------------------------- goldens
def _golden_text(case: str) -> str:
    docs = [_clean(o) for o in _objects(case) if not _from_other_files(o)]
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
