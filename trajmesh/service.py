"""The service lifecycle every trajmesh process shares: setup → run → stop.

    trajmesh serve SERVICE --config CONFIG
        │
        ├─ HTTP :metrics_port   GET /healthz (200 once setup finished, 503 before/after)
        │                       GET /metrics (Prometheus text format)
        ├─ setup()              connect to NATS/Redis, open servers, load models
        ├─ run()                the service's supervised loops; returning ends the process
        └─ stop()               on SIGTERM/SIGINT or when run() returns or raises

A loop that returns early is a crash: `supervise` cancels its siblings and re-raises, so the process
exits non-zero and the launcher (or Kubernetes) sees it.
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


class Service(ABC):
    """One trajmesh process. Subclasses wire their components in `setup()` and loop in `run()`."""

    name: str = "service"
    graceful_stop_s: float = 0.0
    """On SIGTERM, how long `run()` may take to finish its current unit of work before it is
    cancelled (it should watch `self.stopping`)."""

    def __init__(self, cfg: RunConfig, *, replica: int = 0, metrics_port: int = 0) -> None:
        self.cfg = cfg
        self.replica = replica
        self.metrics_port = metrics_port
        self.worker_id = f"{self.name}-{replica}-{os.getpid()}"
        self.ready = False
        self.stopping = asyncio.Event()

    @abstractmethod
    async def setup(self) -> None: ...

    @abstractmethod
    async def run(self) -> None: ...

    async def stop(self) -> None:  # noqa: B027 - optional hook, not abstract
        """Release resources; must be safe to call after a partial setup."""


async def supervise(*loops: Awaitable[None]) -> None:
    """Run loops together; the first to finish or fail cancels the others (close → cancel → gather)."""
    tasks = [asyncio.ensure_future(x) for x in loops]
    try:
        done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
        for t in done:
            t.result()  # re-raise a crash
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


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
    """Run a service to completion: HTTP endpoints, setup, run, and stop on signal or exit."""
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, service.stopping.set)
    runner = await _start_http(service)
    log.info("%s serving health/metrics on :%d", service.worker_id, service.metrics_port)
    try:
        await service.setup()
        service.ready = True
        log.info("%s ready", service.worker_id)
        run_task = asyncio.ensure_future(service.run())
        stop_task = asyncio.ensure_future(service.stopping.wait())
        done, _ = await asyncio.wait({run_task, stop_task}, return_when=asyncio.FIRST_COMPLETED)
        if run_task in done:
            run_task.result()
        else:
            if service.graceful_stop_s > 0:
                await asyncio.wait({run_task}, timeout=service.graceful_stop_s)
            run_task.cancel()
            results = await asyncio.gather(run_task, return_exceptions=True)
            if isinstance(results[0], Exception):
                raise results[0]
    finally:
        service.stopping.set()
        try:
            await service.stop()
        finally:
            await runner.cleanup()
            log.info("%s stopped", service.worker_id)
