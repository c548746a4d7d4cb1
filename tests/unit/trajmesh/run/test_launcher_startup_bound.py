"""How long the launcher waits for services to become healthy: a rollout is healthy only once its
engine is, so the wait covers the engine's own start-up allowance (a vLLM-CPU server took longer
than the old fixed 180 s on a loaded 2-core machine, and the run failed at start). vLLM servers
with compile on start one after the other on a machine (rollout/engines/vllm_engine.py `StartLock`), each
with its own allowance from its own start: the wait covers them all, queued."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from trajmesh.config import load_config
from trajmesh.run.launcher import Mesh, Proc


def _proc(name: str) -> Proc:
    return Proc(name, 0, None, 0, Path("/dev/null"))  # type: ignore[arg-type]  # the bound reads names only


def _mesh(**overrides: Any) -> Mesh:
    return Mesh(load_config(None, overrides), Path("/dev/null"))


def test_a_rollout_gets_its_engines_start_up_allowance() -> None:
    mesh = _mesh(**{"rollout.engine.type": "vllm", "rollout.engine.startup_timeout_s": 300})
    assert mesh.startup_bound_s([_proc("store"), _proc("rollout")]) == 360.0
    assert mesh.startup_bound_s([_proc("store"), _proc("grader")]) == 180.0  # no rollout: the default


def test_a_short_engine_allowance_keeps_the_default() -> None:
    mesh = _mesh(**{"rollout.engine.startup_timeout_s": 30})
    assert mesh.startup_bound_s([_proc("rollout")]) == 180.0
    assert _mesh(**{"rollout.engine.type": "synthetic"}).startup_bound_s([_proc("rollout")]) == 180.0


def test_queued_compiling_vllm_starts_get_one_allowance_each() -> None:
    """The rollout's and the evaluator's vLLM servers compile one after the other: the second may be
    healthy only after both allowances (issue #43: one allowance, and the run never started)."""
    vllm = {"rollout.engine.type": "vllm", "rollout.engine.startup_timeout_s": 300}
    mesh = _mesh(**vllm)
    assert mesh.startup_bound_s([_proc("store"), _proc("rollout"), _proc("evaluator")]) == 2 * 300 + 60
    assert mesh.startup_bound_s([_proc("rollout"), _proc("rollout"), _proc("evaluator")]) == 3 * 300 + 60
    # Starts that do not queue: compile off (-O0), or a server at a URL that no process starts
    assert _mesh(**vllm, **{"rollout.engine.compile": False}).startup_bound_s(
        [_proc("rollout"), _proc("evaluator")]) == 360.0
    assert _mesh(**vllm, **{"rollout.engine.url": "http://127.0.0.1:1"}).startup_bound_s(
        [_proc("rollout"), _proc("evaluator")]) == 360.0
