"""Each package's `__init__` docstring is the map of its folder (issue #42): it names every module
and sub-package there, and every file it names exists. A module added without a line on the map,
or a map naming a file that moved, fails here."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest
from repo_paths import REPO

PACKAGES = ["trajmesh", "trajmesh/run", "trajmesh/sandbox", "trajmesh/weights", "learner", "envs", "graders", "rollout",
            "rollout/engines", "rollout/agents", "services", "services/store"]
FILE = re.compile(r"(?<![\w/.])((?:[\w.-]+/)*[\w-]+\.py)\b")


def _doc(folder: Path) -> str:
    return ast.get_docstring(ast.parse((folder / "__init__.py").read_text())) or ""


def _members(folder: Path) -> list[str]:
    modules = [p.stem for p in folder.glob("*.py") if p.name != "__init__.py"]
    subpackages = [p.name for p in folder.iterdir() if (p / "__init__.py").is_file() and p.name != "v1"]
    return sorted(modules + subpackages)


def _missing(folder: Path) -> list[str]:
    doc = _doc(folder)
    return [m for m in _members(folder) if not re.search(rf"(?<!\w){re.escape(m)}\b", doc)]


def _named_files(folder: Path) -> list[str]:
    return sorted(set(FILE.findall(_doc(folder))))


@pytest.mark.parametrize("package", PACKAGES)
def test_the_map_names_every_module_of_its_folder(package: str) -> None:
    folder = REPO / package
    assert len(_doc(folder).splitlines()) >= 3, f"{package}/__init__.py has no map, only a label"
    assert _missing(folder) == [], f"{package}/__init__.py's map does not name them"


@pytest.mark.parametrize("package", PACKAGES)
def test_every_file_a_map_names_exists(package: str) -> None:
    folder = REPO / package
    gone = [name for name in _named_files(folder) if not ((folder / name).exists() or (REPO / name).exists())]
    assert gone == [], f"{package}/__init__.py names files that do not exist"


def test_an_unmapped_module_and_a_gone_file_are_found(tmp_path: Path) -> None:
    (tmp_path / "__init__.py").write_text('"""A map.\n\n    kept.py   here\n    gone.py   moved away\n"""\n')
    (tmp_path / "kept.py").write_text("")
    (tmp_path / "new_module.py").write_text("")
    assert _missing(tmp_path) == ["new_module"]
    assert [n for n in _named_files(tmp_path) if not (tmp_path / n).exists()] == ["gone.py"]
