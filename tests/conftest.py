"""Shared fixtures: real NATS (JetStream) and Redis servers on free ports, stopped by pid."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from trajmesh.infra import NatsServer, RedisServer


@pytest.fixture
def nats_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[NatsServer]:
    """A fresh nats-server with JetStream for one test."""
    server = NatsServer(tmp_path_factory.mktemp("nats"))
    server.start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def redis_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    """A fresh redis-server (AOF on) for one test."""
    server = RedisServer(tmp_path_factory.mktemp("redis"))
    server.start()
    try:
        yield server
    finally:
        server.stop()


def _build_tiny_model(root: object) -> str:
    """A tiny Llama with the demo tokenizer and a short SFT warm start (seconds on CPU)."""
    from pathlib import Path

    from trajmesh.learner.models import prepare_demo_model

    out = Path(str(root))
    prepare_demo_model(out, seed=0, hidden=32, layers=1, heads=2, steps=40, batch_size=32, lr=3e-3, n_train=500)
    return str((out / "sft").resolve())


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    """HF model dir (safetensors + tokenizer) shared by the mesh tests."""
    return _build_tiny_model(tmp_path_factory.mktemp("tiny-model"))
