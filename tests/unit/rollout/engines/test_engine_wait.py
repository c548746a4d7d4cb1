"""`wait_healthy` (rollout/engines/base.py), the one wait for a started engine (the rollout's engine
of every type, each distillation teacher, the SGLang check, the benchmarks): it returns once the
server answers its health check, and fails at once, naming the log, when the child process serving
it has exited (not after the whole start-up timeout)."""

from __future__ import annotations

import asyncio
import subprocess
import sys
from pathlib import Path

import pytest

from trajmesh.infra import free_port
from trajmesh.rollout.engines.base import wait_healthy
from trajmesh.rollout.engines.engine_client import EngineClient
from trajmesh.service import StartFailed


async def _wait(url: str, proc: subprocess.Popen[bytes] | None, timeout_s: float, what: str,
                log_path: Path | None) -> float:
    engine = EngineClient(url)
    try:
        return await wait_healthy(engine, timeout_s, proc=proc, what=what, log_path=log_path, hint="raise it")
    finally:
        await engine.close()


@pytest.mark.timeout(60)  # a wait that ignored the dead child would run into this, not the hour
def test_a_dead_child_fails_the_wait_at_once_naming_its_log(tmp_path: Path) -> None:
    log_path = tmp_path / "teacher-x-0.log"
    log_path.write_text("loading\nOSError: no model at /nowhere\n\n")
    proc = subprocess.Popen([sys.executable, "-c", "raise SystemExit(3)"])
    proc.wait()
    url = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    with pytest.raises(StartFailed) as err:
        asyncio.run(_wait(url, proc, 3600.0, "teacher engine for x", log_path))
    assert str(err.value).startswith("teacher engine for x exited with 3 during start after 0s "
                                     "(its last log line: OSError: no model at /nowhere); read "), err.value
    assert str(err.value).endswith(str(log_path)) and "\n" not in str(err.value)


def test_a_server_nobody_serves_times_out_with_the_hint() -> None:
    url = f"http://127.0.0.1:{free_port()}"
    with pytest.raises(StartFailed, match=f"^torch engine at {url} not healthy after 0.5s: raise it$"):
        asyncio.run(_wait(url, None, 0.5, f"torch engine at {url}", None))


def test_a_healthy_server_returns_the_seconds_waited(tmp_path: Path) -> None:
    """A real HTTP server answering /health (the torch engine's route) after it starts."""
    port = free_port()
    server = subprocess.Popen([sys.executable, "-c", (
        "import http.server, sys\n"
        "class H(http.server.BaseHTTPRequestHandler):\n"
        "    def do_GET(self):\n"
        "        self.send_response(200 if self.path == '/health' else 404); self.end_headers()\n"
        "    def log_message(self, *a): pass\n"
        f"http.server.HTTPServer(('127.0.0.1', {port}), H).serve_forever()\n")])
    try:
        waited = asyncio.run(_wait(f"http://127.0.0.1:{port}", server, 60.0, "engine", None))
        assert 0 <= waited < 60 and server.poll() is None
    finally:
        server.kill()
        server.wait()
