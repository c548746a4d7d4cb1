"""How a local run stops once the learner has finished its budget, without losing an outcome.

::

    learner exits 0 (run_finished set: the store admits nothing more)
      ├─ drain: wait until the gate's `running` is 0, restarting any service that dies meanwhile
      │         (a dead store never drains; a restarted one rebuilds its groups from redelivery)
      ├─ stop the services (SIGTERM); the store's stop finalizes the run: everything it holds, and
      │         every admitted id still without an outcome, ends as one archived outcome
      └─ the store did not exit 0 (killed while stopping)? start it again and stop it: the
                finalization is idempotent and works from durable state (Redis + archive)

So "in flight at stop" is itself a recorded outcome (`in_flight_at_stop`), never a gap, whenever
the store dies (issue 16: a store killed near the end of a run once left 56 admitted trajectories
without any outcome).
"""

from __future__ import annotations

import logging
import signal
import time
from collections.abc import Callable

from trajmesh import security
from trajmesh.config import RunConfig
from trajmesh.gate import StalenessGate
from trajmesh.run.launcher import Mesh

log = logging.getLogger("trajmesh.run.run_end")

STORE_STOP_S = 120.0
"""How long the store may take to stop (its finalization reads the archive once)."""


def running(cfg: RunConfig) -> int:
    """The gate's `running`: admitted trajectories whose group has not come back."""
    r = security.redis_sync_client(cfg)
    try:
        return StalenessGate.from_config(r, cfg).counters().running
    finally:
        r.close()


def drain(cfg: RunConfig, timeout_s: float = 60.0, *, between: Callable[[], object] | None = None) -> int:
    """After the learner stopped: wait until nothing admitted is in flight (the gate's `running`
    is 0), so every admission has reached the store, calling `between` between looks (the local
    launcher restarts dead services there, as during the run). Returns what is still in flight
    after `timeout_s` (those end as `in_flight_at_stop`)."""
    deadline = time.monotonic() + timeout_s
    left = running(cfg)
    while left > 0 and time.monotonic() < deadline:
        if between is not None:
            between()
        time.sleep(0.3)
        left = running(cfg)
    if left:
        log.warning("%d trajectories still in flight after %.0fs of draining", left, timeout_s)
    return left


def drain_supervised(mesh: Mesh, timeout_s: float = 60.0) -> int:
    """`drain`, restarting the mesh's dead services while it waits."""
    return drain(mesh.cfg, timeout_s, between=mesh.restart_dead)


def end_run(mesh: Mesh, *, drain_s: float = 60.0, store_attempts: int = 3) -> int:
    """The stop path after the learner finished: drain, stop, and make sure a store finalized.
    Returns the trajectories in flight when draining gave up."""
    left = drain_supervised(mesh, drain_s)
    mesh.stop_services(grace_s=STORE_STOP_S)
    for _ in range(store_attempts):
        failed = [p for p in mesh.procs if p.name == "store" and p.popen.returncode != 0]
        if not failed:
            return left
        for p in failed:
            log.warning("%s exited with %s while stopping; starting it again to finalize the run",
                        p.label, p.popen.returncode)
            mesh.procs.remove(p)
            again = mesh.start_service(p.name, p.replica, p.extra)
            mesh.wait_healthy([again])
            again.popen.send_signal(signal.SIGTERM)
            again.popen.wait(timeout=STORE_STOP_S)
    raise RuntimeError(f"the store could not finalize the run in {store_attempts} attempts")
