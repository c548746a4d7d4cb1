"""The store owns its record (issue #42): no module outside services/store/ names a key of the
store's Redis record, neither through `RedisKeys` nor spelt out. Other services go through
`services/store/record.py`; the gate names only its own counters (`trajmesh.gate.gate_prefix`)."""

from __future__ import annotations

import ast
import re
from pathlib import Path

from repo_paths import REPO

from trajmesh.services.store.keys import RedisKeys

CODE = ["trajmesh", "learner", "rollout", "envs", "graders", "services"]
STORE = REPO / "services" / "store"


def _key_names() -> list[str]:
    """Every key name of the record, read from RedisKeys itself (properties and per-group keys)."""
    keys = RedisKeys("")
    names = [getattr(keys, n) for n, v in vars(RedisKeys).items() if isinstance(v, property) and n != "gate_prefix"]
    names += [keys.group_received("G").split(":G")[0] + ":", keys.group_valid("G").split(":G")[0] + ":"]
    return sorted(set(names))


def _violations(path: Path, names: list[str]) -> list[str]:
    tree = ast.parse(path.read_text())
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.endswith("services.store.keys"):
            found.append(f"imports {node.module}")
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            spelt = [n for n in names if re.search(rf"(^|:){re.escape(n)}($|:|\b)", node.value)]
            if spelt:
                found.append(f"spells {spelt[0]!r}")
    return found


def test_no_module_outside_the_store_names_a_store_key() -> None:
    names = _key_names()
    assert "trajmesh:run_finished" in names and "trajmesh:tasks" in names and len(names) > 10, names
    bad = [f"{p.relative_to(REPO)}: {v}" for folder in CODE for p in sorted((REPO / folder).rglob("*.py"))
           if STORE not in p.parents and "v1" not in p.parts for v in _violations(p, names)]
    assert bad == []


def test_a_module_naming_a_store_key_is_found(tmp_path: Path) -> None:
    names = _key_names()
    planted = tmp_path / "planted.py"
    planted.write_text('from trajmesh.services.store.keys import RedisKeys\nKEY = "trajmesh:run_finished"\n'
                       'OTHER = "trajmesh:gate"\n')
    assert _violations(planted, names) == ["imports trajmesh.services.store.keys", "spells 'trajmesh:run_finished'"]
