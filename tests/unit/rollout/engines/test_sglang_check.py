"""``make gpu-check`` (rollout/engines/sglang_check.py) runs with the GPU image's own Python and the tests
installed beside it, not the source checkout's: here from a directory laid out as the image
installs it, against a stand-in ``sglang.launch_server`` that serves the recorded SGLang 0.5.23
(tests/sglang_fixture_server.py)."""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
from pathlib import Path

from repo_paths import REPO

from trajmesh.infra import free_port
from trajmesh.rollout.engines import sglang_check

PROBE_TEST = '''
import json, os, urllib.request
import pytest

@pytest.mark.gpu
def test_server_answers():
    with urllib.request.urlopen(os.environ["TRAJMESH_SGLANG_URL"] + "/server_info") as r:
        info = json.load(r)
    assert info["version"] == "0.5.23"
    assert os.environ["TRAJMESH_SGLANG_MODEL"] == "/models/m"
    open(os.environ["PROBE_RAN"], "w").write("ran")
'''


def _installed_layout(tmp: Path) -> tuple[Path, Path]:
    """(tests root as the image installs it, a directory with a stand-in `sglang` package)."""
    share = tmp / "prefix" / "share" / "trajmesh"
    (share / "tests").mkdir(parents=True)
    (share / "tests" / "test_probe_gpu.py").write_text(PROBE_TEST)
    (share / "pyproject.toml").write_text('[tool.pytest.ini_options]\naddopts = "--strict-markers"\n'
                                          'markers = ["gpu: needs a CUDA device"]\n')
    fake = tmp / "fake"
    (fake / "sglang").mkdir(parents=True)
    (fake / "sglang" / "__init__.py").write_text("")
    (fake / "sglang" / "launch_server.py").write_text(
        "import sglang_fixture_server\nsglang_fixture_server.main()\n")
    return share, fake


def test_gpu_check_runs_the_installed_tests_against_the_server(tmp_path: Path):
    share, fake = _installed_layout(tmp_path)
    port = free_port()
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(fake), str(REPO / "tests")]),
               PROBE_RAN=str(tmp_path / "ran"))
    rc = subprocess.call([sys.executable, "-m", "trajmesh.rollout.engines.sglang_check", "--model", "/models/m",
                          "--port", str(port), "--startup-s", "60", "--log", str(tmp_path / "sglang.log"),
                          "--tests-root", str(share)], cwd=tmp_path, env=env, timeout=180)
    assert rc == 0, (tmp_path / "sglang.log").read_text()
    assert (tmp_path / "ran").read_text() == "ran"
    with socket.socket() as s:  # the server was stopped
        assert s.connect_ex(("127.0.0.1", port)) != 0


def test_gpu_check_refuses_a_python_without_sglang_or_tests(tmp_path: Path):
    share, _ = _installed_layout(tmp_path)
    run = [sys.executable, "-m", "trajmesh.rollout.engines.sglang_check", "--model", "/models/m", "--port", str(free_port())]
    no_sglang = subprocess.run([*run, "--tests-root", str(share)], cwd=tmp_path, capture_output=True, text=True,
                               env=dict(os.environ, PYTHONPATH=""), timeout=120)
    assert no_sglang.returncode == 2 and "SGLang is not installed" in no_sglang.stderr
    no_tests = subprocess.run([*run, "--tests-root", str(tmp_path / "nowhere")], cwd=tmp_path,
                              capture_output=True, text=True, timeout=120)
    assert no_tests.returncode == 2 and "no tests/" in no_tests.stderr
    assert sglang_check.INSTALLED_TESTS == Path(sys.prefix) / "share" / "trajmesh"


def test_image_installs_the_check_and_make_uses_its_python():
    """The GPU image puts tests/ and pyproject.toml where the check looks (its venv's
    share/trajmesh) with pytest; `make gpu-check` does not build the project venv over SGLang."""
    docker = (REPO / "docker" / "Dockerfile.gpu").read_text()
    venv = re.search(r"python3\.\d+ -m venv (\S+)", docker).group(1)  # type: ignore[union-attr]
    assert re.search(rf"^COPY tests/ {venv}/share/trajmesh/tests/$", docker, flags=re.M)
    assert re.search(rf"^COPY pyproject.toml {venv}/share/trajmesh/$", docker, flags=re.M)
    assert re.search(r"^\s+\"pytest>=", docker, flags=re.M)  # installed with the learner extras
    make = (REPO / "Makefile").read_text()
    target = re.search(r"^gpu-check:(.*)\n((?:\t.*\n)+)", make, flags=re.M)
    assert target is not None
    prerequisites, recipe = target.groups()
    assert "setup" not in prerequisites.split()
    assert "$(PY)" not in recipe and ".venv" not in recipe and "$(GPU_PYTHON) -m trajmesh.rollout.engines.sglang_check" in recipe
