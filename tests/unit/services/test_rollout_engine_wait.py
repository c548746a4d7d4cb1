"""`wait_healthy` (services/rollout.py), the wait for the rollout's engine and each distillation
teacher: it returns once the server answers its health check, and fails at once, naming the logs,
when the child process serving it has exited (not after the whole start-up timeout)."""

from __future__ import annotations

import asyncio
import subprocess
import sys

import pytest

from trajmesh.infra import free_port
from trajmesh.rollout.engines.engine_client import EngineClient
from trajmesh.service import StartFailed
from trajmesh.services.rollout import wait_healthy


async def _wait(url: str, proc: subprocess.Popen[bytes] | None, timeout_s: float, what: str, logs: str) -> None:
    engine = EngineClient(url)
    try:
        await wait_healthy(engine, proc, timeout_s, what, logs)
    finally:
        await engine.close()


@pytest.mark.timeout(60)  # a wait that ignored the dead child would run into this, not the hour
def test_a_dead_child_fails_the_wait_at_once_naming_its_logs() -> None:
    proc = subprocess.Popen([sys.executable, "-c", "raise SystemExit(3)"])
    proc.wait()
    url = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    with pytest.raises(StartFailed, match=r"teacher engine for x exited with 3 during start; see logs/teacher-x-\*\.log"):
        asyncio.run(_wait(url, proc, 3600.0, "teacher engine for x", "logs/teacher-x-*.log"))


def test_a_server_nobody_serves_times_out_with_its_url() -> None:
    url = f"http://127.0.0.1:{free_port()}"
    with pytest.raises(StartFailed, match=f"torch engine at {url} not healthy after 0.5s; see .*startup_timeout_s"):
        asyncio.run(_wait(url, None, 0.5, "torch engine", "logs/engine-*.log"))
