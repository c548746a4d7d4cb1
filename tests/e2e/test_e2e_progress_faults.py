"""Progress after a fault, not only accounting (issue 29): a mesh run with real processes.

The rollout process is SIGSTOPped (its engine child keeps running) for longer than every timeout
on its path — the task ack wait, the JetStream API timeout, the engine request timeout — and then
SIGCONTed. The run must then make progress: the learner takes ``K`` further steps within a bound
derived from the run's own rate before the fault (plus one task ack wait), no service may have
died of it (a pause that clears is not a crash), and at the end every admitted trajectory has
exactly one archived outcome, none is still in flight at stop, nothing is stale, the gate
reconciles with the archive and no process of the run is left.

A rollout that came back from such a pause once crashed a task with ``TimeoutError()`` and never
exited (no restart): the learner starved for the rest of the run. The pause lands while a
trajectory publish of the rollout waits for its PubAck (the moment that timed out). The
environment's gRPC deadline (120 s) and the wait for an announced version (30 s) are longer than
the pause: a Step answered during it and a version announced meanwhile are read on resume.

A second run pauses every service in turn the same way — the rollout (engine running), the
store, a grader, the environment, the learner (each with its children) — with the same progress
check after each pause. The same check runs after NATS and Redis are SIGKILLed together (slow),
where the rollout once crashed the same way and kept sampling with old weights.
"""

from __future__ import annotations

import ctypes
import json
import os
import signal
import socket
import time
import urllib.request
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest
from mesh_checks import (
    check_archive,
    check_gate_reconciles,
    check_no_stale,
    last_step,
    processes_marked,
    supervise_until,
    write_manifest,
)

from trajmesh.bus import STREAM_TRAJ_RAW, Layout
from trajmesh.config import RunConfig, load_config
from trajmesh.infra import NatsServer
from trajmesh.run.launcher import Mesh, accounting, start_mesh, tail
from trajmesh.run.run_end import end_run

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(600)]

ETA = 1
RATE_FROM, RATE_TO = 1, 4
"""The pre-fault rate is measured between these learner steps."""
K = 3
"""Learner steps the run must make after the fault clears."""
SLACK = 10.0
"""How many times slower than before the fault those K steps may be (a loaded 2-core machine)."""
GROUP_SIZE = 16
"""Large groups: the rollout publishes a group's trajectories one after another, so a group's
publishing lasts long enough for the pause to land in it."""
TASK_ACK_WAIT_S = 4.0
STORE_ACK_WAIT_S = 4.0
REQUEST_TIMEOUT_S = 6.0
JETSTREAM_API_TIMEOUT_S = 5.0
"""nats-py's default timeout of a JetStream API call (a publish waiting for its PubAck)."""
STOP_S = 1.5 * max(TASK_ACK_WAIT_S, REQUEST_TIMEOUT_S, JETSTREAM_API_TIMEOUT_S)
"""How long the rollout stays stopped: past every timeout on its path (the fault's duration)."""


BURST = ETA + 1
"""The most learner steps the run can take without a new admission: the gate keeps admitted,
untrained work within (η + 1) batches (trajmesh/gate.py), so this bounds both the steps taken
while a fault is applied and how far a wait for a step count overshoots it (a backlog trained at
once), whatever the machine's speed."""


def _budget(faults: int) -> int:
    """The run's learner steps: enough that after each fault `K` more remain. The wait for
    `RATE_TO` may overshoot by BURST, each fault may see BURST steps while applied, and each wait
    for its K steps may overshoot by BURST again."""
    return RATE_TO + faults * (K + 2 * BURST)


def _build_config(run_dir: Path, model_dir: str, steps: int) -> RunConfig:
    return load_config(None, {
        "run_dir": str(run_dir), "model.path": model_dir, "gate.eta": ETA,
        "tasks.group_size": GROUP_SIZE, "tasks.heldout_size": 20, "tasks.train_size": 300,
        "tasks.sampling.max_new_tokens": 6, "store.drop_zero_variance_groups": False,
        "store.intake_ack_wait_s": STORE_ACK_WAIT_S, "rollout.task_ack_wait_s": TASK_ACK_WAIT_S,
        "rollout.engine.request_timeout_s": REQUEST_TIMEOUT_S,
        "rollout.replicas": 1, "rollout.concurrent_tasks": 2, "grader.replicas": 1,
        "learner.engine.type": "torch", "learner.batch_groups": 1, "learner.max_steps": steps,
        "learner.checkpoint_every": 3, "learner.keep_batches": False,
        # chain_sum's episodes through the environment service, which is one of the paused services
        # (a stateless one-turn environment otherwise plays in the rollout's process, and pausing
        # the service would then stop nothing: the run ran through its budget during that fault)
        "rollout.stateless_environments_in_process": False,
    })


def _engine_pid(rollout_pid: int) -> int:
    """The rollout's torch engine process (its child running trajmesh.rollout.engines.engine_server)."""
    for child in Path(f"/proc/{rollout_pid}/task/{rollout_pid}/children").read_text().split():
        if b"trajmesh.rollout.engines.engine_server" in Path(f"/proc/{child}/cmdline").read_bytes():
            return int(child)
    raise AssertionError("the rollout has no engine process")


_SYS_PIDFD_GETFD = 438
"""pidfd_getfd(2) (Linux ≥ 5.6; the same number on every architecture)."""


def _socket_fds(pid: int) -> dict[str, int]:
    """Socket inode -> fd number, of `pid`'s open sockets."""
    fds = {}
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        try:
            target = os.readlink(fd)
        except OSError:
            continue  # closed meanwhile
        if target.startswith("socket:["):
            fds[target[len("socket:["):-1]] = int(fd.name)
    return fds


def _unread_from(pid: int, port: int) -> bytes:
    """What arrived on `pid`'s TCP connections to local `port` and it has not read yet, peeked at
    (MSG_PEEK on a duplicate of its socket, pidfd_getfd: `pid` still reads every byte itself).
    While the process is stopped, the answers to what it had in flight wait there."""
    fds = _socket_fds(pid)
    libc = ctypes.CDLL(None, use_errno=True)
    unread = b""
    for table in ("tcp", "tcp6"):
        for line in Path(f"/proc/{pid}/net/{table}").read_text().splitlines()[1:]:
            cols = line.split()
            if int(cols[2].rsplit(":", 1)[1], 16) != port or cols[9] not in fds:
                continue
            pidfd = os.pidfd_open(pid)
            try:
                dup = libc.syscall(_SYS_PIDFD_GETFD, pidfd, fds[cols[9]], 0)
                if dup < 0:
                    raise OSError(ctypes.get_errno(), "pidfd_getfd")
                with socket.socket(fileno=dup) as sock:
                    try:
                        unread += sock.recv(1 << 20, socket.MSG_PEEK | socket.MSG_DONTWAIT)
                    except BlockingIOError:
                        pass  # nothing unread
            finally:
                os.close(pidfd)
    return unread


def _raw_last_seq(monitor_url: str, stream: str) -> int:
    """The last sequence of the stream the rollout publishes trajectories to (NATS /jsz)."""
    with urllib.request.urlopen(f"{monitor_url}/jsz?streams=true", timeout=5) as r:
        accounts = json.loads(r.read()).get("account_details") or []
    for account in accounts:
        for detail in account.get("stream_detail") or []:
            if detail["name"] == stream:
                return int(detail["state"]["last_seq"])
    return 0


def _wait_for_publish(nats: NatsServer, stream: str, timeout_s: float = 10.0) -> None:
    """Returns the moment `stream` grows (a trajectory was just published), or after `timeout_s`."""
    last = _raw_last_seq(nats.monitor_url, stream)
    deadline = time.monotonic() + timeout_s
    while _raw_last_seq(nats.monitor_url, stream) == last and time.monotonic() < deadline:
        pass  # a poll on the stream's state


def _pause_while_publishing(pid: int, nats: NatsServer, stream: str, tries: int = 100) -> None:
    """SIGSTOP `pid` while a trajectory publish of it waits for its PubAck: the moment the stream
    it publishes to grows (it publishes a group's trajectories one after another), stop it, and
    keep it stopped if a PubAck of that stream then arrives unread within a few milliseconds. A
    random moment mostly finds the rollout idle (the gate holds it), and a pause then times
    nothing out."""
    pub_ack = f'"stream":"{stream}"'.encode()
    for _ in range(tries):
        _wait_for_publish(nats, stream)
        os.kill(pid, signal.SIGSTOP)
        time.sleep(0.05)  # the answer's travel time on loopback, not a synchronization
        if pub_ack in _unread_from(pid, nats.port):
            return
        os.kill(pid, signal.SIGCONT)
    raise AssertionError(f"no PubAck was waiting for the paused rollout in {tries} tries")


def _state(pid: int) -> str:
    """The process's state letter from /proc (R, S, T for stopped...)."""
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]


@dataclass
class Recovery:
    """What a fault allows the run on the way back, beyond K steps at the pre-fault rate × SLACK."""

    extra_s: float
    """Seconds of recovery the fault itself needs (a redelivery, servers and services restarting)."""
    restarts: bool
    """Whether a service may die of the fault (and be restarted)."""
    note: str = ""


def _pause_rollout(mesh: Mesh, start_s: float) -> Recovery:
    """SIGSTOP the rollout process only (its engine keeps running) while a trajectory publish of it
    waits for its PubAck, for STOP_S, then SIGCONT. Nothing may die of it; the run may take one
    task ack wait longer (what the rollout held was redelivered meanwhile)."""
    rollout = next(p for p in mesh.procs if p.name == "rollout")
    engine = _engine_pid(rollout.popen.pid)
    assert mesh.nats is not None
    _pause_while_publishing(rollout.popen.pid, mesh.nats, Layout(mesh.cfg.infra.namespace).stream(STREAM_TRAJ_RAW))
    try:
        assert _state(engine) != "T", "the engine was stopped with its rollout"
        time.sleep(STOP_S)  # the fault's duration, not a synchronization
        assert _state(rollout.popen.pid) == "T" and _state(engine) != "T"
    finally:
        os.kill(rollout.popen.pid, signal.SIGCONT)
    retried = rollout.log_path.read_text(errors="replace").count("retrying in")
    return Recovery(TASK_ACK_WAIT_S, restarts=False, note=f"rollout publishes retried: {retried}")


def _pause(name: str) -> Callable[[Mesh, float], Recovery]:
    """SIGSTOP service `name` with its children (its process group) for STOP_S, then SIGCONT.
    Nothing may die of it; the run may take one task ack wait and one store ack wait longer (what
    the paused service held is redelivered meanwhile)."""
    def fault(mesh: Mesh, start_s: float) -> Recovery:
        victim = next(p for p in mesh.procs if p.name == name and p.popen.poll() is None)
        os.killpg(victim.popen.pid, signal.SIGSTOP)
        try:
            time.sleep(STOP_S)  # the fault's duration, not a synchronization
            assert _state(victim.popen.pid) == "T"
        finally:
            os.killpg(victim.popen.pid, signal.SIGCONT)
        return Recovery(TASK_ACK_WAIT_S + STORE_ACK_WAIT_S, restarts=False, note=f"{name} paused")
    return fault


def _kill_nats_and_redis(mesh: Mesh, start_s: float) -> Recovery:
    """SIGKILL nats-server and Redis together while the rollout publishes, keep them down for
    STOP_S (every request in flight times out), then the launcher restarts both (same ports and
    data). The run may take the servers' restart, a service's restart (this run's own mesh start)
    and two task ack waits longer."""
    assert mesh.nats is not None and mesh.redis is not None
    stream = Layout(mesh.cfg.infra.namespace).stream(STREAM_TRAJ_RAW)
    _wait_for_publish(mesh.nats, stream)
    mesh.nats.kill()
    mesh.redis.kill()
    time.sleep(STOP_S)  # the outage's duration, not a synchronization
    begun = time.monotonic()
    mesh.restart_dead()  # both servers, back once healthy
    assert mesh.nats.running and mesh.redis.running
    restart_s = time.monotonic() - begun
    return Recovery(restart_s + start_s + 2 * TASK_ACK_WAIT_S, restarts=True,
                    note=f"servers back in {restart_s:.1f} s")


def _run_with_faults(tmp_path: Path, model_dir: str, monkeypatch: pytest.MonkeyPatch,
                     faults: list[Callable[[Mesh, float], Recovery]]) -> None:
    """Runs the mesh to RATE_TO (the pre-fault rate), applies each fault in turn (given the mesh
    and how long this run's mesh took to start), K learner steps within the bound after each, then
    checks accounting and that nothing is left."""
    mark = uuid.uuid4().hex
    monkeypatch.setenv("TRAJMESH_TEST_MARK", mark)
    steps = _budget(len(faults))
    cfg = _build_config(tmp_path / "run", model_dir, steps)
    Path(cfg.run_dir).mkdir(parents=True)
    write_manifest(cfg)
    started = time.monotonic()
    mesh = start_mesh(cfg)
    start_s = time.monotonic() - started  # one start of every service: covers restarting one
    notes = []
    try:
        cfg = mesh.cfg
        t_from = supervise_until(mesh, lambda: last_step(cfg) >= RATE_FROM, 300, "before the fault")
        s_from = last_step(cfg)
        t_to = supervise_until(mesh, lambda: last_step(cfg) >= RATE_TO, 300, "before the fault")
        s_per_step = (t_to - t_from) / max(1, last_step(cfg) - s_from)
        for fault in faults:
            restarts_before = dict(mesh.restarts)
            recovery = fault(mesh, start_s)
            before = last_step(cfg)
            assert before + K <= steps, f"the learner reached step {before} of {steps} during the fault"
            bound_s = recovery.extra_s + SLACK * K * s_per_step
            supervise_until(mesh, lambda b=before: last_step(cfg) >= b + K, bound_s,
                             f"no progress after the fault ({recovery.note}; {s_per_step:.2f} s/step "
                             f"before it, {K} steps from step {before} allowed {bound_s:.0f} s)")
            if not recovery.restarts:
                died = {k: n for k, n in mesh.restarts.items() if restarts_before.get(k) != n}
                assert not died, f"a service died of the fault ({recovery.note}): {died}\n" + "\n".join(
                    tail(p.log_path) for p in mesh.procs if (p.name, p.replica) in died)
            notes.append(recovery.note)

        learner = lambda: next(p for p in mesh.procs if p.name == "learner")  # noqa: E731 - replaced on restart
        supervise_until(mesh, lambda: learner().popen.poll() == 0, 300, "the learner's budget")
        left = end_run(mesh)
        acct = accounting(cfg)
        rows = check_archive(cfg, acct, ETA)
        check_gate_reconciles(cfg, rows)
    finally:
        mesh.stop_services()
        mesh.stop_infra()
    assert left == 0, f"{left} trajectories still in flight at stop"
    assert not any(k.startswith("in_flight_at_stop") for k in acct["by_reason"]), acct["by_reason"]
    check_no_stale(acct, cfg.run_dir)
    assert not processes_marked(mark), processes_marked(mark)
    print(f"{s_per_step:.2f} s/step before the faults; {'; '.join(notes)}; restarts {mesh.restarts}; "
          f"outcomes {acct['by_reason']}")


def test_every_service_paused_in_turn_then_the_run_makes_progress(
        tmp_path: Path, tiny_model_dir: str, monkeypatch: pytest.MonkeyPatch) -> None:
    _run_with_faults(tmp_path, tiny_model_dir, monkeypatch,
                     [_pause_rollout, *(_pause(n) for n in ("store", "grader", "environment", "learner"))])


@pytest.mark.slow
def test_nats_and_redis_killed_together_then_the_run_makes_progress(
        tmp_path: Path, tiny_model_dir: str, monkeypatch: pytest.MonkeyPatch) -> None:
    _run_with_faults(tmp_path, tiny_model_dir, monkeypatch, [_kill_nats_and_redis])
