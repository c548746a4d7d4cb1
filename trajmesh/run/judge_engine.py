"""The judge engine a local run starts itself: ``judge.sources`` with ``judge.model_path`` and no
``judge.urls`` (graders/judge.py). One torch engine server (``trajmesh.rollout.engines.engine_server``,
SGLang's ``/generate``) serves the judge model on a free loopback port, niced (``judge.nice``) and
with one torch thread as every service gets, its log at ``RUN_DIR/logs/judge-engine.log``; the
run's config gets its URL in ``judge.urls``, so the graders and the manifest see it as if the user
had given it.

::

    start_mesh ── needs_judge_engine? ── JudgeEngine.start ── healthy ── judge.urls = [its URL]
                                                                          ──▶ graders, manifest
    audit_run  ── the same, for the audit's probes only, stopped after them
    Mesh.stop_infra ── JudgeEngine.stop (SIGKILL by pid, after the services)   restart_dead: restarted
"""

from __future__ import annotations

import asyncio
import os
import subprocess
from pathlib import Path
from typing import Any

from trajmesh.config import RunConfig
from trajmesh.infra import free_port

STARTUP_TIMEOUT_S = 300.0
"""How long the judge engine may take to load its model (a loaded CPU machine: tens of seconds)."""


def needs_judge_engine(cfg: RunConfig) -> bool:
    """Whether the run must start its judge engine: judged sources and no judge URL given (the config
    then requires ``model_path`` and ``type: torch``; trajmesh.config `JudgeConfig`)."""
    return bool(cfg.judge.sources) and not cfg.judge.urls


def with_judge_url(cfg: RunConfig, url: str) -> RunConfig:
    return cfg.model_copy(update={"judge": cfg.judge.model_copy(update={"urls": [url]})})


class JudgeEngine:
    """One torch engine server serving ``judge.model_path``; `start`, `restart` (same port), `stop`."""

    def __init__(self, model_path: str, log_path: Path, nice: int) -> None:
        self.model_path, self.log_path, self.nice = model_path, log_path, nice
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.popen: subprocess.Popen[bytes] | None = None

    @classmethod
    def for_run(cls, cfg: RunConfig, log_name: str = "judge-engine.log") -> JudgeEngine:
        assert cfg.judge.model_path, "judge.model_path: the config requires it without judge.urls"
        return cls(cfg.judge.model_path, Path(cfg.run_dir) / "logs" / log_name, cfg.judge.nice)

    @property
    def running(self) -> bool:
        return self.popen is not None and self.popen.poll() is None

    def start(self) -> JudgeEngine:
        """Starts the server and waits until it is healthy (`StartFailed` naming its log if it exits
        first or takes longer than `STARTUP_TIMEOUT_S`)."""
        from trajmesh.rollout.engines import start_engine_server

        env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
        _, self.popen = start_engine_server(self.model_path, self.log_path, port=self.port, version="judge",
                                            nice=self.nice, env=env)
        try:
            asyncio.run(self._wait_healthy())
        except BaseException:
            self.stop()
            raise
        return self

    async def _wait_healthy(self) -> None:
        from trajmesh.rollout.engines.base import wait_healthy
        from trajmesh.rollout.engines.engine_client import EngineClient

        async with EngineClient(self.url) as client:
            await wait_healthy(client, STARTUP_TIMEOUT_S, proc=self.popen, what=f"judge engine at {self.url}",
                               log_path=self.log_path)

    def restart(self) -> None:
        """A dead server started again on its port (the URL in the run's config stays right)."""
        self.stop()
        self.start()

    def stop(self) -> None:
        if self.popen is not None:
            if self.popen.poll() is None:
                self.popen.kill()
            self.popen.wait()

    def __enter__(self) -> JudgeEngine:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.stop()
