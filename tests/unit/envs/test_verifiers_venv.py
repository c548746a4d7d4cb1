"""The verifiers source's tests, run in their own venv as one test of the main suite.

verifiers 0.4 pins openai < 3, which the dev extra's agent frameworks cannot share a venv with, so
tests/unit/envs/test_env_verifiers.py and tests/e2e/test_e2e_verifiers.py skip in the main venv and
run in ``.venv-verifiers`` (``make setup-verifiers-mesh``: verifiers, torch and the learner). This
test runs them there with the session's own marker expression (``make test``: not slow, not gpu;
``make test-all``: everything) and fails when one fails, errs, skips or none ran.

It is collected last (``RUN_LAST``, tests/conftest.py), so under ``make test``'s two workers it is the
last scope handed out: the worker that finishes the unit modules takes it while the other still runs
the meshes, instead of the whole suite waiting for it afterwards (about 220 s on 2 cores)."""

from __future__ import annotations

import os
import subprocess
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest
from repo_paths import REPO

RUN_LAST = True
VERIFIERS_PY = REPO / ".venv-verifiers" / "bin" / "python"
FILES = ("tests/unit/envs/test_env_verifiers.py", "tests/e2e/test_e2e_verifiers.py")
PARENT_ONLY = ("PYTEST_XDIST_WORKER", "PYTEST_XDIST_WORKER_COUNT", "PYTEST_XDIST_TESTRUNUID", "PYTEST_CURRENT_TEST")
"""What this session's worker sets for itself, which the child session must not read as its own."""


@pytest.mark.timeout(1500)
def test_verifiers_tests_pass_in_their_venv(request: pytest.FixtureRequest, tmp_path: Path) -> None:
    if not VERIFIERS_PY.exists():  # a failure under CI=true (tests/conftest.py CI_REQUIRED_BINARIES)
        pytest.skip(f"{VERIFIERS_PY} is missing")
    report = tmp_path / "verifiers.xml"
    env = {k: v for k, v in os.environ.items() if k not in PARENT_ONLY}
    cmd = [str(VERIFIERS_PY), "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m",
           request.config.getoption("markexpr"), f"--junitxml={report}", *FILES]
    proc = subprocess.run(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                          timeout=1400)
    print(proc.stdout[-20000:])  # shown with the test's report
    assert proc.returncode == 0, f"{' '.join(cmd)} exited {proc.returncode}:\n{proc.stdout[-8000:]}"
    suite = ET.parse(report).getroot()
    suite = suite if suite.tag == "testsuite" else suite.find("testsuite")
    assert suite is not None, report.read_text()[:2000]
    counts = {k: int(suite.get(k, "0")) for k in ("tests", "failures", "errors", "skipped")}
    assert counts["tests"] >= len(FILES) and counts["failures"] == counts["errors"] == counts["skipped"] == 0, (
        counts, proc.stdout[-8000:])
