"""Where published weights live on the shared volume: the one place their names are spelled.

::

    RUN_DIR/weights/
      v000012-1764892345123456789/   version 12, renamed in whole once written (the number after
                                     the dash: time.time_ns() of that save, so a learner replaying a
                                     version after a crash never rewrites a directory an engine reads)
        model.safetensors.sha256     the checksum of its full model.safetensors, recorded while the
                                     learner streamed it: what the announcement carries
      .v000013.tmp-4242/             version 13 being written by pid 4242 (never read, never pruned)

Zero-padded versions sort by name; for one version, the later save sorts last.
"""

from __future__ import annotations

import hashlib
import os
import time
from pathlib import Path

WEIGHTS_DIR = "weights"
"""The folder of RUN_DIR that holds every published version."""
CHECKSUM_NAME = "model.safetensors.sha256"
"""In a version directory: the sha256 (hex) of its full model.safetensors, written with it."""


def weights_root(run_dir: str | os.PathLike[str]) -> Path:
    """RUN_DIR/weights."""
    return Path(run_dir) / WEIGHTS_DIR


def version_dir_name(version: int, ns: int | None = None) -> str:
    """The name a save of `version` is published under (`ns`: now, by default)."""
    return f"v{version:06d}-{time.time_ns() if ns is None else ns}"


def temp_dir_name(version: int, pid: int | None = None) -> str:
    """The hidden name `version` is written under by process `pid` (this one by default)."""
    return f".v{version:06d}.tmp-{os.getpid() if pid is None else pid}"


def version_dirs(root: str | os.PathLike[str], version: int | None = None) -> list[Path]:
    """The published version directories under `root` (a weights root), oldest first; only those
    of `version` when given (a version saved twice has two, the later one last)."""
    pattern = "v*" if version is None else f"v{version:06d}-*"
    return sorted(p for p in Path(root).glob(pattern) if p.is_dir())


def latest_version_dir(root: str | os.PathLike[str]) -> Path | None:
    """The newest published version directory under `root`, or None."""
    dirs = version_dirs(root)
    return dirs[-1] if dirs else None


def sha256_file(path: str | os.PathLike[str], block: int = 1 << 20) -> str:
    """sha256 (hex) of a file, read in blocks."""
    sha = hashlib.sha256()
    with open(path, "rb") as fh:
        while chunk := fh.read(block):
            sha.update(chunk)
    return sha.hexdigest()


def checksum(version_dir: str | os.PathLike[str]) -> str:
    """What an announcement of `version_dir` carries: the recorded `CHECKSUM_NAME`; for a directory
    without one (the base model), the sha256 of its model.safetensors, or of nothing when it has
    none (a model stored otherwise)."""
    d = Path(version_dir)
    if (d / CHECKSUM_NAME).exists():
        return (d / CHECKSUM_NAME).read_text().strip()
    st = d / "model.safetensors"
    return sha256_file(st) if st.exists() else hashlib.sha256().hexdigest()

