"""The Helm chart rendered by the real Helm library (helm-python-sdk), and the helpers both
its offline tests (tests/unit/deploy/test_helm_chart.py) and its runs as local processes
(tests/e2e/test_helm_local.py) read it with."""

from __future__ import annotations

from functools import cache
from typing import Any

import pytest
import yaml
from repo_paths import REPO, TESTS

helm = pytest.importorskip("helm_python")
kubernetes_validate = pytest.importorskip("kubernetes_validate")
jsonschema = pytest.importorskip("jsonschema")

_LOADER = getattr(yaml, "CSafeLoader", yaml.SafeLoader)
"""libyaml's safe loader where PyYAML has it (its wheels do): the same documents as yaml.safe_load_all,
11x faster on a rendered chart (0.04 against 0.41 s of CPU for the default values), which every
test of the chart parses."""


def load_all(text: str) -> list[Any]:
    """Every YAML document in `text`, as `yaml.safe_load_all` reads them."""
    return list(yaml.load_all(text, Loader=_LOADER))

CHART = REPO / "deploy" / "helm" / "trajmesh"
HELM_TESTS = TESTS / "helm"
GOLDEN = HELM_TESTS / "golden"
CRDS = HELM_TESTS / "crds"
RELEASE, NAMESPACE = "trajmesh", "rl"
KUBE_VERSION = "1.31.0"
CI_VALUES = sorted(p.stem.removesuffix("-values") for p in (CHART / "ci").glob("*-values.yaml"))
CASES = ["default", *CI_VALUES]
GPU_COMPONENTS = {"rollout", "learner"}
CUSTOM_KINDS = {"ServiceMonitor", "PodMonitor", "PrometheusRule", "ScaledObject"}


# No default images: every install sets them (values.yaml "Images"); the tests use the names the
# release workflow pushes (.github/workflows/release.yml, tests/unit/repo/test_release_workflow.py).
_GPU_IMAGE = {"repository": "ghcr.io/trajmesh/trajmesh-gpu", "tag": "0.1.0"}
_CPU_IMAGE = {"repository": "ghcr.io/trajmesh/trajmesh-cpu", "tag": "0.1.0"}
IMAGES: dict[str, Any] = {
    "rollout": {"image": _GPU_IMAGE, "sglang": {"image": _GPU_IMAGE}}, "learner": {"image": _GPU_IMAGE},
    "environment": {"image": _CPU_IMAGE}, "grader": {"image": _CPU_IMAGE}, "store": {"image": _CPU_IMAGE},
    "tests": {"image": _CPU_IMAGE},
}


def _merged(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for k, v in over.items():
        out[k] = _merged(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def _values(case: str) -> dict[str, Any]:
    """What the case renders with: the images every install must set, then ci/CASE-values.yaml."""
    own = {} if case == "default" else yaml.safe_load((CHART / "ci" / f"{case}-values.yaml").read_text()) or {}
    return _merged(IMAGES, own)


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
        for doc in load_all(text):
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
    if obj["kind"] in {"Deployment", "StatefulSet", "Job"}:
        return obj["spec"]["template"]["spec"]
    if obj["kind"] == "Pod":
        return obj["spec"]
    return None


def _component(obj: dict[str, Any]) -> str:
    return obj["metadata"].get("labels", {}).get("app.kubernetes.io/component", "")




# ---------------------------------------------------------------- vLLM as the rollout engine
def _rollout_pod(values: dict[str, Any]) -> dict[str, Any]:
    objs = _objects_of(values)
    dep = next(o for o in objs if o["kind"] == "Deployment" and _component(o) == "rollout")
    return dep["spec"]["template"]["spec"]


def _container(pod: dict[str, Any], name: str) -> dict[str, Any]:
    return next(c for c in pod.get("initContainers", []) + pod["containers"] if c["name"] == name)



def _objects_of(values: dict[str, Any]) -> list[dict[str, Any]]:
    out = _chart().render(values=values, name=RELEASE, namespace=NAMESPACE, is_install=True)
    return [d for path, text in sorted(out.items()) if not path.endswith("NOTES.txt")
            for d in load_all(text) if d]
