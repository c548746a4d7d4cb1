"""Guard rails for the config module: every field is documented where it is declared, and every
shipped example config loads.

config.py promises "every field is documented under its declaration"; this reads the source, so a
new field without a docstring fails here with its class and name.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
from repo_paths import REPO

from trajmesh import config as config_module
from trajmesh.config import load_config


def _undocumented_fields(source: str) -> list[str]:
    missing = []
    for node in ast.parse(source).body:
        if not isinstance(node, ast.ClassDef):
            continue
        for i, stmt in enumerate(node.body):
            if not (isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name)):
                continue
            nxt = node.body[i + 1] if i + 1 < len(node.body) else None
            documented = (isinstance(nxt, ast.Expr) and isinstance(nxt.value, ast.Constant)
                          and isinstance(nxt.value.value, str) and nxt.value.value.strip() != "")
            if not documented:
                missing.append(f"{node.name}.{stmt.target.id} (line {stmt.lineno})")
    return missing


def test_every_config_field_has_a_docstring():
    source = Path(config_module.__file__).read_text()
    assert _undocumented_fields(source) == []


def _plugin_config_classes() -> list[type]:
    from trajmesh import plugins

    classes = ([p.config for p in plugins.sources().values()]
               + [p.config for p in plugins.ENGINES.values()])
    nested = [f.annotation for c in classes for f in c.model_fields.values()  # e.g. SyntheticTiming
              if isinstance(f.annotation, type) and issubclass(f.annotation, config_module.BaseModel)
              and f.annotation.__module__ != config_module.__name__]
    return classes + [n for n in dict.fromkeys(nested) if n not in classes]


@pytest.mark.parametrize("cls", _plugin_config_classes(), ids=lambda c: c.__name__)
def test_every_plugin_config_field_has_a_docstring(cls: type):
    """A source's config class lives in its own module (envs/<source>.py), outside config.py: its
    fields are documented where they are declared too (and its bases' fields, wherever they live)."""
    import inspect

    for klass in cls.__mro__:
        if not (isinstance(klass, type) and issubclass(klass, config_module.BaseModel)) \
                or klass.__module__.startswith("pydantic"):
            continue
        source = Path(inspect.getfile(klass)).read_text()
        missing = [m for m in _undocumented_fields(source) if m.startswith(klass.__name__ + ".")]
        assert missing == [], f"{klass.__module__}: {missing}"


def test_the_docstring_check_finds_an_undocumented_field():
    source = 'class A(_Strict):\n    x: int = 1\n    """documented"""\n    y: int = 2\n    z: int = 3\n    """z"""\n'
    assert _undocumented_fields(source) == ["A.y (line 4)"]


def test_config_classes_are_all_seen_by_the_check():
    # The check walks top-level classes; a model nested elsewhere would escape it.
    declared = {n.name for n in ast.parse(Path(config_module.__file__).read_text()).body
                if isinstance(n, ast.ClassDef)}
    models = {obj.__name__ for obj in vars(config_module).values()
              if isinstance(obj, type) and issubclass(obj, config_module.BaseModel)
              and obj.__module__ == config_module.__name__}
    assert models <= declared


@pytest.mark.parametrize("path", sorted((REPO / "examples").rglob("*.yaml")), ids=lambda p: p.name)
def test_every_example_config_loads(path: Path):
    cfg = load_config(path)
    assert cfg.run_dir


def test_examples_folder_has_configs():
    assert sorted((REPO / "examples").glob("*.yaml")), "no example config found"


def test_every_registered_source_config_field_has_a_docstring():
    # A source's config class may live in its own module (trajmesh/plugins.py); the check follows it.
    import inspect

    from trajmesh import plugins

    for plugin in plugins.sources().values():
        cls = plugin.config
        source = inspect.getsource(inspect.getmodule(cls))  # type: ignore[arg-type]
        missing = [m for m in _undocumented_fields(source) if m.startswith(f"{cls.__name__}.")]
        assert missing == [], plugin.type
