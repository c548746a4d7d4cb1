"""The service lifecycle every trajmesh process shares: setup → run → stop.

    trajmesh serve SERVICE --config CONFIG
        │
        ├─ HTTP :metrics_port   GET /healthz (200 once setup finished, 503 before/after)
        │                       GET /metrics (Prometheus text format)
        ├─ setup()              connect to NATS/Redis, open servers, load models
        ├─ run()                the service's supervised loops; returning ends the process (exit 0)
        └─ stop()               on SIGTERM/SIGINT or when run() returns or raises
        the whole stop is bounded: `stop_timeout_s` after it began (plus the learner's
        `graceful_stop_s` on a signal), then the process exits non-zero (`run_service`)

Exits are honest. A supervised loop that returns early is a crash: `supervise` cancels its
siblings and raises `LoopError` naming the loop (and its error), so `serve` raises, the process
exits non-zero and the launcher (or Kubernetes) sees it. A service that sets `stopping` itself
without a signal (e.g. a crashed background task) is a failure too: it should call `fail(error)`,
which records the error that `serve` raises. Only a signal or `run()` returning ends with exit 0.

Stops are bounded. From the moment a stop begins (a signal, `fail()`, `run()` ending) /healthz
answers 503, and the stop has a deadline: graceful period (on a signal, when the service has one)
+ `stop_timeout_s` (the run's `service.stop_timeout_s` + the service's `stop_work_s`). Cancelling
`run()` and `stop()` share it inside the event loop; a loop that swallows its cancellation or a
`stop()` that hangs is logged with every task still pending and turns into a failure. Under
`run_service` (the process entry point) a watchdog thread also ends the process with
`STOP_TIMEOUT_EXIT_CODE` at the deadline + `EXIT_GRACE_S`, whatever the event loop or the
interpreter's teardown is stuck on, so a crashed service always ends in an exit and a restart.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import sys
import threading
import time
import traceback
from abc import ABC, abstractmethod
from collections.abc import Awaitable, Sequence
from typing import Any

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, REGISTRY, generate_latest

from trajmesh.config import RunConfig

log = logging.getLogger("trajmesh.service")

STOP_TIMEOUT_EXIT_CODE = 3
"""Exit status of a process whose stop outlived its deadline (ended by the stop watchdog)."""
WATCHDOG_THREAD = "stop watchdog"
"""The end of the name of the thread that `run_service` arms at a stop (`<worker id> stop watchdog`):
it ends the process when the stop outlives its deadline, so it must never outlive a service served
inside another process (the tests check that none is left after a test)."""
EXIT_GRACE_S = 5.0
"""After the stop deadline, how long the process may take to leave (HTTP cleanup, asyncio.run's
teardown) before the watchdog ends it."""
STOP_NOTICE = "learner-stop.json"
"""In the run directory: the learner's answer to a stop, ``{pid, signal, in_step, deadline_unix}``
(services/learner.py `request_stop`). The launcher waits for the learner until that deadline instead
of its own grace (trajmesh/run/launcher.py `Mesh._stop`): a real model's step takes minutes."""
FIRST_STEP_ALLOWANCE_S = 1800.0
"""How long a learner stopped during its first step waits for it (nothing measured yet)."""
STOP_WORK_S = {"store": 90.0, "learner": 90.0}
"""`Service.stop_work_s` of the services that have durable work in `stop()` (the store's finalization,
the learner's last checkpoint), by service name: the launcher reads it too, so it never kills a
service before the stop budget the service itself runs under (trajmesh/run/launcher.py)."""


def stop_budget_s(name: str, cfg_stop_timeout_s: float) -> float:
    """How long a `name` service may take from SIGTERM to exit, not counting a graceful period:
    `service.stop_timeout_s` + its `stop_work_s` + `EXIT_GRACE_S`."""
    return cfg_stop_timeout_s + STOP_WORK_S.get(name, 0.0) + EXIT_GRACE_S


class LoopError(RuntimeError):
    """A supervised loop returned or raised; the message names the loop (and the error)."""


class ServiceFailed(RuntimeError):
    """A service stopped itself without a signal; the message names the service and the cause."""


class StartFailed(RuntimeError):
    """`setup()` could not start something the service needs, for a known reason its message says
    in one line (what failed, which log to read, which setting to change): the service logs that
    line and `trajmesh serve` exits 1 without a traceback (an engine that exited or timed out at
    start, rollout/engines/vllm_engine.py)."""


class Service(ABC):
    """One trajmesh process. Subclasses wire their components in `setup()` and loop in `run()`."""

    name: str = "service"
    graceful_stop_s: float = 0.0
    """On SIGTERM, how long `run()` may take to finish its current unit of work before it is
    cancelled (it should watch `self.stopping`)."""
    stop_work_s: float = 0.0
    """Seconds this kind of service's `stop()` needs for its own durable work (the store's
    finalization), added to the run's `service.stop_timeout_s`."""

    def __init__(self, cfg: RunConfig, *, replica: int = 0, metrics_port: int = 0) -> None:
        self.cfg = cfg
        self.replica = replica
        self.metrics_port = metrics_port
        self.worker_id = f"{self.name}-{replica}-{os.getpid()}"
        self.ready = False
        self.stopping = asyncio.Event()
        self.stop_signal: int | None = None
        """The signal (SIGTERM/SIGINT) that asked this process to stop; None until one arrives."""
        self.failure: BaseException | None = None
        """The error recorded by `fail()`; `serve` raises it once the service has stopped."""
        self.stop_timeout_s = cfg.service.stop_timeout_s + self.stop_work_s
        """How long cancelling `run()` and `stop()` may take once the stop began (after the
        graceful period), before the stop is a failure and the process exits non-zero."""
        self.stop_deadline: float | None = None
        """time.monotonic() by which the stop must be over; None until a stop begins."""
        self.exit_on_stop_timeout = False
        """Whether a stop past its deadline ends the process (set by `run_service`; False for a
        service served inside another program, e.g. a test)."""
        self._loop: asyncio.AbstractEventLoop | None = None
        self._watchdog: threading.Timer | None = None

    def fail(self, error: BaseException) -> None:
        """Stop this service because of ``error`` (e.g. a crashed background task): `serve` stops
        it and raises the error, so the process exits non-zero. The first failure wins."""
        if self.failure is None:
            self.failure = error
        self.begin_stop()

    def request_stop(self, sig: int) -> None:
        """Signal handler: a clean stop was asked for (exit 0 unless something fails on the way)."""
        self.stop_signal = sig
        self.begin_stop()

    def begin_stop(self) -> None:
        """Sets `stopping` and starts the stop's clock (once): the graceful period if the service
        is not failing, then `stop_timeout_s`; under `run_service` a watchdog thread ends the
        process `EXIT_GRACE_S` after that deadline."""
        self.stopping.set()
        if self.stop_deadline is not None:
            return
        graceful = self.graceful_stop_s if self.failure is None else 0.0
        self.stop_deadline = time.monotonic() + graceful + self.stop_timeout_s
        if self.exit_on_stop_timeout:
            self._watchdog = threading.Timer(graceful + self.stop_timeout_s + EXIT_GRACE_S, self._stop_expired)
            self._watchdog.name = f"{self.worker_id} {WATCHDOG_THREAD}"
            self._watchdog.daemon = True
            self._watchdog.start()

    def stop_time_left(self) -> float:
        """Seconds left before the stop's deadline (the full timeout while no stop has begun)."""
        if self.stop_deadline is None:
            return self.stop_timeout_s
        return max(0.0, self.stop_deadline - time.monotonic())

    def _stop_expired(self) -> None:
        """Watchdog thread: the stop is past its deadline. Log what is still pending and end the
        process (os._exit: a stuck event loop, thread or interpreter teardown cannot hold it)."""
        try:
            log.error("%s did not stop within %.0fs of its stop; exiting with %d. Still waiting for:\n%s",
                      self.worker_id, self.stop_timeout_s, STOP_TIMEOUT_EXIT_CODE,
                      pending_report(self._loop, threads=True))
            for handler in logging.getLogger().handlers:
                handler.flush()
            sys.stderr.flush()
            sys.stdout.flush()
        finally:
            os._exit(STOP_TIMEOUT_EXIT_CODE)

    @abstractmethod
    async def setup(self) -> None: ...

    @abstractmethod
    async def run(self) -> None: ...

    async def stop(self) -> None:  # noqa: B027 - optional hook, not abstract
        """Release resources; must be safe to call after a partial setup."""


def pending_report(loop: asyncio.AbstractEventLoop | None, *, threads: bool = False) -> str:
    """One line per task still pending on `loop` (its coroutine and where it waits) and, with
    `threads`, per thread other than the caller's (where it runs): what a stop still waits for."""
    lines = []
    if loop is not None:
        try:
            tasks = list(asyncio.all_tasks(loop))
        except RuntimeError:  # the set changed under a reader in another thread: report without it
            tasks = []
        current = None if threads else asyncio.current_task()  # the reporter itself, in the loop
        for task in tasks:
            if task is current or task.done():
                continue
            coro = task.get_coro()
            lines.append(f"  task {task.get_name()}: {getattr(coro, '__qualname__', coro)!s}{_awaiting(coro)}")
    if threads:
        me = threading.get_ident()
        names = {t.ident: t.name for t in threading.enumerate()}
        for ident, frame in sys._current_frames().items():
            if ident == me:
                continue
            last = traceback.extract_stack(frame)[-1]
            lines.append(f"  thread {names.get(ident, ident)}: {last.filename}:{last.lineno} in {last.name}")
    return "\n".join(lines) or "  (nothing pending)"


def _awaiting(coro: Any) -> str:
    """Where a suspended coroutine waits: the innermost coroutine of its await chain outside
    asyncio itself, file:line."""
    frame = None
    while coro is not None:
        inner = getattr(coro, "cr_frame", None) or getattr(coro, "gi_frame", None)
        if inner is None:
            break
        if frame is None or f"{os.sep}asyncio{os.sep}" not in inner.f_code.co_filename:
            frame = inner  # the innermost frame outside asyncio's own (sleep, wait_for...)
        coro = getattr(coro, "cr_await", None) or getattr(coro, "gi_yieldfrom", None)
    if frame is None:
        return ""
    return f" (waiting in {frame.f_code.co_name} at {frame.f_code.co_filename}:{frame.f_lineno})"


def _loop_name(loop: Awaitable[None]) -> str:
    return str(getattr(loop, "__qualname__", None) or getattr(loop, "__name__", None) or repr(loop))


async def supervise(*loops: Awaitable[None], stopping: asyncio.Event | None = None) -> None:
    """Run loops together; the first to finish or fail cancels the others (close → cancel → gather).

    A loop that raises, or returns while ``stopping`` is not set, raises :class:`LoopError` naming
    it. A loop may return cleanly only once ``stopping`` (if given) is set: then the others are
    cancelled and supervise returns.
    """
    names = [_loop_name(x) for x in loops]
    tasks = [asyncio.ensure_future(x) for x in loops]
    try:
        done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
        for task in tasks:
            if task in done:
                _check_loop(task, names[tasks.index(task)], stopping)
    finally:
        await cancel_and_wait(tasks, names)


RECANCEL_S = 2.0
"""How long a cancelled task may run on before it is cancelled again (`cancel_and_wait`)."""

_STDLIB_WAIT_FOR = asyncio.wait_for


async def wait_for(aw: Awaitable[Any], timeout: float | None) -> Any:
    """`asyncio.wait_for` with Python 3.12's semantics: the awaitable runs in this task under
    `asyncio.timeout`, so a cancellation that arrives as the call completes is raised, never traded
    for the call's result. Python 3.11's `wait_for` runs it as a separate task and returns the
    result then: the caller's cancellation is lost and its loop goes on. redis-py 8.2 sends every
    command through it (its default `socket_timeout` is 5 s), and nats-py its requests and fetches;
    a loop of Redis commands swallowed about 1 cancel in 2 (tests/unit/trajmesh/test_service.py).
    A timeout ≤ 0 keeps the standard library's answer (a call already done still returns)."""
    if timeout is not None and timeout <= 0:
        return await _STDLIB_WAIT_FOR(aw, timeout)
    async with asyncio.timeout(timeout):
        return await aw


def keep_cancellations() -> None:
    """On Python 3.11, make `asyncio.wait_for` the process's :func:`wait_for`, for the libraries
    that call it by that name (redis-py, nats-py). `run_service` does it before its event loop
    starts; Python 3.12 and later already behave so, and nothing changes there."""
    if sys.version_info[:2] == (3, 11):
        asyncio.wait_for = wait_for  # type: ignore[assignment]


async def cancel_and_wait(tasks: Sequence[asyncio.Future[Any]], names: Sequence[str] | None = None, *,
                          recancel_s: float | None = None) -> None:
    """Cancels `tasks` and waits until every one has ended, cancelling again each one still running
    `recancel_s` later. On Python 3.11 `asyncio.wait_for` returns its result, swallowing the
    cancellation, when the awaited call completes as the cancel arrives (see :func:`wait_for`,
    which `run_service` installs), and code of our own may catch a cancel too. A loop that swallowed
    its one cancellation went on looping, and a store never stopped (docs/RELIABILITY.md). Each
    cancel of such a loop is a new draw, so it ends after a few. A cancellation of this wait itself
    cancels the tasks again at once; it still waits for them, then propagates. `recancel_s`: None
    is `RECANCEL_S`."""
    recancel_s = RECANCEL_S if recancel_s is None else recancel_s
    labels = names or [_loop_name(t) for t in tasks]
    for t in tasks:
        t.cancel()
    pending = {t for t in tasks if not t.done()}
    cancelled = False
    while pending:
        try:
            _, still = await asyncio.wait(pending, timeout=recancel_s)
        except asyncio.CancelledError:
            cancelled = True
            for t in pending:
                t.cancel()
            pending = {t for t in pending if not t.done()}
            continue
        pending = still
        for t in pending:
            log.warning("task %s still running %.0fs after its cancellation (swallowed): cancelling it again",
                        labels[tasks.index(t)], recancel_s)
            t.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    if cancelled:
        raise asyncio.CancelledError


def _check_loop(task: asyncio.Future[None], name: str, stopping: asyncio.Event | None) -> None:
    if task.cancelled():
        raise LoopError(f"loop {name} was cancelled")
    error = task.exception()
    if isinstance(error, LoopError):
        raise error  # a nested supervise already named the loop
    if error is not None:
        raise LoopError(f"loop {name} failed: {type(error).__name__}: {error}") from error
    if stopping is None or not stopping.is_set():
        raise LoopError(f"loop {name} returned (a supervised loop that returns is a crash)")


async def _start_http(service: Service) -> web.AppRunner:
    async def healthz(_: web.Request) -> web.Response:
        """200 while serving; 503 before setup finished and from the moment a stop began, so a
        liveness probe sees a failing service even while its stop is still under way."""
        if service.failure is not None:
            return web.json_response({"status": "failing", "worker": service.worker_id,
                                      "error": f"{type(service.failure).__name__}: {service.failure}"}, status=503)
        if service.ready and not service.stopping.is_set():
            return web.json_response({"status": "ok", "service": service.name, "worker": service.worker_id})
        return web.json_response({"status": "starting" if not service.ready else "stopping"}, status=503)

    async def metrics(_: web.Request) -> web.Response:
        body = generate_latest(REGISTRY)
        return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})

    app = web.Application()
    app.router.add_get("/healthz", healthz)
    app.router.add_get("/metrics", metrics)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "0.0.0.0", service.metrics_port)
    await site.start()
    if service.metrics_port == 0:
        server: Any = site._server
        service.metrics_port = server.sockets[0].getsockname()[1]
    return runner


async def serve(service: Service) -> None:
    """Run a service to completion: HTTP endpoints, setup, run, and stop on signal or exit.

    Returns (exit 0) after a signal or when `run()` returns; raises (exit non-zero) when setup or
    run raises, when the service stopped itself (`fail()`, or `stopping` set without a signal) and
    when `stop()` fails or outlives `stop_timeout_s`.
    """
    loop = service._loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, service.request_stop, sig)
    runner = await _start_http(service)
    log.info("%s serving health/metrics on :%d", service.worker_id, service.metrics_port)
    try:
        await service.setup()
        service.ready = True
        log.info("%s ready", service.worker_id)
        await _run_until_stopped(service)
    except BaseException as err:
        log.error("%s failed: %s: %s", service.worker_id, type(err).__name__, err)
        raise
    finally:
        service.begin_stop()
        try:
            await _bounded_stop(service)
        finally:
            await runner.cleanup()
            log.info("%s stopped", service.worker_id)


def run_service(service: Service) -> None:
    """The process entry point (`trajmesh serve`): `serve` the service in a fresh event loop, with
    the stop watchdog armed: a stop that outlives its deadline ends the process with
    `STOP_TIMEOUT_EXIT_CODE`, and cancellations kept (`keep_cancellations`). Raises what `serve`
    raises (the process exits non-zero)."""
    service.exit_on_stop_timeout = True
    keep_cancellations()
    asyncio.run(serve(service))


async def _run_until_stopped(service: Service) -> None:
    """run() until it returns or `stopping` is set; raises the run's error or the service's failure."""
    run_task = asyncio.ensure_future(service.run())
    stop_task = asyncio.ensure_future(service.stopping.wait())
    try:
        done, _ = await asyncio.wait({run_task, stop_task}, return_when=asyncio.FIRST_COMPLETED)
        if run_task in done:
            run_task.result()
            _raise_failure(service)  # run() may return once `stopping` is set: a failure set it
            return
        service.begin_stop()  # `stopping` may have been set directly
        if service.graceful_stop_s > 0 and service.failure is None:
            await asyncio.wait({run_task}, timeout=max(0.0, service.stop_time_left() - service.stop_timeout_s))
        run_task.cancel()
        while not run_task.done() and service.stop_time_left() > 0:
            await asyncio.wait({run_task}, timeout=min(RECANCEL_S, service.stop_time_left()))
            if not run_task.done():  # swallowed (see `cancel_and_wait`): ask again
                log.warning("%s: run() still running %.0fs after its cancellation: cancelling it again",
                            service.worker_id, RECANCEL_S)
                run_task.cancel()
        if not run_task.done():  # a loop swallowed its cancellation, or waits on something that never ends
            log.error("%s: run() did not end within %.0fs of its cancellation; still pending:\n%s",
                      service.worker_id, service.stop_timeout_s, pending_report(asyncio.get_running_loop()))
            raise ServiceFailed(f"{service.worker_id}: run() did not end after its cancellation "
                                f"(stop_timeout_s {service.stop_timeout_s:.0f}s)")
        results = await asyncio.gather(run_task, return_exceptions=True)
        _raise_failure(service)
        if isinstance(results[0], Exception):
            raise results[0]
        if service.stop_signal is None:
            raise ServiceFailed(f"{service.worker_id} stopped itself without a signal "
                                "(`stopping` set with no recorded failure; see the log above)")
    finally:
        stop_task.cancel()
        run_task.cancel()


def _raise_failure(service: Service) -> None:
    if service.failure is not None:
        raise ServiceFailed(f"{service.worker_id} failed: {type(service.failure).__name__}: "
                            f"{service.failure}") from service.failure


async def _bounded_stop(service: Service) -> None:
    """stop(), within what is left of the stop's deadline; past it, log what is pending and raise."""
    stop_task = asyncio.ensure_future(service.stop())
    done, _ = await asyncio.wait({stop_task}, timeout=service.stop_time_left())
    if stop_task in done:
        stop_task.result()
        return
    log.error("%s: stop() did not finish within its stop's deadline (stop_timeout_s %.0fs); still pending:\n%s",
              service.worker_id, service.stop_timeout_s, pending_report(asyncio.get_running_loop()))
    stop_task.cancel()
    raise ServiceFailed(f"{service.worker_id}: stop() did not finish in {service.stop_timeout_s:.0f}s")
