"""The grader service checks the sandbox at start-up when a configured source is graded by running
model code (the `code` grader): without a per-call cgroup (v2 or v1) it refuses (SandboxUnavailable)
unless sandbox.allow_without_cgroup, like the environment service (test_environment_sandbox_preflight.py).

No built-in source yields code-graded tasks yet, so the refusal tests stand one in: math_tool tasks
relabelled `grader: code` (the grader reads a task's grader from its metadata)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from mesh_checks import setup_then_stop

from trajmesh import sandbox, tasks
from trajmesh.config import load_config
from trajmesh.infra import NatsServer, RedisServer
from trajmesh.sandbox import cgroups
from trajmesh.services.grader import GraderService, sandboxed_sources


def _code_graded_math(monkeypatch: pytest.MonkeyPatch) -> None:
    real = tasks.load_split

    def load_split(src: Any, n_train: int, n_heldout: int) -> Any:
        train, heldout = real(src, n_train, n_heldout)
        if src.type != "math_tool":
            return train, heldout
        relabel = [tasks.TaskSpec(**{**t.__dict__, "metadata": {**t.metadata, "grader": "code"}}) for t in train + heldout]
        return relabel[:len(train)], relabel[len(train):]

    monkeypatch.setattr(tasks, "load_split", load_split)


def _setup(overrides: dict[str, Any], nats: NatsServer, redis: RedisServer, model: str) -> GraderService:
    # A run directory of its own: the default (runs/demo) may hold a demo run's NATS credentials,
    # and with them the grader waits for streams only an admin creates.
    run_dir = nats.data_dir / "run"
    service = GraderService(load_config(None, {"run_dir": str(run_dir), "infra.nats_url": nats.url,
                                               "infra.redis_url": redis.url, "model.path": model, **overrides}))
    return setup_then_stop(service)


def test_sandboxed_sources_read_each_sources_grader(monkeypatch: pytest.MonkeyPatch) -> None:
    cfg = load_config(None, {"tasks.sources": [{"type": "reasoning_gym"}, {"type": "math_tool", "name": "m"},
                                               {"type": "search"}]})
    assert sandboxed_sources(cfg) == []  # math, search and reasoning_gym graders run no model code
    _code_graded_math(monkeypatch)
    assert sandboxed_sources(cfg) == ["m"]


@pytest.fixture
def no_cgroup(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """This process as on a host with no usable cgroup (v1 and v2 alike)."""
    monkeypatch.setenv(cgroups.ENV, "none")
    cgroups.mode.cache_clear()
    yield
    cgroups.mode.cache_clear()


@pytest.mark.skipif(not sandbox.available(), reason="sandbox unavailable on this kernel")
def test_refuses_to_grade_model_code_without_cgroups_unless_allowed(
        monkeypatch: pytest.MonkeyPatch, no_cgroup: None, nats_server: NatsServer, redis_server: RedisServer,
        tiny_model_dir: str) -> None:
    _code_graded_math(monkeypatch)
    code = {"tasks.sources": [{"type": "math_tool"}]}
    with pytest.raises(sandbox.SandboxUnavailable, match="cgroup none: .*allow_without_cgroup"):
        _setup(code, nats_server, redis_server, tiny_model_dir)
    service = _setup({**code, "sandbox.allow_without_cgroup": True}, nats_server, redis_server, tiny_model_dir)
    assert service.consumer is not None  # the operator's explicit opt-in: setup went on to the bus


def test_sources_without_model_code_need_no_sandbox(nats_server: NatsServer, redis_server: RedisServer,
                                                    tiny_model_dir: str) -> None:
    service = _setup({"tasks.sources": [{"type": "reasoning_gym"}, {"type": "math_tool"}]},
                     nats_server, redis_server, tiny_model_dir)
    assert service.consumer is not None
