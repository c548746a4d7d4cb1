"""The generated code in trajmesh/v1 matches proto/ (regenerate with `make proto` when this fails)."""

from __future__ import annotations

import subprocess
import sys
from importlib.metadata import version
from pathlib import Path

import pytest
from repo_paths import REPO

GENERATED_DIR = REPO / "trajmesh" / "v1"
# Files protoc writes; anything else in trajmesh/v1 (e.g. __init__.py) is hand-written.
GENERATED_SUFFIXES = ("_pb2.py", "_pb2.pyi", "_pb2_grpc.py")


def _generate(out_dir: Path) -> dict[str, bytes]:
    """Run the `make proto` command into out_dir; {file name: bytes} of what it wrote."""
    protos = sorted(
        str(p.relative_to(REPO)) for p in (REPO / "proto" / "trajmesh" / "v1").glob("*.proto")
    )
    subprocess.run(
        [
            sys.executable,
            "-m",
            "grpc_tools.protoc",
            "-Iproto",
            f"--python_out={out_dir}",
            f"--pyi_out={out_dir}",
            f"--grpc_python_out={out_dir}",
            *protos,
        ],
        cwd=REPO,
        check=True,
        capture_output=True,
    )
    return {p.name: p.read_bytes() for p in (out_dir / "trajmesh" / "v1").iterdir()}


def test_generated_code_is_fresh(tmp_path: Path) -> None:
    pytest.importorskip("grpc_tools")
    fresh = _generate(tmp_path)
    committed = {
        p.name: p.read_bytes() for p in GENERATED_DIR.iterdir() if p.name.endswith(GENERATED_SUFFIXES)
    }
    # Output differs between grpcio-tools releases too, so the version is pinned in pyproject's dev extra.
    hint = (
        f"trajmesh/v1 is stale relative to proto/ (grpcio-tools {version('grpcio-tools')}): run `make proto`"
    )
    assert sorted(committed) == sorted(fresh), hint
    stale = [name for name in fresh if fresh[name] != committed[name]]
    assert not stale, f"{hint}; differing: {stale}"
