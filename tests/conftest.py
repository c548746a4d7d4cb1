"""Shared fixtures: real NATS (JetStream) and Redis servers on free ports, stopped by pid.

The tests mirror the tree: ``tests/unit/<folder>/`` checks one folder of the code, ``tests/e2e/``
runs whole meshes and ``tests/slow/`` holds the long studies; the folder sets the marker (``e2e``;
``slow`` and ``e2e``), so a plain ``pytest`` (``addopts``) runs what ``make test`` runs. Support
modules (``mesh_checks``, ``repo_paths``, the tiny models...) sit in ``tests/`` itself.

Also the CI rules every test run follows:
- under ``CI=true`` hypothesis is derandomized (profile ``ci``: the same examples every run, the
  failing example and its reproduction blob printed), elsewhere it explores (profile ``dev``);
- a test skipped because Prometheus or ``.venv-verifiers`` is missing names the command that installs
  it, and under ``CI=true`` that skip is a failure (CI must run it);
- torch and every process a test starts run one OpenMP thread (``OMP_NUM_THREADS=1`` unless set),
  as the launcher runs the services: `make test` runs two workers on two cores, and OpenMP threads
  spin-waiting for a core another process holds made one 60-step SFT 12-130 s instead of 2.4 s
  beside the CI burners.
"""

from __future__ import annotations

import os
from collections.abc import Generator, Iterator
from pathlib import Path

import pytest
from hypothesis import settings
from repo_paths import TESTS

from trajmesh.infra import NatsServer, RedisServer
from trajmesh.service import WATCHDOG_THREAD

CI = os.environ.get("CI", "").lower() == "true"

# Before anything imports torch (its OpenMP runtime reads these once); subprocesses inherit them.
for _threads in ("OMP_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(_threads, "1")

settings.register_profile("ci", derandomize=True, print_blob=True, database=None)
settings.register_profile("dev", print_blob=True)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci" if CI else "dev"))

# Binaries whose absence may skip a test locally but never in CI, with the command that installs them.
CI_REQUIRED_BINARIES = {
    "prometheus": "sudo apt-get install prometheus (`make test` does it when run as root)",
    "promtool": "sudo apt-get install prometheus (`make test` does it when run as root)",
    ".venv-verifiers": "make setup-verifiers-mesh (`make test` does it)",
}


# Markers each top folder of tests/ gives its tests, and the folders a test file may sit in.
FOLDER_MARKERS = {"unit": (), "e2e": ("e2e",), "slow": ("slow", "e2e")}


def pytest_collect_file(file_path: Path, parent: pytest.Collector) -> None:
    if file_path.name.startswith("test_") and file_path.suffix == ".py":
        top = file_path.resolve().relative_to(TESTS).parts
        if len(top) < 2 or top[0] not in FOLDER_MARKERS:
            raise pytest.UsageError(f"{file_path}: a test file belongs under tests/unit/<folder>/, "
                                    f"tests/e2e/ or tests/slow/ (tests/conftest.py)")


def pytest_itemcollected(item: pytest.Item) -> None:
    top = item.path.resolve().relative_to(TESTS).parts[0]
    for name in FOLDER_MARKERS.get(top, ()):
        item.add_marker(name)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Modules that say ``RUN_LAST = True`` go to the end of the collection, so the scheduler below
    hands them out after every other scope (tests/unit/envs/test_verifiers_venv.py: a whole session
    in another venv, taken by the worker that finishes the unit modules while the meshes still run)."""
    items.sort(key=lambda item: bool(getattr(getattr(item, "module", None), "RUN_LAST", False)))


# Node ids of the tests that run a mesh (every folder but unit/), for the scheduler below.
MESH_FOLDERS = tuple(f"tests/{top}/" for top in FOLDER_MARKERS if top != "unit")


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log: object) -> object:
    """`make test` runs on two pytest-xdist workers with ``--dist loadscope``, scoped here: every
    test under tests/e2e/ and tests/slow/ is one scope, so the meshes run one after another on one
    worker, as in a single process (each is sized for the cores it shares with the rest of the
    suite, not with another mesh); every other module is a scope of its own, handed whole to
    whichever worker is free, so a module-scoped fixture (a vLLM server, an engine) starts once: a
    scope per test interleaved modules on a worker, and pytest tears a module's fixtures down
    whenever the next test is another module's (the conformance suite's vLLM server started twice,
    235 s and 120 s beside the CI burners). The scopes keep collection order (no reordering by
    size), so the mesh scope (tests/e2e/ sorts first) starts at once, beside the unit modules.
    (xdist's own ``loadgroup`` renames node ids, which pytest 9.2 ignores.)"""
    if config.getvalue("dist") != "loadscope":
        return None
    from xdist.scheduler import LoadScopeScheduling

    config.option.loadscopereorder = False

    class MeshesInOneWorker(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return "mesh" if nodeid.startswith(MESH_FOLDERS) else nodeid.split("::", 1)[0]

    return MeshesInOneWorker(config, log)  # type: ignore[arg-type]


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node: object, error: object) -> None:
    """A worker that went down mid-run ("node down: Not properly terminated") is named with how its
    process ended: the exit status, or the signal that killed it (-9: SIGKILL, from the OOM killer
    or a kill that reached the wrong process), so a crash is never just "not properly terminated"."""
    if not error:
        return
    import signal as _signal

    popen = getattr(getattr(getattr(node, "gateway", None), "_io", None), "popen", None)
    if popen is None:
        return
    try:
        code = popen.wait(timeout=10)
    except Exception as exc:  # a diagnostic never fails the run
        code = f"unknown ({exc})"
    how = f"killed by {_signal.Signals(-code).name}" if isinstance(code, int) and code < 0 else f"exit {code}"
    print(f"\n[{getattr(node.gateway, 'id', '?')}] worker pid {popen.pid} went down: {how}", flush=True)


def pytest_report_header(config: pytest.Config) -> str:
    return f"hypothesis profile: {settings.get_current_profile_name()} (CI={CI})"


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Generator[None, None, None]:
    outcome = yield
    report: pytest.TestReport = outcome.get_result()
    if report.failed and getattr(getattr(item, "obj", None), "is_hypothesis_test", False):
        current = settings()
        report.sections.append(("hypothesis", (
            f"profile {settings.get_current_profile_name()!r}, derandomize={current.derandomize}: "
            + ("every CI run draws the same examples; reproduce with "
               f"CI=true pytest '{item.nodeid}'" if current.derandomize else
               "examples were random; replay the failure with the @reproduce_failure blob above, "
               f"or run CI=true pytest '{item.nodeid}' for the derandomized examples"))))
    if not report.skipped or not isinstance(report.longrepr, tuple):
        return
    path, lineno, reason = report.longrepr
    missing = [name for name in CI_REQUIRED_BINARIES if name in reason.lower()]
    if not missing:
        return
    hint = CI_REQUIRED_BINARIES[missing[0]]
    if CI:
        report.outcome = "failed"
        report.longrepr = f"CI=true and {reason}: CI must run this test; install it: {hint}"
    else:
        report.longrepr = (path, lineno, f"{reason}; install it: {hint}")


@pytest.fixture(autouse=True)
def _no_stop_watchdog_left() -> Iterator[None]:
    """A test that ran a service through `run_service` in this process (e.g. `cli.main(["serve",
    ...])`) leaves its stop watchdog armed, and it ends the pytest worker with exit status 3 half a
    minute later, in whatever test runs then ("node down: Not properly terminated"). Such a
    watchdog is cancelled here and the test that left it fails."""
    yield
    import threading

    left = [t for t in threading.enumerate() if t.name.endswith(WATCHDOG_THREAD) and t.is_alive()
            and not (isinstance(t, threading.Timer) and t.finished.is_set())]  # a cancelled one ends now
    for thread in left:
        if isinstance(thread, threading.Timer):
            thread.cancel()
    if left:
        pytest.fail(f"a service's stop watchdog outlived the test (it would end this process): "
                    f"{[t.name for t in left]}; cancel it (service._watchdog.cancel())", pytrace=False)


@pytest.fixture
def nats_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[NatsServer]:
    """A fresh nats-server with JetStream for one test."""
    server = NatsServer(tmp_path_factory.mktemp("nats"))
    server.start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def redis_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    """A fresh redis-server (AOF on) for one test."""
    server = RedisServer(tmp_path_factory.mktemp("redis"))
    server.start()
    try:
        yield server
    finally:
        server.stop()


def _build_tiny_model(root: object) -> str:
    """A tiny Llama with the demo tokenizer and a short SFT warm start (seconds on CPU)."""
    from pathlib import Path

    from trajmesh.config import DemoModelConfig
    from trajmesh.learner.models import prepare_demo_model

    out = Path(str(root))
    prepare_demo_model(out, seed=0, demo=DemoModelConfig(hidden_size=32, layers=1, heads=2, sft_steps=40, sft_batch_size=32,
                                                         sft_lr=3e-3, sft_size=500))
    return str((out / "sft").resolve())


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    """HF model dir (safetensors + tokenizer) shared by the mesh tests."""
    return _build_tiny_model(tmp_path_factory.mktemp("tiny-model"))
