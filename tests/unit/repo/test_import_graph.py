"""The import graph of the installed packages keeps the layering of docs/ARCHITECTURE.md: no
import cycle between files, and no folder imports a folder above it (core < envs < graders <
rollout < learner < services < run). Every `import` and `from … import` counts, in functions too
(a lazy import is still an arrow); imports under `if TYPE_CHECKING:` do not (they never run).
Modules are read from the source folders the `package-dir` mapping installs, so tools that read
folders and this test see the same graph."""

from __future__ import annotations

import ast
from pathlib import Path

from repo_paths import REPO

FOLDERS = {"trajmesh": "trajmesh", "envs": "trajmesh.envs", "graders": "trajmesh.graders",
           "rollout": "trajmesh.rollout", "learner": "trajmesh.learner", "services": "trajmesh.services"}
LAYERS = ["core", "envs", "graders", "rollout", "learner", "services", "run"]
"""Bottom to top: a module may import its own layer and the layers below it."""


def _modules() -> dict[str, Path]:
    mods = {}
    for folder, package in FOLDERS.items():
        for path in (REPO / folder).rglob("*.py"):
            rel = path.relative_to(REPO / folder).with_suffix("")
            if folder == "trajmesh" and rel.parts[0] == "v1":
                continue  # generated protobuf code
            parts = [p for p in rel.parts if p != "__init__"]
            mods[".".join([package, *parts])] = path
    return mods


def _layer(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 and parts[1] in LAYERS else "core"


def _runtime_imports(tree: ast.AST) -> list[str]:
    """Names imported outside `if TYPE_CHECKING:` blocks."""
    skip: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            skip.update(id(n) for stmt in node.body for n in ast.walk(stmt))
    names = []
    for node in ast.walk(tree):
        if id(node) in skip:
            continue
        if isinstance(node, ast.Import):
            names += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names += [node.module] + [f"{node.module}.{a.name}" for a in node.names]
    return names


def _graph() -> dict[str, set[str]]:
    mods = _modules()
    return {m: {n for n in _runtime_imports(ast.parse(p.read_text())) if n in mods and n != m}
            for m, p in mods.items()}


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                found.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_the_graph_is_read() -> None:
    graph = _graph()
    assert len(graph) > 80 and sum(map(len, graph.values())) > 200, len(graph)
    assert "trajmesh.contract" in graph["trajmesh.services.store.service"]
    assert _cycles({"a": {"b"}, "b": {"a"}, "c": {"a"}}) == [["a", "b"]]


def test_no_import_cycle_between_files() -> None:
    assert _cycles(_graph()) == []


def test_no_folder_imports_a_folder_above_it() -> None:
    upward = [f"{a} -> {b}" for a, targets in sorted(_graph().items()) for b in sorted(targets)
              if LAYERS.index(_layer(b)) > LAYERS.index(_layer(a))]
    assert upward == []


def test_rollout_and_envs_never_import_the_learner() -> None:
    bad = [f"{a} -> {b}" for a, targets in sorted(_graph().items()) for b in sorted(targets)
           if _layer(a) in ("rollout", "envs") and _layer(b) == "learner"]
    assert bad == []
