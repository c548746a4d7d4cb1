"""The contract, configs and the service-side modules import without torch (STYLE.md habit 6).

Checked: the store, grader and environment services (each in its own fresh interpreter, as it runs
in its container), and every module of the core package `trajmesh` and of `trajmesh.envs` and
`trajmesh.graders`, discovered from the source tree, so a new module is covered the day it lands.
Nothing is skipped: a module listed here that does not import is a failure.
"""

from __future__ import annotations

import pkgutil
import subprocess
import sys
from pathlib import Path

import pytest
from repo_paths import REPO

from trajmesh.sandbox import PROGRAMS

FORBIDDEN_MODULES = ["torch"]
SERVICES = ["trajmesh.services.store.service", "trajmesh.services.grader", "trajmesh.services.environment"]
# Packages whose every module must import without torch: (import name, source folder).
TORCH_FREE_PACKAGES = [("trajmesh", REPO / "trajmesh"), ("trajmesh.envs", REPO / "envs"),
                       ("trajmesh.graders", REPO / "graders")]


def _modules(package: str, folder: Path) -> list[str]:
    found = [package]
    for info in pkgutil.walk_packages([str(folder)], package + "."):
        if info.name.startswith("trajmesh.v1"):  # generated protobuf code, checked via contract
            continue
        if info.name.rpartition(".")[2] in PROGRAMS and info.name.startswith("trajmesh.sandbox."):
            continue  # the sandbox's programs: their text runs in a call, importing one raises
        found.append(info.name)
    return found


CORE_MODULES = [m for package, folder in TORCH_FREE_PACKAGES for m in _modules(package, folder)]


def _check_in_fresh_interpreter(modules: list[str]) -> None:
    """Import ``modules`` in order in a new interpreter (this one may hold torch already) and fail
    naming the first one after which a forbidden module is loaded."""
    check = (
        "import importlib, sys\n"
        f"for name in {modules!r}:\n"
        "    importlib.import_module(name)\n"
        f"    loaded = [m for m in {FORBIDDEN_MODULES!r} if m in sys.modules]\n"
        "    assert not loaded, f'{name} imported {loaded}'\n"
    )
    result = subprocess.run([sys.executable, "-c", check], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]


def test_the_lists_are_not_empty() -> None:
    assert {"trajmesh.contract", "trajmesh.config", "trajmesh.gate", "trajmesh.bus"} <= set(CORE_MODULES)
    assert len(CORE_MODULES) > 20, CORE_MODULES


@pytest.mark.parametrize("service", SERVICES)
def test_service_imports_without_torch(service: str) -> None:
    _check_in_fresh_interpreter([service])


def test_every_core_env_and_grader_module_imports_without_torch() -> None:
    _check_in_fresh_interpreter(CORE_MODULES)


def test_a_config_and_the_services_that_draw_no_tasks_load_no_task_generator() -> None:
    """reasoning-gym (with sympy and matplotlib, ≈ 1.5 s of CPU a process) is imported by the
    processes that draw or score tasks, on first use, not by every process that loads a config: the
    default config names a reasoning_gym source, whose plug-in is loaded to validate it."""
    check = (
        "import sys\n"
        "from trajmesh.config import load_config\n"
        "cfg = load_config(None, {})\n"
        "assert cfg.tasks.sources[0].type == 'reasoning_gym'\n"
        "import trajmesh.services.environment, trajmesh.services.rollout\n"
        "loaded = [m for m in ('reasoning_gym', 'sympy', 'matplotlib') if m in sys.modules]\n"
        "assert not loaded, loaded\n"
        "from trajmesh.envs import chain_sum\n"
        "task = chain_sum.make_tasks(3, 1)[0]\n"
        "assert chain_sum.score(task['answer'], task) == 1.0 and 'reasoning_gym' in sys.modules\n"
    )
    result = subprocess.run([sys.executable, "-c", check], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]


@pytest.mark.parametrize("program", PROGRAMS)
def test_a_sandbox_program_refuses_to_be_imported(program: str) -> None:
    """Its text runs inside a call (the init would set signals, mount and exit in the importer)."""
    result = subprocess.run([sys.executable, "-c", f"import trajmesh.sandbox.{program}"], capture_output=True,
                            text=True, timeout=120)
    assert result.returncode == 1 and "is a program the sandbox runs" in result.stderr, result.stderr[-2000:]

