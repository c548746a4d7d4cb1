"""Telemetry proven against a real Prometheus server scraping a real mesh.

A short asynchronous mesh run (real NATS, Redis and service processes) is scraped every second by a
real `prometheus` binary (Debian's package) started by this test on a free port, with its own config
file (static targets = every service's metrics port, labels namespace/run added as a Kubernetes
ServiceMonitor would), its own data dir under tmp, and the alert rules file loaded. Then every
dashboard query and every alert expression goes through Prometheus' HTTP API:

- every dashboard query parses and returns data ($namespace/$run set to the scrape labels,
  $__rate_interval to 20s), except the `sglang:*` ones, which only parse: the CPU mesh runs the
  built-in torch engine, and SGLang's own /metrics exists only on GPU deployments, and the
  PARSE_ONLY_METRICS below (each with its reason);
- every dashboard variable query (`label_values`) finds the run's label values;
- every alert expression parses, every metric it selects has data, and Prometheus evaluates every
  rule with health "ok"; `promtool check rules` accepts the file.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from dashboard_queries import DASHBOARDS, RULES, dashboard_exprs, load_dashboard, metric_names, rule_exprs

from trajmesh.config import RunConfig, load_config
from trajmesh.infra import free_port
from trajmesh.run.launcher import Mesh, start_mesh
from trajmesh.run.train import _write_manifest, read_metrics

pytestmark = [
    pytest.mark.e2e,
    pytest.mark.timeout(300),
    pytest.mark.skipif(shutil.which("prometheus") is None, reason="needs Debian's prometheus package"),
]

NAMESPACE = "trajmesh-e2e"
RUN = "telemetry"
RATE_INTERVAL = "20s"
MIN_STEPS = 3
PARSE_ONLY_PREFIXES = ("sglang:",)
"""Queried for syntax only: SGLang exports these on GPU deployments; the CPU mesh uses the torch engine."""
PARSE_ONLY_METRICS = {
    "trajmesh_environment_tool_calls_total": "labelled by tool name, so it has no series before a tool call; "
                                             "chain_sum (the CPU mesh's environment) has no tools",
}
"""Queried for syntax only, with the reason they have no samples in a short CPU run."""


def _build_config(run_dir: Path, model_dir: str) -> RunConfig:
    return load_config(None, {
        "run_dir": str(run_dir), "model.path": model_dir, "gate.eta": 1,
        "tasks.group_size": 4, "tasks.heldout_size": 20, "tasks.train_size": 300,
        "tasks.sampling.max_new_tokens": 6,
        "rollout.replicas": 1, "rollout.concurrent_tasks": 2, "grader.replicas": 1,
        "learner.engine.type": "torch", "learner.batch_groups": 2, "learner.max_steps": 1000,
        "learner.checkpoint_every": 1000,
        # The evaluator too (its gauges feed the overview's held-out panels and an alert).
        "eval.in_mesh": True, "eval.samples": 1, "eval.noise_seeds": 0, "eval.every_versions": 2,
        # A distillation teacher (the model itself; coef 0: the scores leave training as it was)
        # feeds the rollout dashboard's teacher panels.
        "distill": {"teachers": [{"source": "chain_sum", "model_path": model_dir}], "coef": 0.0},
        # chain_sum's episodes through the environment service (by default a stateless one-turn
        # environment plays in the rollout's process): its Reset/Close calls feed the
        # environment panels, as a tool or game source's do on a cluster.
        "rollout.stateless_environments_in_process": False,
    })


class Prometheus:
    """A prometheus server process owned by the test (stopped by pid)."""

    def __init__(self, root: Path, targets: dict[str, list[int]]) -> None:
        self.root = root
        self.port = free_port()
        root.mkdir(parents=True, exist_ok=True)
        shutil.copy(RULES, root / "rules.yaml")
        config = {
            "global": {"scrape_interval": "1s", "scrape_timeout": "1s", "evaluation_interval": "1s"},
            "rule_files": [str(root / "rules.yaml")],
            "scrape_configs": [{
                "job_name": job,
                "static_configs": [{"targets": [f"127.0.0.1:{p}" for p in ports],
                                    "labels": {"namespace": NAMESPACE, "run": RUN}}],
            } for job, ports in targets.items()],
        }
        (root / "prometheus.yml").write_text(yaml.safe_dump(config))
        self.log = open(root / "prometheus.log", "wb")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen(
            ["prometheus", f"--config.file={root / 'prometheus.yml'}", f"--storage.tsdb.path={root / 'data'}",
             f"--web.listen-address=127.0.0.1:{self.port}", "--log.level=warn"],
            stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True)

    def url(self, path: str, **params: str) -> str:
        return f"http://127.0.0.1:{self.port}{path}" + ("?" + urllib.parse.urlencode(params) if params else "")

    def get(self, path: str, **params: str) -> dict[str, Any]:
        try:
            with urllib.request.urlopen(self.url(path, **params), timeout=10) as r:
                data: dict[str, Any] = json.loads(r.read())
        except urllib.error.HTTPError as exc:  # a bad query is a 400 with a JSON error body
            data = json.loads(exc.read())
        return data

    def wait_ready(self, timeout_s: float = 60.0) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            assert self.proc.poll() is None, (self.root / "prometheus.log").read_text()
            try:
                with urllib.request.urlopen(self.url("/-/ready"), timeout=1) as r:
                    if r.status == 200:
                        return
            except OSError:
                pass
            time.sleep(0.2)
        raise TimeoutError("prometheus not ready")

    def query(self, expr: str) -> dict[str, Any]:
        return self.get("/api/v1/query", query=expr)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        self.log.close()


def _substitute(expr: str) -> str:
    return (expr.replace("$__rate_interval", RATE_INTERVAL).replace("$namespace", NAMESPACE)
            .replace("$run", RUN))


@pytest.fixture(scope="module")
def scraped_mesh(tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: str) -> Iterator[tuple[Prometheus, Mesh]]:
    """A mesh that has trained MIN_STEPS steps while Prometheus scraped every service (still running)."""
    root = tmp_path_factory.mktemp("telemetry")
    cfg = _build_config(root / "run", tiny_model_dir)
    Path(cfg.run_dir).mkdir(parents=True)
    _write_manifest(cfg)
    mesh = start_mesh(cfg)
    prom: Prometheus | None = None
    try:
        targets: dict[str, list[int]] = {}
        for p in mesh.procs:
            targets.setdefault(p.name, []).append(p.metrics_port)
        prom = Prometheus(root / "prometheus", targets)
        prom.wait_ready()
        deadline = time.monotonic() + 200
        while True:
            assert not mesh.dead(), [(p.label, p.log_path.read_text()[-2000:]) for p in mesh.dead()]
            steps = [m for m in read_metrics(Path(cfg.run_dir)) if m.get("kind") == "learner_step"]
            scraped = prom.query(f"min(trajmesh_learner_steps_total) >= {MIN_STEPS}")["data"]["result"]
            evaluated = prom.query("trajmesh_evaluator_heldout_accuracy_ratio")["data"]["result"]
            if len(steps) >= MIN_STEPS and scraped and evaluated:
                break
            assert time.monotonic() < deadline, f"only {len(steps)} learner steps"
            time.sleep(1.0)
        time.sleep(3.0)  # a few more scrapes and rule evaluations
        yield prom, mesh
    finally:
        if prom is not None:
            prom.stop()
        mesh.stop_services()
        mesh.stop_infra()


def _has_data(result: dict[str, Any]) -> bool:
    data = result["data"]
    if data["resultType"] in ("scalar", "string"):
        return True
    return bool(data["result"])


def test_every_target_is_scraped(scraped_mesh: tuple[Prometheus, Mesh]) -> None:
    prom, mesh = scraped_mesh
    targets = prom.get("/api/v1/targets")["data"]["activeTargets"]
    assert len(targets) == len(mesh.procs)
    assert all(t["health"] == "up" for t in targets), [(t["scrapeUrl"], t["lastError"]) for t in targets]


def test_every_dashboard_query_parses_and_returns_data(scraped_mesh: tuple[Prometheus, Mesh]) -> None:
    prom, _ = scraped_mesh
    failures: list[str] = []
    checked = 0
    for path in DASHBOARDS:
        for title, expr in dashboard_exprs(load_dashboard(path)):
            res = prom.query(_substitute(expr))
            if res["status"] != "success":
                failures.append(f"{path.stem} / {title}: does not parse: {res.get('error')}")
                continue
            if all(n.startswith(PARSE_ONLY_PREFIXES) or n in PARSE_ONLY_METRICS for n in metric_names(expr)):
                continue
            checked += 1
            if not _has_data(res):
                failures.append(f"{path.stem} / {title}: no data for {expr}")
    assert not failures, "\n".join(failures)
    assert checked > 40


def test_dashboard_variables_find_the_run(scraped_mesh: tuple[Prometheus, Mesh]) -> None:
    prom, _ = scraped_mesh
    for path in DASHBOARDS:
        for var in load_dashboard(path)["templating"]["list"]:
            if var["type"] != "query":
                continue
            m = re.fullmatch(r"label_values\((.+), (\w+)\)", var["definition"])
            assert m, var["definition"]
            selector, label = _substitute(m.group(1)), m.group(2)
            values = prom.get(f"/api/v1/label/{label}/values", **{"match[]": selector})["data"]
            assert {"namespace": NAMESPACE, "run": RUN}[label] in values, (path.stem, var["name"], values)


def test_every_alert_rule_parses_selects_live_metrics_and_evaluates(scraped_mesh: tuple[Prometheus, Mesh]) -> None:
    prom, _ = scraped_mesh
    for alert, expr in rule_exprs():
        res = prom.query(expr)
        assert res["status"] == "success", f"{alert}: {res.get('error')}"
        for name in metric_names(expr):
            assert prom.query(f'{name}{{namespace="{NAMESPACE}"}}')["data"]["result"], f"{alert}: no {name}"
    deadline = time.monotonic() + 20
    while True:
        rules = [r for g in prom.get("/api/v1/rules")["data"]["groups"] for r in g["rules"]]
        if rules and all(r["lastEvaluation"] > "2000" for r in rules):
            break
        assert time.monotonic() < deadline, "rules never evaluated"
        time.sleep(0.5)
    assert {r["name"] for r in rules} == {a for a, _ in rule_exprs()}
    assert all(r["health"] == "ok" for r in rules), [(r["name"], r.get("lastError")) for r in rules]


@pytest.mark.skipif(shutil.which("promtool") is None, reason="promtool not installed")
def test_promtool_accepts_the_rules_file() -> None:
    out = subprocess.run(["promtool", "check", "rules", str(RULES)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stdout + out.stderr
