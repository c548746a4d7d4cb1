"""Grafana dashboards and alert rules: structure, and every metric they name is exported by the code.

Metric names exported by the code are read from prometheus_client's REGISTRY after importing every
service module, plus the learner's per-step gauges (`STEP_METRIC_NAMES`, created at the first step).
`sglang:*` metrics come from the SGLang server itself and are allowed as external.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import yaml
from dashboard_queries import (
    DASHBOARDS,
    RULES,
    dashboard_exprs,
    dashboard_panels,
    load_dashboard,
    metric_names,
    rule_exprs,
)
from repo_paths import REPO

EXTERNAL_PREFIXES = ("sglang:",)
REQUIRED_UIDS = {"trajmesh-overview", "trajmesh-staleness", "trajmesh-rollout", "trajmesh-env-graders",
                 "trajmesh-data-mixture"}


def exported_metric_names() -> set[str]:
    """Every sample name the services can export (by metric type), plus the learner's step gauges."""
    from prometheus_client import REGISTRY

    import trajmesh.services.environment  # noqa: F401
    import trajmesh.services.evaluator  # noqa: F401
    import trajmesh.services.grader  # noqa: F401
    import trajmesh.services.learner  # noqa: F401
    import trajmesh.services.rollout  # noqa: F401
    import trajmesh.services.store.service  # noqa: F401
    from trajmesh.learner.metrics import STEP_METRIC_NAMES

    names: set[str] = set(STEP_METRIC_NAMES)
    suffixes = {"counter": ("_total",), "histogram": ("_bucket", "_sum", "_count"), "gauge": ("",),
                "summary": ("_sum", "_count", "")}
    for family in REGISTRY.collect():
        names.update(family.name + s for s in suffixes.get(family.type, ("",)))
        names.update(s.name for s in family.samples)
    return names


@pytest.mark.parametrize("path", DASHBOARDS, ids=lambda p: p.stem)
def test_dashboard_structure(path: Path) -> None:
    dash = load_dashboard(path)
    assert "__inputs" not in dash and "__requires" not in dash, "export for sharing, not with __inputs"
    assert dash["id"] is None
    assert isinstance(dash["uid"], str) and dash["uid"].startswith("trajmesh-") and len(dash["uid"]) <= 40
    variables = {v["name"]: v for v in dash["templating"]["list"]}
    ds = variables["datasource"]
    assert ds["type"] == "datasource" and ds["query"] == "prometheus"
    for name in ("namespace", "run"):
        assert variables[name]["type"] == "query" and variables[name]["includeAll"]
        assert variables[name]["allValue"] == ".*"
    panels = dashboard_panels(dash)
    assert panels
    ids = [p["id"] for p in dash["panels"]]
    assert len(ids) == len(set(ids)), "panel ids must be unique"
    for p in panels:
        assert p["datasource"]["uid"] == "${datasource}", p["title"]
        assert p["fieldConfig"]["defaults"].get("unit"), f"{p['title']}: unit not set"
        assert p.get("targets"), f"{p['title']}: no query"
        for t in p["targets"]:
            assert t["datasource"]["uid"] == "${datasource}"
    exprs = dashboard_exprs(dash)
    assert any("$__rate_interval" in e for _, e in exprs)
    for title, expr in exprs:
        assert not re.search(r"\[\d+[smhd]\]", expr), f"{title}: use [$__rate_interval], not a fixed range"
        for sel in re.findall(r"\{([^}]*)\}", expr):
            if sel.strip() in ("le", "") or "{{" in sel:
                continue
            assert 'namespace=~"$namespace"' in sel and 'run=~"$run"' in sel, f"{title}: {expr}"


def test_the_five_dashboards_exist_with_distinct_uids() -> None:
    uids = [load_dashboard(p)["uid"] for p in DASHBOARDS]
    assert len(uids) == len(set(uids))
    assert REQUIRED_UIDS <= set(uids)


def test_every_metric_a_dashboard_or_rule_names_is_exported() -> None:
    exported = exported_metric_names()
    missing: dict[str, set[str]] = {}
    sources = [(f"{p.stem}: {t}", e) for p in DASHBOARDS for t, e in dashboard_exprs(load_dashboard(p))]
    sources += [(f"rule {a}", e) for a, e in rule_exprs()]
    for where, expr in sources:
        names = metric_names(expr)
        assert names, f"{where}: no metric found in {expr!r}"
        bad = {n for n in names if n not in exported and not n.startswith(EXTERNAL_PREFIXES)}
        if bad:
            missing[where] = bad
    assert not missing, f"metrics not exported by any service: {missing}"


# Words that name a metric's unit: a base unit, or the thing a count counts (singular forms).
METRIC_UNIT_WORDS = {
    "second", "byte", "token", "ratio", "nat", "version", "trajectory", "task", "group", "message",
    "call", "request", "error", "failure", "step", "update", "audit", "breach", "violation", "timeout",
    "reason", "action", "session", "component", "sequence",
}
METRIC_SUBSYSTEMS = {"store", "rollout", "learner", "environment", "grader", "bus", "evaluator"}
# Suffixes Prometheus reserves for the series of histograms, summaries and counters.
RESERVED_SUFFIXES = ("_sum", "_count", "_bucket", "_created", "_total")
METRIC_SOURCES = ["trajmesh", "services", "learner", "rollout", "envs", "graders"]


def _singular(word: str) -> str:
    if word.endswith("ies"):
        return word[:-3] + "y"
    if word.endswith(("ches", "sses")):
        return word[:-2]
    return word[:-1] if word.endswith("s") else word


def metric_name_problems(kind: str, declared: str) -> list[str]:
    """What is wrong with a metric declared as ``kind("declared", ...)`` (the name as written, before
    prometheus_client appends ``_total`` to a counter)."""
    problems = []
    parts = declared.split("_")
    if parts[0] != "trajmesh" or len(parts) < 3 or parts[1] not in METRIC_SUBSYSTEMS:
        problems.append("not trajmesh_<subsystem>_<name>")
    stem = declared
    if kind == "Counter":
        if not declared.endswith("_total"):
            problems.append("a counter's declared name must end in _total")
        stem = declared.removesuffix("_total")
    if stem.endswith(RESERVED_SUFFIXES):
        problems.append(f"ends in a reserved suffix ({stem.rsplit('_', 1)[1]})")
    if not any(_singular(word) in METRIC_UNIT_WORDS for word in stem.split("_")[2:]):
        problems.append("names no unit (seconds, bytes, tokens, ratio, or what it counts)")
    return problems


def _declared_metrics() -> list[tuple[str, str, str]]:
    """(kind, declared name, file) of every metric declared with a literal name in the packages."""
    import ast

    found = []
    root = REPO
    for folder in METRIC_SOURCES:
        for path in sorted((root / folder).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text())):
                if not (isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant)):
                    continue
                func = node.func
                kind = func.id if isinstance(func, ast.Name) else getattr(func, "attr", "")
                name = node.args[0].value
                if kind in ("Counter", "Gauge", "Histogram", "Summary") and isinstance(name, str):
                    found.append((kind, name, str(path.relative_to(root))))
    return found


@pytest.mark.parametrize("kind,declared", [
    ("Counter", "trajmesh_store_trajectories"),             # no _total
    ("Counter", "trajmesh_grader_reward_sum_total"),        # a _sum counter
    ("Counter", "trajmesh_store_admitted_total"),           # no unit
    ("Gauge", "trajmesh_store_queue_depth"),                # no unit
    ("Histogram", "trajmesh_rollout_latency"),              # no unit
    ("Counter", "trajmesh_frobnicator_steps_total"),        # unknown subsystem
])
def test_metric_naming_rules_reject(kind: str, declared: str) -> None:
    assert metric_name_problems(kind, declared)


def test_metric_names_follow_the_house_convention() -> None:
    """trajmesh_<subsystem>_<name>_<unit>; counters declared with _total, no reserved suffix in the
    name (a Counter called x_sum exports x_sum_total), a unit in every name. Checks the names as
    declared in the source (prometheus_client rewrites a counter's name, so the registry cannot)."""
    declared = _declared_metrics()
    assert len(declared) > 30, declared
    bad = {f"{kind}({name!r}) in {where}": problems for kind, name, where in declared
           if name.startswith("trajmesh") and (problems := metric_name_problems(kind, name))}
    assert not bad, bad


def test_alert_rules_have_for_severity_and_summary() -> None:
    data = yaml.safe_load(RULES.read_text())
    alerts = {r["alert"]: r for g in data["groups"] for r in g["rules"]}
    for name in ("TrajmeshLearnerStalled", "TrajmeshPolicyLagNearEta", "TrajmeshEssFractionLow",
                 "TrajmeshEntropyCollapse", "TrajmeshJetStreamConsumerLag", "TrajmeshVerifierErrorRate",
                 "TrajmeshHeldoutRegression"):
        assert name in alerts
    for name, rule in alerts.items():
        assert "for" in rule, name
        assert rule["labels"]["severity"] in {"critical", "warning", "info"}, name
        assert rule["annotations"]["summary"], name


def test_overview_shows_heldout_accuracy_per_source_and_the_regression() -> None:
    """The evaluator's figures on the overview: accuracy by source (and mode), and the score's
    distance below its best, which TrajmeshHeldoutRegression alerts on."""
    dash = load_dashboard(REPO / "deploy" / "helm" / "trajmesh" / "dashboards" / "trajmesh-overview.json")
    exprs = dashboard_exprs(dash)
    per_source = [e for _, e in exprs if "trajmesh_evaluator_heldout_accuracy_ratio" in metric_names(e)]
    assert per_source and all(re.search(r"by \(source", e) for e in per_source), per_source
    assert any("trajmesh_evaluator_heldout_score_below_best_ratio" in metric_names(e) for _, e in exprs)
    rules = dict(rule_exprs())
    assert "trajmesh_evaluator_heldout_score_below_best_ratio" in metric_names(rules["TrajmeshHeldoutRegression"])
