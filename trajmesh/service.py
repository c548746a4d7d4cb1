"""The service lifecycle every trajmesh process shares: setup → run → stop.

    trajmesh serve SERVICE --config CONFIG
        │
        ├─ HTTP :metrics_port   GET /healthz (200 once setup finished, 503 before/after)
        │                       GET /metrics (Prometheus text format)
        ├─ setup()              connect to NATS/Redis, open servers, load models
        ├─ run()                the service's supervised loops; returning ends the process (exit 0)
        └─ stop()               on SIGTERM/SIGINT or when run() returns or raises; bounded by
                                `stop_timeout_s`

Exits are honest. A supervised loop that returns early is a crash: `supervise` cancels its
siblings and raises `LoopError` naming the loop (and its error), so `serve` raises, the process
exits non-zero and the launcher (or Kubernetes) sees it. A service that sets `stopping` itself
without a signal (e.g. a crashed background task) is a failure too: it should call `fail(error)`,
which records the error that `serve` raises. Only a signal or `run()` returning ends with exit 0.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
from abc import ABC, abstractmethod
from collections.abc import Awaitable
from typing import Any

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, REGISTRY, generate_latest

from trajmesh.config import RunConfig

log = logging.getLogger("trajmesh.service")


class LoopError(RuntimeError):
    """A supervised loop returned or raised; the message names the loop (and the error)."""


class ServiceFailed(RuntimeError):
    """A service stopped itself without a signal; the message names the service and the cause."""


class Service(ABC):
    """One trajmesh process. Subclasses wire their components in `setup()` and loop in `run()`."""

    name: str = "service"
    graceful_stop_s: float = 0.0
    """On SIGTERM, how long `run()` may take to finish its current unit of work before it is
    cancelled (it should watch `self.stopping`)."""
    stop_timeout_s: float = 120.0
    """How long `stop()` may take (flushes, the store's finalization, a final checkpoint) before
    `serve` gives up on it and the process exits non-zero (the launcher allows the store 120 s,
    trajmesh.run.run_end.STORE_STOP_S). A service whose stop may take longer overrides it."""

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

    def fail(self, error: BaseException) -> None:
        """Stop this service because of ``error`` (e.g. a crashed background task): `serve` stops
        it and raises the error, so the process exits non-zero. The first failure wins."""
        if self.failure is None:
            self.failure = error
        self.stopping.set()

    def request_stop(self, sig: int) -> None:
        """Signal handler: a clean stop was asked for (exit 0 unless something fails on the way)."""
        self.stop_signal = sig
        self.stopping.set()

    @abstractmethod
    async def setup(self) -> None: ...

    @abstractmethod
    async def run(self) -> None: ...

    async def stop(self) -> None:  # noqa: B027 - optional hook, not abstract
        """Release resources; must be safe to call after a partial setup."""


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
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


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
    loop = asyncio.get_running_loop()
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
        service.stopping.set()
        try:
            await _bounded_stop(service)
        finally:
            await runner.cleanup()
            log.info("%s stopped", service.worker_id)


async def _run_until_stopped(service: Service) -> None:
    """run() until it returns or `stopping` is set; raises the run's error or the service's failure."""
    run_task = asyncio.ensure_future(service.run())
    stop_task = asyncio.ensure_future(service.stopping.wait())
    try:
        done, _ = await asyncio.wait({run_task, stop_task}, return_when=asyncio.FIRST_COMPLETED)
        if run_task in done:
            run_task.result()
            return
        if service.graceful_stop_s > 0 and service.failure is None:
            await asyncio.wait({run_task}, timeout=service.graceful_stop_s)
        run_task.cancel()
        results = await asyncio.gather(run_task, return_exceptions=True)
        if service.failure is not None:
            raise ServiceFailed(f"{service.worker_id} failed: {type(service.failure).__name__}: "
                                f"{service.failure}") from service.failure
        if isinstance(results[0], Exception):
            raise results[0]
        if service.stop_signal is None:
            raise ServiceFailed(f"{service.worker_id} stopped itself without a signal "
                                "(`stopping` set with no recorded failure; see the log above)")
    finally:
        stop_task.cancel()
        run_task.cancel()


async def _bounded_stop(service: Service) -> None:
    try:
        await asyncio.wait_for(service.stop(), timeout=service.stop_timeout_s)
    except asyncio.TimeoutError:  # TimeoutError from 3.11 on
        raise ServiceFailed(f"{service.worker_id}: stop() did not finish in {service.stop_timeout_s:.0f}s") from None
