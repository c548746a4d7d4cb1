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

Each factory takes the rollout service after its tokenizer is loaded and returns the engine it
generates with; every engine speaks the same interface (generate, pause, resume,
update_weights_from_disk, context_length, close).
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field

from trajmesh.config import EngineConfig
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


async def start_http(svc: Any) -> CoalescingEngine:
    """torch / sglang: an engine behind SGLang's HTTP API, at `rollout.engine.url` or (torch only) a
    child engine server this process starts; waits until it is healthy. The G samples of a group
    (and of concurrent groups) reach it as batch requests (`batch_window_ms`)."""
    ec = svc.cfg.rollout.engine
    assert isinstance(ec, HttpEngineConfig), ec.type
    url = ec.url if ec.url is not None else svc._start_torch_engine(svc.cfg.model.path, svc.version)
    svc.engine = CoalescingEngine(EngineClient(url), window_s=ec.batch_window_ms / 1000)
    await svc._wait_engine()
    return svc.engine  # type: ignore[no-any-return]


async def start_synthetic(svc: Any) -> SyntheticEngine:
    """synthetic: uniform random tokens in this process, timed by `rollout.engine.synthetic`."""
    cfg = svc.cfg
    ec = cfg.rollout.engine
    assert isinstance(ec, SyntheticEngineConfig), ec.type
    return SyntheticEngine(svc.tokenizer.vocab_size, svc.tokenizer.eos_token_id, seed=cfg.seed * 101 + svc.replica,
                           version=svc.version, timing=ec.synthetic)
