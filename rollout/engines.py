"""How a rollout process gets its engine, one factory per engine type (`trajmesh.plugins.ENGINES`
names them by `rollout.engine.type`). No torch here: the torch engine runs in its own process.

Each factory takes the rollout service after its tokenizer is loaded and returns the engine it
generates with; every engine speaks the same interface (generate, pause, resume,
update_weights_from_disk, context_length, close).
"""

from __future__ import annotations

from typing import Any

from trajmesh.rollout.engine_client import CoalescingEngine, EngineClient
from trajmesh.rollout.synthetic_engine import SyntheticEngine

from trajmesh.config import HttpEngineConfig, SyntheticEngineConfig


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
