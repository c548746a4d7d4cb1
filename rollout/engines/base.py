"""What every engine is to the rollout: the interface, what a factory is given and returns, and
the one wait until a started engine is healthy. No torch, no HTTP library.

::

    factory(EngineContext) ──▶ StartedEngine(engine, proc)
         │ a server it starts: wait_healthy(engine, proc=…) ─ /health 200 → return
         │                                                  ─ proc exited / timeout → StartFailed (one line)
         └ a server at a url: wait_healthy(engine) (nothing to watch but the clock)
"""

from __future__ import annotations

import asyncio
import logging
import os
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from trajmesh.config import RunConfig

log = logging.getLogger("trajmesh.rollout.engines")

PROGRESS_EVERY_S = 30.0
"""How often a start that waits (for a start lock, or for /health) logs how far it got."""
POLL_S = 0.5
"""How often a start polls its server's /health (and a start lock)."""


class Engine(Protocol):
    """Every rollout engine: SGLang's HTTP API (``CoalescingEngine`` over ``EngineClient``: the torch
    engine and SGLang), ``VLLMEngine`` and ``SyntheticEngine``. An HTTP engine also has
    ``capabilities``, its server's probed ``EngineCapabilities`` (None until ``context_length()``
    probes it)."""

    async def generate(self, input_ids: list[int], sampling: dict[str, Any], return_logprob: bool = True
                       ) -> Any: ...

    async def pause(self) -> None: ...

    async def resume(self) -> None: ...

    async def update_weights_from_disk(self, path: str, version: int | str | None = None) -> str: ...

    async def context_length(self) -> int | None: ...

    async def health(self, *, generate: bool = False) -> bool: ...

    async def close(self) -> None: ...


@dataclass(frozen=True)
class EngineContext:
    """What an engine factory is given by the process it starts in (a rollout or the evaluator)."""

    cfg: RunConfig
    replica: int
    who: str
    """The process's worker id, named in logs, errors and the start lock."""
    vocab_size: int
    eos_token_id: int
    version: int = 0
    """The policy version the engine starts at (the base model: 0)."""
    log_prefix: str = "engine"
    """A started server logs to RUN_DIR/logs/<log_prefix>-<replica>.log."""

    @property
    def log_path(self) -> Path:
        return Path(self.cfg.run_dir) / "logs" / f"{self.log_prefix}-{self.replica}.log"


@dataclass
class StartedEngine:
    """A healthy engine, and the server process this process started for it (None: a server at a
    url, or an engine in this process). Whoever holds it stops `proc` at its own stop."""

    engine: Any
    proc: subprocess.Popen[bytes] | None = None


async def wait_healthy(engine: Any, timeout_s: float, *, proc: subprocess.Popen[bytes] | None = None,
                       what: str = "engine", log_path: Path | None = None, hint: str = "",
                       poll_s: float | None = None) -> float:
    """Until `engine` answers its health check; returns the seconds waited. Logs progress every
    `PROGRESS_EVERY_S` (with the last line of `log_path`, the server's log). A one-line `StartFailed`
    naming `log_path` if `proc` (the server this process started; None: one it did not) exits
    first, or after `timeout_s` (with `hint`: the setting to change). Polls every `poll_s` (default
    `POLL_S`)."""
    from trajmesh.service import StartFailed

    poll_s = POLL_S if poll_s is None else poll_s

    started = time.monotonic()
    deadline, note_at = started + timeout_s, started + PROGRESS_EVERY_S
    read = f"; read {log_path}" if log_path is not None else ""
    while True:
        if proc is not None and proc.poll() is not None:
            rc = proc.returncode
            how = f"was killed by signal {-rc}" if rc < 0 else f"exited with {rc}"
            last = last_line(log_path) if log_path is not None else ""
            raise StartFailed(f"{what} {how} during start after {time.monotonic() - started:.0f}s"
                              + (f" (its last log line: {last})" if last else "") + read)
        if await engine.health():
            waited = time.monotonic() - started
            log.info("%s healthy after %.0fs", what, waited)
            return waited
        now = time.monotonic()
        if now > deadline:
            raise StartFailed(f"{what} not healthy after {timeout_s:g}s{read}" + (f": {hint}" if hint else ""))
        if now >= note_at:
            note_at = now + PROGRESS_EVERY_S
            log.info("%s starting: %.0fs of %.0fs%s", what, now - started, timeout_s,
                     f"; {log_path.name}: {last_line(log_path) or '(empty)'}" if log_path is not None else "")
        await asyncio.sleep(poll_s)


def last_line(path: Path, limit: int = 300) -> str:
    """The last non-empty line of the log at `path` (at most `limit` characters; "" if none)."""
    try:
        with open(path, "rb") as fh:
            fh.seek(0, os.SEEK_END)
            fh.seek(max(0, fh.tell() - 8192))
            lines = [ln.strip() for ln in fh.read().decode(errors="replace").splitlines()]
    except OSError:
        return ""
    line = next((ln for ln in reversed(lines) if ln), "")
    return line if len(line) <= limit else line[:limit] + "…"
