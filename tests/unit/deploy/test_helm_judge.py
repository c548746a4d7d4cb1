"""The judge grader's engine as its own workload in the chart (templates/judge.yaml): with
``judge.enabled`` an SGLang Deployment on GPUs of its own, fetching its pinned model, and a Service;
the run config's ``judge`` names that Service, the name and the revision, keeps the user's sources,
mode and rubric, and loads as a RunConfig. Off by default: no judge object, no ``judge`` config."""

from __future__ import annotations

from typing import Any

import yaml
from helm_chart import CHART as CHART_DIR
from helm_chart import (
    IMAGES,
    KUBE_VERSION,
    NAMESPACE,
    _component,
    _merged,
    _objects_of,
    helm,
    kubernetes_validate,
)

JUDGE = {"enabled": True, "name": "qwen-judge", "replicaCount": 2, "gpus": 2, "tensorParallelSize": 2,
         "model": {"source": "hf://Qwen/Qwen2.5-7B-Instruct", "revision": "a09a35458c702b33eeacc393d103063234e8bc28"}}
CONFIG = {"judge": {"sources": ["chain_sum"], "mode": "pairwise", "max_new_tokens": 64}}


def _values(judge: dict[str, Any] | None) -> dict[str, Any]:
    own: dict[str, Any] = {"trajmesh": {"config": CONFIG}}
    if judge is not None:
        own["judge"] = judge
    return _merged(IMAGES, own)


def _run_config(objs: list[dict[str, Any]]) -> dict[str, Any]:
    cm = next(o for o in objs if o["kind"] == "ConfigMap" and o["metadata"]["name"].endswith("-config")
              and "config.yaml" in o["data"])
    return yaml.safe_load(cm["data"]["config.yaml"])  # type: ignore[no-any-return]


def test_the_judge_engine_is_its_own_sglang_workload() -> None:
    from trajmesh.config import RunConfig

    objs = _objects_of(_values(JUDGE))
    dep = next(o for o in objs if o["kind"] == "Deployment" and _component(o) == "judge")
    svc = next(o for o in objs if o["kind"] == "Service" and _component(o) == "judge")
    for obj in (dep, svc):
        kubernetes_validate.validate(obj, KUBE_VERSION, strict=True)
    assert dep["spec"]["replicas"] == 2  # scaled on its own
    pod = dep["spec"]["template"]
    assert svc["spec"]["selector"].items() <= pod["metadata"]["labels"].items()
    assert pod["metadata"]["labels"]["trajmesh.io/mesh"] == "true"  # the mesh NetworkPolicy lets graders in
    (sglang,) = pod["spec"]["containers"]
    args = dict(a.removeprefix("--").split("=", 1) for a in sglang["args"] if "=" in a)
    target = "/models/hf/Qwen/Qwen2.5-7B-Instruct"
    assert args["model-path"] == target and args["tp-size"] == "2"
    assert int(sglang["resources"]["limits"]["nvidia.com/gpu"]) == 2
    (fetch,) = pod["spec"]["initContainers"]
    env = {e["name"]: e.get("value") for e in fetch["env"]}
    assert (env["REPO_ID"], env["REVISION"]) == ("Qwen/Qwen2.5-7B-Instruct", JUDGE["model"]["revision"])  # type: ignore[index]

    cfg = RunConfig.model_validate(_run_config(objs))
    port = svc["spec"]["ports"][0]["port"]
    assert cfg.judge.urls == [f"http://{svc['metadata']['name']}.{NAMESPACE}.svc:{port}"]
    assert (cfg.judge.type, cfg.judge.name, cfg.judge.revision) == ("sglang", "qwen-judge", JUDGE["model"]["revision"])  # type: ignore[index]
    assert (cfg.judge.sources, cfg.judge.mode, cfg.judge.max_new_tokens) == (["chain_sum"], "pairwise", 64)


def test_no_judge_by_default_and_a_judge_needs_a_pinned_revision() -> None:
    objs = _objects_of(_merged(IMAGES, {}))
    assert not [o for o in objs if _component(o) == "judge"]
    assert "judge" not in _run_config(objs)
    try:
        _objects_of(_values({**JUDGE, "model": {"source": "hf://Qwen/Qwen2.5-7B-Instruct", "revision": ""}}))
    except Exception as exc:  # noqa: BLE001 - the render error's type is the SDK's
        assert "judge.model.revision is required" in str(exc), exc
    else:
        raise AssertionError("a judge without a revision rendered")


def test_lint_strict_with_a_judge() -> None:
    report = helm.lint(str(CHART_DIR), _values(JUDGE), strict=True, namespace=NAMESPACE)
    bad = [m for m in report["messages"] if m["severity"] >= 2]
    assert not bad and not report["errors"], report
