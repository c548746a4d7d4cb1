"""A stop that cannot hang (issue 29): a service process whose stop path never finishes still exits
non-zero within `service.stop_timeout_s` (+ `EXIT_GRACE_S`), says what it was still waiting for,
reports unhealthy from the moment it is failing, and the launcher's `restart_dead` restarts it.

The service is a real process served by the real `run_service`/`serve` (tests/stop_hang_service.py)
and started by the real launcher (`Mesh.start_service` with the test's serve command).
"""

from __future__ import annotations

import json
import signal
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import pytest
from repo_paths import TESTS

from trajmesh.config import dump_config, load_config
from trajmesh.run.launcher import Mesh, Proc, kill_group
from trajmesh.service import EXIT_GRACE_S, STOP_TIMEOUT_EXIT_CODE

STOP_TIMEOUT_S = 2.0
MARGIN_S = 10.0
"""Process start-up and exit on a loaded machine, beyond the stop's own bound."""
SERVICE = "stop_hangs"
SCRIPT = TESTS / "stop_hang_service.py"


def _mesh(tmp_path: Path) -> Mesh:
    cfg = load_config(None, {"run_dir": str(tmp_path / "run"), "service.stop_timeout_s": STOP_TIMEOUT_S})
    config_path = tmp_path / "config.yaml"
    dump_config(cfg, config_path)
    return Mesh(cfg, config_path, serve_cmd=[sys.executable, str(SCRIPT)])


def _health(port: int) -> dict[str, Any] | None:
    """/healthz's answer (its JSON, with the HTTP status under "http"); None if nothing answers."""
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=2) as r:
            return {"http": r.status, **json.loads(r.read())}
    except urllib.error.HTTPError as err:
        return {"http": err.code, **json.loads(err.read())}
    except OSError:
        return None


def _wait_exit(proc: Proc, begun: float) -> float:
    """Seconds from `begun` until the process exited (fails past the stop's bound + margin)."""
    proc.popen.wait(timeout=STOP_TIMEOUT_S + EXIT_GRACE_S + MARGIN_S)
    return time.monotonic() - begun


@pytest.mark.parametrize(("hang", "exit_code", "named"), [
    ("stop_awaits", 1, "StopHangs.stop"),  # the event loop bounds stop(): ServiceFailed, exit 1
    ("stop_blocks", STOP_TIMEOUT_EXIT_CODE, "in stop"),  # the loop is blocked: the watchdog ends it
    ("loop_ignores_cancel", STOP_TIMEOUT_EXIT_CODE, "stubborn_loop"),  # and asyncio.run's teardown hangs
])
def test_a_stop_that_never_finishes_still_exits_non_zero_in_time(tmp_path: Path, hang: str, exit_code: int,
                                                                 named: str) -> None:
    mesh = _mesh(tmp_path)
    proc = mesh.start_service(SERVICE, 0, ["--hang", hang])
    try:
        mesh.wait_healthy([proc], timeout_s=60)
        begun = time.monotonic()
        proc.popen.send_signal(signal.SIGTERM)
        elapsed = _wait_exit(proc, begun)
    finally:
        kill_group(proc.popen)
    log = proc.log_path.read_text(errors="replace")
    assert proc.popen.returncode == exit_code, log
    assert elapsed >= STOP_TIMEOUT_S, f"exited after {elapsed:.1f}s: the stop did not hang?\n{log}"
    assert elapsed <= STOP_TIMEOUT_S + EXIT_GRACE_S + MARGIN_S, elapsed
    assert "still pending" in log.lower() or "still waiting for" in log.lower(), log
    assert named in log, log


def test_a_failing_service_is_unhealthy_exits_in_time_and_is_restarted(tmp_path: Path) -> None:
    mesh = _mesh(tmp_path)
    marker = tmp_path / "crashed-once"
    first = mesh.start_service(SERVICE, 0, ["--hang", "stop_awaits", "--crash-once", str(marker)])
    try:
        deadline = time.monotonic() + 60
        health = _health(first.metrics_port)
        while not (health and health.get("status") == "failing"):  # a poll on the service's state
            assert first.popen.poll() is None, f"exited before /healthz said failing:\n{first.log_path.read_text()}"
            assert time.monotonic() < deadline, health
            time.sleep(0.05)
            health = _health(first.metrics_port)
        begun = time.monotonic()
        assert health["http"] == 503 and "TimeoutError: an episode timed out" in health["error"], health
        elapsed = _wait_exit(first, begun)
        assert first.popen.returncode != 0
        assert elapsed <= STOP_TIMEOUT_S + EXIT_GRACE_S + MARGIN_S, elapsed
        started = mesh.restart_dead()
        assert [p.label for p in started] == [f"{SERVICE}-0"] and mesh.restarts == {(SERVICE, 0): 1}
        mesh.wait_healthy(started, timeout_s=60)  # the restarted process serves
        assert first not in mesh.procs
    finally:
        mesh.stop_services(grace_s=STOP_TIMEOUT_S + EXIT_GRACE_S + MARGIN_S)
    log = first.log_path.read_text(errors="replace")
    assert "stop() did not finish" in log, log
