"""The import graph of the installed packages keeps the layering of docs/ARCHITECTURE.md: no
import cycle between files, and no folder imports a folder above it (core < envs < graders <
rollout < learner < services < run). Every `import` and `from … import` counts, in functions too
(a lazy import is still an arrow); imports under `if TYPE_CHECKING:` do not (they never run).
Modules are read from the source folders the `package-dir` mapping installs, so tools that read
folders and this test see the same graph. Plug-in strings ("module:attr", resolved at run time by
`trajmesh.plugins.load`) are arrows too: each must name something that exists, and one pointing
upward only in a plug-in record or the registry's tables (below)."""

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


# ---------------------------------------------------------------------------- plug-in strings
# "module:attr" (and bare module names) that `trajmesh.plugins.load` resolves at run time: an
# arrow the import statements above do not show. Where one points upward it must be a declaration
# the registry resolves lazily: an argument of a `SourcePlugin(...)` / `EnginePlugin(...)` record, or
# one of the registry's own tables in trajmesh/plugins.py. Anywhere else it is a hidden upward import.
PLUGIN_RECORDS = ("SourcePlugin", "EnginePlugin")
REGISTRY_TABLES = {"trajmesh.plugins": ("BUILTIN_SOURCES", "STANDALONE_GRADERS")}


def _plugin_strings(module: str, tree: ast.AST, mods: dict[str, Path]) -> list[tuple[str, str, bool]]:
    """(target module, the string, declared?) for each string naming a module of ours."""
    declared: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in PLUGIN_RECORDS:
            declared.update(id(n) for arg in [*node.args, *node.keywords] for n in ast.walk(arg))
        if isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            if any(isinstance(t, ast.Name) and t.id in REGISTRY_TABLES.get(module, ()) for t in targets):
                declared.update(id(n) for n in ast.walk(node))
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            target, _, attr = node.value.partition(":")
            named = all(part.isidentifier() for part in attr.split(".")) if attr else ":" not in node.value
            if named and "." in target and target in mods and target != module and (attr or target.count(".") >= 2):
                found.append((target, node.value, id(node) in declared))
    return found


def _top_level_names(path: Path) -> set[str]:
    names = set()
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, ast.Assign):
            names.update(t.id for t in node.targets if isinstance(t, ast.Name))
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            names.add(node.target.id)
        elif isinstance(node, ast.ImportFrom):
            names.update(a.asname or a.name for a in node.names)
    return names


def _upward_plugin_strings(mods: dict[str, Path]) -> list[str]:
    bad = []
    for module, path in sorted(mods.items()):
        for target, text, declared in _plugin_strings(module, ast.parse(path.read_text()), mods):
            if not declared and LAYERS.index(_layer(target)) > LAYERS.index(_layer(module)):
                bad.append(f"{module}: {text!r}")
    return bad


def test_plugin_strings_resolve_and_point_upward_only_from_declarations() -> None:
    mods = _modules()
    strings = [(m, *s) for m, p in mods.items() for s in _plugin_strings(m, ast.parse(p.read_text()), mods)]
    assert len(strings) > 20, "the plug-in strings were not found"
    missing = [f"{m}: {text!r}" for m, target, text, _ in strings
               if ":" in text and text.split(":", 1)[1].split(".")[0] not in _top_level_names(mods[target])]
    assert missing == [], "plug-in strings naming nothing"
    assert _upward_plugin_strings(mods) == []


def test_an_upward_plugin_string_outside_a_declaration_is_found(tmp_path: Path) -> None:
    """The check above, against a planted module: envs naming a grader outside a plug-in record."""
    mods = _modules()
    planted = tmp_path / "planted.py"
    planted.write_text('GRADER = "trajmesh.graders.math:MathGrader"\n'
                       'PLUGIN = SourcePlugin(graders={"math": "trajmesh.graders.math:MathGrader"})\n')
    assert _upward_plugin_strings({**mods, "trajmesh.envs.planted": planted}) == [
        "trajmesh.envs.planted: 'trajmesh.graders.math:MathGrader'"]
