"""The launcher never kills a service before the stop budget the service itself runs under.

The store's stop finalizes the run (every held trajectory archived as an outcome, after reading the
whole archive): `service.stop_timeout_s` + its 90 s of `stop_work_s`. The launcher used to give every
service a flat grace (30 s) and then SIGKILL it, so on a loaded machine a store killed in its
finalization left a group `accepted` with no final outcome (the elastic mesh's flake, issue #41).

A real process stands in for each service: it takes a few seconds after SIGTERM to finish, longer
than the grace the test passes, and exits 0 if it is let finish."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path

from trajmesh.config import load_config
from trajmesh.run.launcher import Mesh, Proc
from trajmesh.service import stop_budget_s

FINISH_S = 8.0
SLOW_STOP = f"""
import signal, sys, time
def stop(*_):
    time.sleep({FINISH_S})  # the service's durable stop work
    sys.exit(0)
signal.signal(signal.SIGTERM, stop)
print("ready", flush=True)
while True:
    time.sleep(1)
"""


def _started(name: str, tmp_path: Path) -> Proc:
    popen = subprocess.Popen([sys.executable, "-c", SLOW_STOP], stdout=subprocess.PIPE, start_new_session=True)
    assert popen.stdout is not None and popen.stdout.readline().strip() == b"ready"  # its handler is set
    return Proc(name, 0, popen, 0, tmp_path / f"{name}.log")


def test_the_store_finishes_its_stop_past_the_launchers_grace(tmp_path: Path) -> None:
    cfg = load_config(None, {"run_dir": str(tmp_path / "run"), "service.stop_timeout_s": 2})
    assert stop_budget_s("store", 2) > FINISH_S > 1.0
    mesh = Mesh(cfg, tmp_path / "cfg.yaml")
    mesh.procs = [_started("store", tmp_path)]
    began = time.monotonic()
    mesh.stop_services(grace_s=1.0)
    assert mesh.procs[0].popen.returncode == 0  # finished its stop; SIGKILL would be -9
    assert time.monotonic() - began >= FINISH_S - 0.5


def test_a_service_past_its_own_budget_is_killed(tmp_path: Path) -> None:
    """A service with no stop work of its own gets `stop_timeout_s` + the exit grace, then SIGKILL."""
    cfg = load_config(None, {"run_dir": str(tmp_path / "run"), "service.stop_timeout_s": 0.5})
    assert stop_budget_s("grader", 0.5) < FINISH_S
    mesh = Mesh(cfg, tmp_path / "cfg.yaml")
    proc = _started("grader", tmp_path)
    mesh.procs = [proc]
    began = time.monotonic()
    mesh.stop_services(grace_s=0.1)
    assert proc.popen.returncode == -signal.SIGKILL
    assert time.monotonic() - began < FINISH_S
