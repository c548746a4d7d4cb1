"""A failed start is one line that says what failed and which log to read, not a traceback: the
service (`trajmesh serve`) on a known start failure (`StartFailed`, e.g. its vLLM engine exited or
timed out at start), the launcher's error, and what `trajmesh train` prints (issue #43: the run
ended with `rollout-0 exited with 1 during start:` and a traceback)."""

from __future__ import annotations

import logging
import os
import subprocess
from pathlib import Path

import pytest

from trajmesh.config import load_config
from trajmesh.run import cli
from trajmesh.run.launcher import Mesh, Proc, StartupError
from trajmesh.service import Service, StartFailed

ENGINE_LINE = ("vLLM engine of rollout-0-4242 (compile on) not healthy after 600s; read /r/logs/engine-0.log: "
               "raise rollout.engine.startup_timeout_s (now 600)")


class EngineWontStart(Service):
    name = "rollout"

    async def setup(self) -> None:
        raise StartFailed(ENGINE_LINE)

    async def run(self) -> None:  # pragma: no cover - never reached
        raise AssertionError("run() after a failed setup")


def test_serve_exits_1_with_one_line_on_a_known_start_failure(monkeypatch: pytest.MonkeyPatch,
                                                              capsys: pytest.CaptureFixture[str],
                                                              caplog: pytest.LogCaptureFixture) -> None:
    service = EngineWontStart(load_config(None), metrics_port=0)
    monkeypatch.setattr(cli, "_build_service", lambda name, args: service)
    try:
        with caplog.at_level(logging.INFO):
            rc = cli.main(["serve", "rollout", "--config", "unused.yaml", "--metrics-port", "0"])
    finally:
        # `serve` armed the process's stop watchdog (os._exit at the stop deadline): here the
        # process is the pytest worker, so it is cancelled (conftest fails a test that leaves one)
        assert service._watchdog is not None
        service._watchdog.cancel()
    assert rc == 1
    out = capsys.readouterr()
    assert "Traceback" not in out.err + out.out
    failed = [r for r in caplog.records if r.levelno >= logging.ERROR]
    assert [r.getMessage() for r in failed] == [f"rollout-0-{os.getpid()} failed: StartFailed: {ENGINE_LINE}"]
    assert not any(r.exc_info for r in caplog.records)


def test_the_launchers_error_names_the_failure_and_the_log(tmp_path: Path) -> None:
    """A rollout that exited during start: the first line carries the service's own failure line
    (without its log-record prefix) and the log to read; the log's tail follows it."""
    log_path = tmp_path / "logs" / "rollout-0.log"
    log_path.parent.mkdir()
    log_path.write_text("2026-01-01 10:00:00,000 trajmesh.service INFO rollout-0-4242 serving health/metrics on :1\n"
                        f"2026-01-01 10:10:00,000 trajmesh.service ERROR rollout-0-4242 failed: StartFailed: {ENGINE_LINE}\n"
                        "2026-01-01 10:10:01,000 trajmesh.service INFO rollout-0-4242 stopped\n")
    popen = subprocess.Popen(["sh", "-c", "exit 1"])
    popen.wait()
    mesh = Mesh(load_config(None), tmp_path / "config.yaml")
    with pytest.raises(StartupError) as err:
        mesh.wait_healthy([Proc("rollout", 0, popen, 1, log_path)], timeout_s=5)
    assert err.value.line == (f"rollout-0 exited with 1 during start: rollout-0-4242 failed: StartFailed: "
                              f"{ENGINE_LINE} (log: {log_path})")
    assert "rollout-0-4242 stopped" in err.value.tail and str(err.value).startswith(err.value.line + "\n")


def test_train_prints_one_line_for_a_failed_start(monkeypatch: pytest.MonkeyPatch,
                                                  capsys: pytest.CaptureFixture[str]) -> None:
    import trajmesh.run.train as train_mod

    def fail(*args: object, **kwargs: object) -> None:
        raise StartupError("rollout-0 exited with 1 during start: ... (log: runs/x/logs/rollout-0.log)",
                           "the log's last lines\nmore of them")

    monkeypatch.setattr(train_mod, "train", fail)
    monkeypatch.setattr(cli.signal, "signal", lambda *a: None)  # the CLI's SIGTERM handler: not in pytest
    assert cli.main(["train", "examples/demo.yaml"]) == 1
    err = capsys.readouterr().err
    assert err == "error: rollout-0 exited with 1 during start: ... (log: runs/x/logs/rollout-0.log)\n"
