"""The contract, configs and the service-side modules import without torch (STYLE.md habit 6)."""

from __future__ import annotations

import importlib.util
import subprocess
import sys

import pytest

# Modules the store, grader and environment services import. Add new torch-free modules here.
# Modules that do not exist yet are skipped (find_spec returns None), so the list can name
# modules before they land; once they exist the check applies to them automatically.
TORCH_FREE_MODULES = [
    "trajmesh.contract",
    "trajmesh.manifest",
    "trajmesh.config",
    "trajmesh.gate",
    "trajmesh.bus",
]
FORBIDDEN_MODULES = ["torch"]


@pytest.mark.parametrize("module", TORCH_FREE_MODULES)
def test_module_imports_without_torch(module: str) -> None:
    if importlib.util.find_spec(module) is None:
        pytest.skip(f"{module} does not exist yet")
    # A fresh interpreter: this test process may already hold torch from other tests.
    check = (
        f"import sys, {module}; "
        f"loaded = [m for m in {FORBIDDEN_MODULES!r} if m in sys.modules]; "
        f"assert not loaded, f'{module} imported {{loaded}}'"
    )
    result = subprocess.run([sys.executable, "-c", check], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
