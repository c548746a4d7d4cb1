"""After a short real mesh run with auth on, no generated secret appears anywhere it could leak.

Searched: every file under the run dir (service and server logs, metrics.jsonl, manifest.json, the
config files, the archive's Parquet bytes, checkpoints, weights, the servers' data and config
files), the /metrics text of every service while it runs, and every service's command line. The
one exception is RUN_DIR/infra/credentials.json (mode 0600), the file that holds them.
"""

from __future__ import annotations

import stat
import time
import urllib.request
from pathlib import Path

import pytest

from trajmesh import security
from trajmesh.config import load_config
from trajmesh.run.launcher import Proc, start_mesh
from trajmesh.run.run_end import drain
from trajmesh.run.train import _write_manifest, read_metrics

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300)]


def _build_config(run_dir: Path, model_dir: str):  # type: ignore[no-untyped-def]
    return load_config(None, {
        "run_dir": str(run_dir), "model.path": model_dir, "gate.eta": 1,
        "tasks.group_size": 4, "tasks.heldout_size": 20, "tasks.train_size": 100,
        "tasks.sampling.max_new_tokens": 4, "rollout.replicas": 1, "rollout.concurrent_tasks": 2,
        "grader.replicas": 1, "store.drop_zero_variance_groups": False,
        "learner.engine.type": "torch", "learner.batch_groups": 2, "learner.max_steps": 2,
        "learner.checkpoint_every": 1,
    })


def _scrape(port: int) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as resp:
        return str(resp.read().decode(errors="replace"))


def _scrape_when_ready(proc: Proc, deadline_s: float = 60.0) -> str | None:
    """The /metrics text of a running service once its endpoint answers (a busy machine may not
    have it listening yet, or a restarted service may be starting); None if the process exited."""
    deadline = time.monotonic() + deadline_s
    while proc.popen.poll() is None:
        try:
            return _scrape(proc.metrics_port)
        except OSError as err:  # URLError(ConnectionRefusedError), reset while it starts or stops
            assert time.monotonic() < deadline, f"{proc.label}: /metrics did not answer in {deadline_s}s: {err}"
            time.sleep(0.2)  # no event for "a socket started listening in another process"
    return None


def test_no_secret_in_logs_metrics_manifest_configs_or_archive(tmp_path: Path, tiny_model_dir: str) -> None:
    cfg = _build_config(tmp_path / "run", tiny_model_dir)
    assert cfg.infra.security.nats_auth and cfg.infra.security.redis_auth  # the launcher's default
    run_dir = Path(cfg.run_dir)
    run_dir.mkdir(parents=True)
    _write_manifest(cfg)
    mesh = start_mesh(cfg)
    scraped: dict[str, str] = {}
    cmdlines: dict[str, bytes] = {}
    try:
        for p in mesh.procs:
            args = p.popen.args
            cmdlines[p.label] = " ".join(map(str, args if isinstance(args, list) else [args])).encode()  # ps
        learner = next(p for p in mesh.procs if p.name == "learner")
        deadline = time.monotonic() + 200
        while not [m for m in read_metrics(run_dir) if m.get("kind") == "learner_step"]:
            assert learner.popen.poll() is None or learner.popen.returncode == 0, learner.log_path.read_text()[-3000:]
            assert time.monotonic() < deadline, "no learner step"
            time.sleep(0.3)
        for p in mesh.procs:
            text = _scrape_when_ready(p)
            if text is not None:
                scraped[p.label] = text
        assert learner.popen.wait(timeout=200) == 0, learner.log_path.read_text()[-3000:]
        drain(mesh.cfg)
        mesh.stop_services()
    finally:
        mesh.stop_services()
        mesh.stop_infra()

    creds_path = security.LocalCredentials.path(run_dir)
    assert stat.S_IMODE(creds_path.stat().st_mode) == 0o600
    creds = security.LocalCredentials.load(run_dir)
    assert creds is not None
    secrets = {f"nats:{role}": pw for role, pw in creds.nats_passwords.items()}
    secrets["redis"] = creds.redis_password
    assert {"store", "rollout", "grader", "learner"} <= {p.name for p in mesh.procs}
    assert len(scraped) >= 4, sorted(scraped)

    files = [f for f in run_dir.rglob("*") if f.is_file() and f != creds_path]
    kinds = {f.name for f in files}
    assert {"manifest.json", "metrics.jsonl", "config.resolved.yaml", "nats.conf", "nats.log"} <= kinds, kinds
    assert any(f.suffix == ".parquet" for f in files) and any(f.suffix == ".log" for f in files)
    leaks = []
    for f in files:
        data = f.read_bytes()
        leaks += [f"{name} in {f.relative_to(run_dir)}" for name, s in secrets.items() if s.encode() in data]
    for label, text in scraped.items():
        leaks += [f"{name} in /metrics of {label}" for name, s in secrets.items() if s in text]
    for label, argv in cmdlines.items():
        leaks += [f"{name} in the command line of {label}" for name, s in secrets.items() if s.encode() in argv]
    assert not leaks, leaks
    # The mesh ran under its per-service permissions without a single refusal.
    violations = [f.name for f in files if f.suffix == ".log" and "violation" in f.read_text(errors="replace").lower()]
    assert not violations, violations
