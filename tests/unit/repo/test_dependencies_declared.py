"""Every third-party module the project imports is declared in pyproject.toml.

CI installs from a clean checkout, so a module that is only present because someone
pip-installed it by hand fails there, not here. This test catches that here.
"""
from __future__ import annotations

import ast
import importlib.metadata as md
import re
import sys

import tomllib
from repo_paths import REPO

SOURCES = ["trajmesh", "learner", "rollout", "envs", "graders", "services", "tests", "bench"]
# Modules of this repository that are imported by their own name: the package, the bench scripts and
# every module under tests/ (pytest puts tests/ and each test file's folder on sys.path).
LOCAL = {"trajmesh", "bench"} | {p.stem for p in (REPO / "tests").rglob("*.py")}
# Installed only in the GPU image (extra [gpu]) and imported lazily there; verifiers and datasets
# (extra [verifiers]) only in a venv without [dev] (verifiers 0.4 pins openai < 3).
OPTIONAL_RUNTIME = {"sglang", "verifiers", "datasets"}


def _norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _top_level_imports() -> dict[str, str]:
    found: dict[str, str] = {}
    for folder in SOURCES:
        for path in sorted((REPO / folder).rglob("*.py")):
            if "_pb2" in path.name:
                continue
            tree = ast.parse(path.read_text(), filename=str(path))
            for node in ast.walk(tree):
                if isinstance(node, ast.Import):
                    names = [a.name for a in node.names]
                elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                    names = [node.module]
                else:
                    continue
                for name in names:
                    found.setdefault(name.split(".")[0], str(path.relative_to(REPO)))
    return found


def _declared() -> set[str]:
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    reqs = list(project["dependencies"])
    for extra in project["optional-dependencies"].values():
        reqs += extra
    return {_norm(re.split(r"[\s\[<>=!~;]", r, maxsplit=1)[0]) for r in reqs}


def _closure(names: set[str]) -> set[str]:
    """Declared distributions plus what they pull in (protobuf brings `google`, etc.)."""
    seen: set[str] = set()
    todo = list(names)
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        seen.add(name)
        try:
            requires = md.requires(name) or []
        except md.PackageNotFoundError:
            continue
        for req in requires:
            if "extra ==" in req:
                continue
            todo.append(_norm(re.split(r"[\s\[<>=!~;(]", req, maxsplit=1)[0]))
    return seen


def test_every_third_party_import_is_declared() -> None:
    dists_of = md.packages_distributions()
    declared = _declared()
    allowed = _closure(declared)
    missing = []
    for module, where in sorted(_top_level_imports().items()):
        if module in sys.stdlib_module_names or module in LOCAL or module in OPTIONAL_RUNTIME:
            continue
        dists = {_norm(d) for d in dists_of.get(module, [])}
        if not dists:
            missing.append(f"{module} (imported in {where}) is not installed from any distribution")
        elif not dists & allowed:
            missing.append(f"{module} (imported in {where}) comes from {sorted(dists)}, not declared in pyproject.toml")
    assert not missing, "\n".join(missing)


def test_the_check_sees_an_undeclared_module() -> None:
    # math_verify is declared; removing it from the declared set must make it undeclared,
    # so the check above can fail.
    dists = {_norm(d) for d in md.packages_distributions().get("math_verify", [])}
    assert dists and dists <= _closure(_declared())
    assert not dists & _closure(_declared() - {"math-verify"})
