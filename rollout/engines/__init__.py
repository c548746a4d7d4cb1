"""Engines: what samples tokens for the rollout, and the code that speaks to each.

::

    __init__ (here)       the factories: how a rollout process gets its engine (below)
    engine_client         SGLang's native HTTP API, the subset the rollout uses (torch engine, SGLang)
    generation            one turn of sampling that survives the engine (the rollout's side of it)
    engine_server         the CPU torch engine's HTTP server ─ torch_sampler (its token loop),
                          grammar (its structured outputs), hf_model (loading a HF causal LM)
    vllm_engine           the `vllm` engine: a vLLM server process ─ vllm_worker (its weight reload)
    sglang_check          `make gpu-check`: a real SGLang server against the conformance suite
    synthetic_engine      no model: load tests and benchmarks
    teacher               on-policy distillation's teacher, seen from a rollout

How a rollout process gets its engine, one factory per engine type (`trajmesh.plugins.ENGINES`
names them by `rollout.engine.type`). No torch here: the torch engine runs in its own process.

Each factory takes an `EngineContext` (the run's config, the replica, who starts it, the
tokenizer's vocabulary and EOS, the starting version, its log's prefix) and returns a healthy
`StartedEngine`: the engine, and the server process it started (the caller stops it). Every
engine speaks `base.Engine` (generate, pause, resume, update_weights_from_disk, context_length,
health, close).
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Literal

from pydantic import Field

from trajmesh.config import EngineConfig, RunConfig
from trajmesh.infra import die_with_parent, free_port
from trajmesh.rollout.engines.base import EngineContext, StartedEngine, wait_healthy
from trajmesh.rollout.engines.engine_client import CoalescingEngine, EngineClient
from trajmesh.rollout.engines.synthetic_engine import SyntheticEngine, SyntheticEngineConfig


class HttpEngineConfig(EngineConfig):
    """An engine behind SGLang's HTTP API (torch, sglang): rollout/engines/engine_client.py speaks to it."""

    url: str | None = None
    """Base URL of an already running engine (None: the torch engine starts its own server)."""
    batch_window_ms: float = Field(2.0, ge=0, le=1000)
    """How long a rollout process collects concurrent /generate calls before sending them to the
    engine as one batch request (0: those made in the same event-loop tick)."""
    startup_timeout_s: float = Field(120.0, gt=0)
    """How long rollout waits for the engine's /health at start (SGLang loading weights: minutes).
    On a cluster, match the engine container's startup allowance (the Helm chart sets both from
    rollout.sglang.startupSeconds)."""
    max_abort_retries: int = Field(5, ge=0)
    """Aborts not caused by this rollout's own weight-load pause that one turn resubmits before its
    trajectory ends as INFRA_FAILURE (reason aborted)."""
    abort_backoff_s: float = Field(0.5, ge=0)
    """First wait before resubmitting after such an abort; doubles per retry (at most 30 s)."""


class TorchEngineConfig(HttpEngineConfig):
    """The built-in CPU engine (rollout/engines/engine_server.py): a child of each rollout process, or the
    running one at `url`."""

    type: Literal["torch"] = "torch"
    """Selects the built-in torch engine (the default)."""


class SGLangEngineConfig(HttpEngineConfig):
    """An external SGLang server (GPU deployments; the Helm chart runs one beside each rollout)."""

    type: Literal["sglang"] = "sglang"
    """Selects an external SGLang server."""
    url: str = Field(min_length=1)
    """Base URL of the running SGLang server (required: rollout never starts one)."""


def start_engine_server(model_path: str, log_path: Path, *, port: int | None = None, version: int | str = 0,
                        seed: int | None = None, threads: int = 1, nice: int = 0,
                        env: dict[str, str] | None = None) -> tuple[str, subprocess.Popen[bytes]]:
    """A torch engine server child (rollout/engines/engine_server.py) serving `model_path` on loopback at
    `port` (a free one by default), its output appended to `log_path`: its URL and process. `nice`
    lowers its priority; `env` replaces this process's environment. No orphan engine: it stays in this
    process's group (the launcher kills the group) and gets SIGKILL when this process dies, even by
    SIGKILL (PR_SET_PDEATHSIG). The rollout's engine, the launcher's judge engine and the judge
    benchmark start it here."""
    port = free_port() if port is None else port
    log_path.parent.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "trajmesh.rollout.engines.engine_server", "--model", model_path,
           "--port", str(port), "--host", "127.0.0.1", "--version", str(version), "--threads", str(threads)]
    if seed is not None:
        cmd += ["--seed", str(seed)]
    parent_death = die_with_parent(signal.SIGKILL)

    def preexec() -> None:
        parent_death()
        if nice > 0:
            os.nice(nice)

    with open(log_path, "ab") as fh:
        proc = subprocess.Popen(cmd, stdout=fh, stderr=subprocess.STDOUT,
                                env=os.environ.copy() if env is None else env, preexec_fn=preexec)
    return f"http://127.0.0.1:{port}", proc


def spawn_torch_server(cfg: RunConfig, replica: int, model_path: str, version: int, log_path: Path
                       ) -> tuple[str, subprocess.Popen[bytes]]:
    """The rollout's torch engine server for `replica` (`start_engine_server`, seeded per replica)."""
    return start_engine_server(model_path, log_path, version=version, seed=cfg.seed * 101 + replica)


async def start_http(ctx: EngineContext) -> StartedEngine:
    """torch / sglang: an engine behind SGLang's HTTP API, at `rollout.engine.url` or (torch only) a
    child engine server this process starts; waits until it is healthy (a child that did not
    become healthy is killed). The G samples of a group (and of concurrent groups) reach it as
    batch requests (`batch_window_ms`)."""
    ec = ctx.cfg.rollout.engine
    assert isinstance(ec, HttpEngineConfig), ec.type
    proc = None
    if ec.url is not None:
        url = ec.url
    else:
        assert ctx.cfg.model.path is not None
        url, proc = spawn_torch_server(ctx.cfg, ctx.replica, ctx.cfg.model.path, ctx.version, ctx.log_path)
    engine = CoalescingEngine(EngineClient(url), window_s=ec.batch_window_ms / 1000)
    try:
        await wait_healthy(engine, ec.startup_timeout_s, proc=proc, what=f"{ec.type} engine at {url}",
                           log_path=ctx.log_path if proc is not None else None,
                           hint=f"raise rollout.engine.startup_timeout_s (now {ec.startup_timeout_s:g})")
    except BaseException:
        await engine.close()
        if proc is not None and proc.poll() is None:
            proc.kill()
            await asyncio.to_thread(proc.wait)
        raise
    return StartedEngine(engine, proc)


async def start_synthetic(ctx: EngineContext) -> StartedEngine:
    """synthetic: uniform random tokens in this process, timed by `rollout.engine.synthetic`."""
    cfg = ctx.cfg
    ec = cfg.rollout.engine
    assert isinstance(ec, SyntheticEngineConfig), ec.type
    return StartedEngine(SyntheticEngine(ctx.vocab_size, ctx.eos_token_id, seed=cfg.seed * 101 + ctx.replica,
                                         version=ctx.version, timing=ec.synthetic))
