"""Every repository path the docs name exists: README.md, CONTRIBUTING.md and docs/*.md, checked
for the paths they write in backticks or link to (a moved or deleted file fails here, not in a
reader's hands). Placeholders (`envs/<source>.py`), globs (`weights/v*/`) and a run's outputs
(`runs/...`, paths under a RUN_DIR) are not repository paths and are skipped."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from repo_paths import REPO

DOCS = sorted([REPO / "README.md", REPO / "CONTRIBUTING.md", *(REPO / "docs").glob("*.md")])
TOP = ("trajmesh", "services", "rollout", "learner", "envs", "graders", "tests", "deploy", "docs", "bench",
       "examples", "docker", "proto", ".ci")
"""Top-level folders of the repository: a backticked token starting with one names a file or folder."""
CODE = re.compile(r"`([^`\s]+)`")
LINK = re.compile(r"\]\(([^)\s#]+)(?:#[^)]*)?\)")


def _named_paths(text: str) -> set[str]:
    found = set()
    for token in CODE.findall(text) + LINK.findall(text):
        token = token.rstrip(".,:;)")
        token = token.split("::")[0]  # `envs/search.py::SearchSource`
        if "://" in token or any(ch in token for ch in "<>*{}$[]|=~"):
            continue
        if token.split("/")[0] in TOP and "/" in token:
            found.add(token)
        elif token.endswith(".md") and "/" not in token:
            found.add(token)
    return found


def test_the_docs_name_paths() -> None:
    assert (REPO / "docs" / "ARCHITECTURE.md").is_file() and (REPO / "CONTRIBUTING.md").is_file()
    named = {p for doc in DOCS for p in _named_paths(doc.read_text())}
    assert len(named) > 50, sorted(named)  # the extraction works: these docs name many files


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: str(p.relative_to(REPO)))
def test_every_path_a_doc_names_exists(doc: Path) -> None:
    missing = []
    for name in sorted(_named_paths(doc.read_text())):
        candidates = [REPO / name, doc.parent / name]
        if not any(c.exists() for c in candidates):
            missing.append(name)
    assert missing == [], f"{doc.relative_to(REPO)} names paths that do not exist: {missing}"
