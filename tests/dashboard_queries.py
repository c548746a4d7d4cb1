"""The dashboards' and alert rules' PromQL, read from the chart: which metrics each query names
(tests/unit/deploy/test_dashboards.py, tests/e2e/test_telemetry_prometheus.py)."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import yaml
from repo_paths import REPO

DASHBOARDS = sorted((REPO / "deploy" / "helm" / "trajmesh" / "dashboards").glob("*.json"))
RULES = REPO / "deploy" / "helm" / "trajmesh" / "files" / "prometheus-rules.yaml"

# PromQL words that may precede "(" or stand alone and are not metric names.
_PROMQL_WORDS = {
    "sum", "min", "max", "avg", "count", "rate", "increase", "irate", "histogram_quantile", "clamp_min", "clamp_max",
    "by", "without", "on", "ignoring", "group_left", "group_right", "and", "or", "unless", "vector", "le",
    "offset", "abs", "delta", "deriv", "topk", "bottomk", "quantile", "stddev", "absent", "scalar", "time",
}


def load_dashboard(path: Path) -> dict[str, Any]:
    data: dict[str, Any] = json.loads(path.read_text())
    return data


def dashboard_panels(dash: dict[str, Any]) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    for p in dash["panels"]:
        if p["type"] == "row":
            out.extend(p.get("panels", []))
        else:
            out.append(p)
    return out


def dashboard_exprs(dash: dict[str, Any]) -> list[tuple[str, str]]:
    """(panel title, expr) for every query target of a dashboard."""
    return [(p["title"], t["expr"]) for p in dashboard_panels(dash) for t in p.get("targets", [])]


def rule_exprs() -> list[tuple[str, str]]:
    data = yaml.safe_load(RULES.read_text())
    return [(r["alert"], r["expr"]) for g in data["groups"] for r in g["rules"]]


def metric_names(expr: str) -> set[str]:
    """Metric names a PromQL expression selects (identifiers followed by a `{` selector)."""
    stripped = re.sub(r'"(?:[^"\\]|\\.)*"', '""', expr)  # label values may contain anything
    names = set(re.findall(r"([a-zA-Z_:][a-zA-Z0-9_:]*)\s*\{", stripped))
    names |= set(re.findall(r"\b((?:trajmesh_|sglang:)[a-zA-Z0-9_:]*)", stripped))  # bare selectors
    return names - _PROMQL_WORDS
