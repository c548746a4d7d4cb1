"""The environment service checks the sandbox at start-up when a configured source runs model code:
without cgroup v2 delegation it refuses (SandboxUnavailable) unless sandbox.allow_without_cgroup."""

from __future__ import annotations

import pytest
from mesh_checks import setup_then_stop

from trajmesh import sandbox
from trajmesh.config import load_config
from trajmesh.services.environment import EnvironmentService


def _setup(overrides: dict) -> EnvironmentService:
    service = EnvironmentService(load_config(None, overrides))
    return setup_then_stop(service)


@pytest.mark.skipif(not sandbox.cgroup_problem(), reason="this host delegates cgroup v2: nothing to refuse")
def test_refuses_to_run_model_code_without_cgroups_unless_allowed():
    math = {"tasks.sources": [{"type": "math_tool"}]}
    with pytest.raises(sandbox.SandboxUnavailable, match="allow_without_cgroup"):
        _setup(math)
    _setup({**math, "sandbox.allow_without_cgroup": True})  # the operator's explicit opt-in


def test_sources_without_model_code_need_no_sandbox():
    _setup({"tasks.sources": [{"type": "reasoning_gym"}, {"type": "search"}]})
