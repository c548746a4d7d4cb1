"""The environment service checks the sandbox at start-up when a configured source runs model code:
it logs the cgroup mode that holds (v2, v1), and without one it refuses (SandboxUnavailable) unless
sandbox.allow_without_cgroup."""

from __future__ import annotations

import logging
from collections.abc import Iterator

import pytest
from mesh_checks import setup_then_stop

from trajmesh import sandbox
from trajmesh.config import load_config
from trajmesh.sandbox import cgroups
from trajmesh.services.environment import EnvironmentService


def _setup(overrides: dict) -> EnvironmentService:
    service = EnvironmentService(load_config(None, overrides))
    return setup_then_stop(service)


@pytest.fixture
def no_cgroup(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """This process as on a host with no usable cgroup (v1 and v2 alike)."""
    monkeypatch.setenv(cgroups.ENV, "none")
    cgroups.mode.cache_clear()
    yield
    monkeypatch.undo()
    cgroups.mode.cache_clear()


@pytest.mark.skipif(not sandbox.available(), reason="sandbox unavailable on this kernel")
def test_refuses_to_run_model_code_without_cgroups_unless_allowed(no_cgroup: None) -> None:
    math = {"tasks.sources": [{"type": "math_tool"}]}
    with pytest.raises(sandbox.SandboxUnavailable, match="cgroup none: .*allow_without_cgroup"):
        _setup(math)
    _setup({**math, "sandbox.allow_without_cgroup": True})  # the operator's explicit opt-in


@pytest.mark.skipif(not sandbox.available() or sandbox.cgroup_mode().kind == "none",
                    reason="no per-call cgroup on this host")
def test_starts_with_the_hosts_cgroup_mode_and_logs_it(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO):
        _setup({"tasks.sources": [{"type": "math_tool"}]})  # no opt-in needed where a mode holds
    assert f"sandbox: cgroup {sandbox.cgroup_mode().kind}: " in caplog.text


def test_sources_without_model_code_need_no_sandbox():
    _setup({"tasks.sources": [{"type": "reasoning_gym"}, {"type": "search"}]})
