"""Starting the `vllm` plug-in's servers on a small machine (rollout/engines/vllm_engine.py `start`), with a
fake server: servers with `compile` on start one at a time (the run's `StartLock`), the start timeout
counts from the server's own start, the waits log progress, and a failed start is one line that
names the log and the settings to change. On 2 cores the rollout's and the evaluator's servers
compiling at once both outran the 300 s start timeout and the run never started (issue #43).

Orders are observed through events (log records, fake starts and health answers), not sleeps."""

from __future__ import annotations

import asyncio
import fcntl
import logging
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from trajmesh.config import load_config
from trajmesh.rollout.engines import base as engines_base
from trajmesh.rollout.engines import vllm_engine
from trajmesh.rollout.engines.base import EngineContext
from trajmesh.rollout.engines.vllm_engine import StartLock, VLLMEngine, start_lock_path
from trajmesh.service import StartFailed


class FakeServer:
    """What the fake `start_server` started: ``healthy`` answers /health once set; ``returncode``
    set makes the process look exited."""

    def __init__(self, log_path: Path) -> None:
        self.log_path, self.pid, self.returncode = log_path, 999_999, None
        self.healthy = asyncio.Event()
        self.started = asyncio.Event()
        self.polls = 0
        """/health calls so far."""

    def poll(self) -> int | None:
        return self.returncode


class Harness:
    """Fake `start_server` / `stop_server` / ``VLLMEngine.health`` recording the order of events."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.order: list[str] = []
        self.servers: dict[str, FakeServer] = {}  # by log file name
        self.by_url: dict[str, FakeServer] = {}
        self.stopped: list[str] = []
        self.health_hook: Any = None
        _timing(monkeypatch, "POLL_S", 0.01)
        monkeypatch.setattr(vllm_engine, "start_server", self.start_server)
        monkeypatch.setattr(vllm_engine, "stop_server", lambda proc, *a: self.stopped.append(proc.log_path.name))
        harness = self

        async def health(engine: VLLMEngine, *, generate: bool = False) -> bool:
            server = harness.by_url[engine.base_url]
            if harness.health_hook is not None:
                harness.health_hook(server)
            server.polls += 1
            if server.healthy.is_set():
                harness.order.append(f"healthy {server.log_path.name}")
                return True
            return False

        monkeypatch.setattr(VLLMEngine, "health", health)

    def server(self, log_name: str) -> FakeServer:
        return self.servers.setdefault(log_name, FakeServer(Path(log_name)))

    def start_server(self, cfg: Any, model_path: str, port: int, log_path: Path) -> FakeServer:
        server = self.server(log_path.name)
        server.log_path = log_path
        log_path.parent.mkdir(parents=True, exist_ok=True)
        log_path.write_text("INFO loading the model\nINFO Warming up model for the compilation...\n")
        self.by_url[f"http://127.0.0.1:{port}"] = server
        self.order.append(f"start {log_path.name}")
        server.started.set()
        return server


def _svc(tmp_path: Path, name: str = "rollout", **engine: Any) -> EngineContext:
    overrides = {"run_dir": str(tmp_path / "run"), "model.path": str(tmp_path / "model"),
                 "rollout.engine.type": "vllm", **{f"rollout.engine.{k}": v for k, v in engine.items()}}
    prefix = "evaluator-engine" if name == "evaluator" else "engine"
    return EngineContext(load_config(None, overrides), 0, f"{name}-0-{len(name)}", vocab_size=8, eos_token_id=0,
                         log_prefix=prefix)


def _timing(monkeypatch: pytest.MonkeyPatch, name: str, value: float) -> None:
    """POLL_S / PROGRESS_EVERY_S for the start lock (vllm_engine) and the health wait (base)."""
    monkeypatch.setattr(vllm_engine, name, value)
    monkeypatch.setattr(engines_base, name, value)


class LogEvents(logging.Handler):
    """Sets an event when a record of `trajmesh.rollout.engines` (the health wait, vLLM's start lock)
    contains a given text."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.records: list[str] = []
        self.waiting: dict[str, asyncio.Event] = {}

    def on(self, text: str) -> asyncio.Event:
        return self.waiting.setdefault(text, asyncio.Event())

    def emit(self, record: logging.LogRecord) -> None:
        msg = record.getMessage()
        self.records.append(msg)
        for text, event in self.waiting.items():
            if text in msg:
                event.set()


@pytest.fixture
def logs() -> Any:
    handler = LogEvents()
    logger = logging.getLogger("trajmesh.rollout.engines")
    level = logger.level
    logger.setLevel(logging.INFO)
    logger.addHandler(handler)
    yield handler
    logger.removeHandler(handler)
    logger.setLevel(level)


async def _first(*aws: Any) -> set[asyncio.Future[Any]]:
    tasks = {asyncio.ensure_future(a) for a in aws}
    done, pending = await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
    for t in pending:
        t.cancel()
    return done


def test_compiling_starts_queue_one_at_a_time(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, logs: LogEvents) -> None:
    """The rollout's server starts; the evaluator's waits (and logs for whom) until the first is
    healthy, then starts. Without the lock the second server starts at once and this fails."""
    h = Harness(monkeypatch)
    rollout, evaluator = _svc(tmp_path, "rollout"), _svc(tmp_path, "evaluator")

    async def scenario() -> None:
        first = asyncio.create_task(vllm_engine.start(rollout))
        await h.server("engine-0.log").started.wait()
        second = asyncio.create_task(vllm_engine.start(evaluator))
        waits = logs.on("waits for")
        done = await _first(waits.wait(), h.server("evaluator-engine-0.log").started.wait())
        assert waits.is_set() and not h.server("evaluator-engine-0.log").started.is_set(), h.order
        assert h.order == ["start engine-0.log"]
        h.server("engine-0.log").healthy.set()
        started = await first
        assert started.proc is h.server("engine-0.log")
        await started.engine.close()
        await h.server("evaluator-engine-0.log").started.wait()
        h.server("evaluator-engine-0.log").healthy.set()
        await (await second).engine.close()
        assert done

    asyncio.run(scenario())
    assert h.order == ["start engine-0.log", "healthy engine-0.log",
                       "start evaluator-engine-0.log", "healthy evaluator-engine-0.log"]
    waiting = next(r for r in logs.records if "waits for" in r)
    assert "evaluator-0-9" in waiting and "rollout-0-7" in waiting, waiting  # who waits, and for whom
    # released: anyone may take it now
    fd = os.open(start_lock_path(rollout.cfg.run_dir), os.O_RDWR)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    finally:
        os.close(fd)


_HOLDER = """
import asyncio, sys
from pathlib import Path
from trajmesh.rollout.engines.vllm_engine import StartLock
asyncio.run(StartLock(Path(sys.argv[1]), "evaluator-0-77").acquire())
print("held", flush=True)
sys.stdin.readline()
"""


def test_the_lock_holds_across_processes_and_dies_with_its_holder(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                                  logs: LogEvents) -> None:
    """Another process (the evaluator) holds the lock: this one waits, naming it, and takes the
    lock once that process is gone (killed: the kernel drops its lock, no stale lock file blocks)."""
    _timing(monkeypatch, "POLL_S", 0.01)
    path = start_lock_path(tmp_path / "run")
    holder = subprocess.Popen([sys.executable, "-c", _HOLDER, str(path)], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "held"

        async def scenario() -> None:
            lock = StartLock(path, "rollout-0-1")
            taking = asyncio.create_task(lock.acquire())
            waits = logs.on("waits for evaluator-0-77")
            await _first(waits.wait(), asyncio.shield(taking))
            assert waits.is_set() and not taking.done()
            holder.kill()
            await taking
            lock.release()

        asyncio.run(scenario())
    finally:
        holder.kill()
        holder.wait()


def test_a_compile_off_start_takes_no_lock(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, logs: LogEvents) -> None:
    """With the lock held by a compiling start, an eager (-O0) server starts without waiting."""
    h = Harness(monkeypatch)
    svc = _svc(tmp_path, "rollout", compile=False)
    h.server("engine-0.log").healthy.set()

    async def scenario() -> None:
        held = StartLock(start_lock_path(svc.cfg.run_dir), "evaluator-0-77")
        await held.acquire()
        try:
            starting = asyncio.ensure_future(vllm_engine.start(svc))
            waits = logs.on("waits for")
            await _first(asyncio.shield(starting), waits.wait())
            assert starting.done() and not waits.is_set(), logs.records
            await starting.result().engine.close()
        finally:
            held.release()

    asyncio.run(scenario())
    assert h.order == ["start engine-0.log", "healthy engine-0.log"]


def test_the_lock_wait_does_not_count_against_the_start_timeout(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                              logs: LogEvents) -> None:
    """The start waits longer for the lock than its whole startup_timeout_s (its progress note comes
    later than the timeout), then its server answers on the second poll: healthy, not timed out.
    Counting the lock wait, the first unhealthy poll would be past the deadline."""
    h = Harness(monkeypatch)
    _timing(monkeypatch, "PROGRESS_EVERY_S", 0.3)
    svc = _svc(tmp_path, "rollout", startup_timeout_s=0.2)
    def second_poll_healthy(server: FakeServer) -> None:
        if server.polls:
            server.healthy.set()

    h.health_hook = second_poll_healthy

    async def scenario() -> None:
        held = StartLock(start_lock_path(svc.cfg.run_dir), "evaluator-0-77")
        await held.acquire()
        starting = asyncio.ensure_future(vllm_engine.start(svc))
        still = logs.on("still waits")  # ≥ 0.3 s of waiting: more than the 0.2 s allowance
        await _first(still.wait(), asyncio.shield(starting))
        assert still.is_set() and not starting.done(), h.order
        held.release()
        await (await starting).engine.close()

    asyncio.run(scenario())
    assert h.order == ["start engine-0.log", "healthy engine-0.log"] and h.server("engine-0.log").polls == 2
    assert any("still waits" in r and "evaluator-0-77" in r for r in logs.records), logs.records


def test_a_timeout_is_one_line_naming_the_log_and_the_settings(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                               logs: LogEvents) -> None:
    """A server that never answers: progress notes with the elapsed time and its log's last line,
    then one line naming the log, rollout.engine.startup_timeout_s and rollout.engine.compile: false;
    the server is stopped and the lock released before the error."""
    h = Harness(monkeypatch)
    _timing(monkeypatch, "PROGRESS_EVERY_S", 0.05)
    svc = _svc(tmp_path, "rollout", startup_timeout_s=0.3)

    with pytest.raises(StartFailed) as err:
        asyncio.run(vllm_engine.start(svc))
    msg = str(err.value)
    log_path = Path(svc.cfg.run_dir) / "logs" / "engine-0.log"
    assert "\n" not in msg
    assert msg.startswith("vLLM engine of rollout-0-7 (compile on) not healthy after 0.3s"), msg
    for text in (str(log_path), "rollout.engine.startup_timeout_s", "rollout.engine.compile: false"):
        assert text in msg, msg
    assert h.stopped == ["engine-0.log"]
    progress = [r for r in logs.records if "starting:" in r]
    assert progress and "Warming up model for the compilation" in progress[0], logs.records
    fd = os.open(start_lock_path(svc.cfg.run_dir), os.O_RDWR)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # released
    finally:
        os.close(fd)

    off = _svc(tmp_path / "off", "rollout", startup_timeout_s=0.05, compile=False)
    with pytest.raises(StartFailed, match="rollout.engine.startup_timeout_s") as err:
        asyncio.run(vllm_engine.start(off))
    assert "compile: false" not in str(err.value)  # already off: nothing to say about it


def test_an_exit_during_start_is_one_line_with_the_logs_last_line(tmp_path: Path,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    h = Harness(monkeypatch)
    svc = _svc(tmp_path, "evaluator")

    def crash(server: FakeServer) -> None:
        with open(server.log_path, "a") as fh:
            fh.write("Traceback (most recent call last):\n  ...\nRuntimeError: Engine core initialization failed.\n")
        server.returncode = 1

    h.health_hook = crash
    with pytest.raises(StartFailed) as err:
        asyncio.run(vllm_engine.start(svc))
    msg = str(err.value)
    assert "\n" not in msg
    assert msg.startswith("vLLM engine of evaluator-0-9 (compile on) exited with 1 during start"), msg
    assert "RuntimeError: Engine core initialization failed." in msg
    assert msg.endswith(f"read {Path(svc.cfg.run_dir) / 'logs' / 'evaluator-engine-0.log'}"), msg
