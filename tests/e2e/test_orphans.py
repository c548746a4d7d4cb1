"""No orphans: a process's children die with it (issue 16 item 3).

A "service" process starts a child the way the rollout starts its engine (`die_with_parent`, same
process group) and is then SIGKILLed, so it can run no cleanup of its own. The child must be gone,
checked from /proc (every pid's command line, not only the pids we remember), by polling /proc
until a deadline: the disappearance is the event waited on. The control case (no parent-death
signal) shows the check fails when the child does outlive its parent, and the launcher's
`kill_group` takes such a child down with its service's process group.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time
import urllib.request
import uuid
from pathlib import Path

import pytest

from trajmesh.config import dump_config, load_config
from trajmesh.infra import NatsServer, RedisServer, free_port
from trajmesh.run.launcher import kill_group

pytestmark = pytest.mark.skipif(not Path("/proc/self/cmdline").exists(), reason="needs Linux /proc")

_DEADLINE_S = 30.0

# The service: starts a child (tagged by its command line) and waits; prints the child's pid.
_SERVICE = textwrap.dedent("""
    import signal, subprocess, sys, time
    from trajmesh.infra import die_with_parent
    tag, mode = sys.argv[1], sys.argv[2]
    kwargs = {"preexec_fn": die_with_parent(signal.SIGKILL)} if mode == "pdeathsig" else {}
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)", tag + "-child"], **kwargs)
    print(child.pid, flush=True)
    time.sleep(600)
""")


def _pids_with(tag: str) -> list[int]:
    """Every live process whose command line contains ``tag`` (zombies have an empty cmdline)."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes()
        except OSError:
            continue  # exited while we looked
        if tag.encode() in cmdline.split(b"\0"):
            found.append(int(entry.name))
    return found


def _poll_proc(tag: str, until: list[int], deadline_s: float = _DEADLINE_S) -> list[int]:
    """Poll /proc until the processes carrying ``tag`` are exactly ``until`` or the deadline
    passes; returns what /proc shows last."""
    deadline = time.monotonic() + deadline_s
    found = _pids_with(tag)
    while found != until and time.monotonic() < deadline:
        time.sleep(0.05)
        found = _pids_with(tag)
    return found


def _wait_until_gone(tag: str) -> list[int]:
    return _poll_proc(tag, [])


def _start_service(tag: str, mode: str) -> tuple[subprocess.Popen[bytes], int]:
    """The service (its argv carries ``tag``) and its child's pid (its argv carries ``tag-child``)."""
    service = subprocess.Popen([sys.executable, "-c", _SERVICE, tag, mode], stdout=subprocess.PIPE,
                               start_new_session=True)  # as the launcher starts services
    assert service.stdout is not None
    child_pid = int(service.stdout.readline())
    assert _poll_proc(f"{tag}-child", [child_pid]) == [child_pid]
    return service, child_pid


def test_child_with_parent_death_signal_dies_with_a_sigkilled_service() -> None:
    tag = f"trajmesh-orphan-test-{uuid.uuid4().hex}"
    service, _ = _start_service(tag, "pdeathsig")
    service.kill()
    service.wait()
    assert _wait_until_gone(f"{tag}-child") == []


def test_launcher_kills_the_group_of_a_dead_service_even_without_the_signal() -> None:
    tag = f"trajmesh-orphan-test-{uuid.uuid4().hex}-child"
    service, child_pid = _start_service(tag.removesuffix("-child"), "plain")
    try:
        service.kill()
        service.wait()
        # Control: without the parent-death signal the child outlives its SIGKILLed parent...
        assert _pids_with(tag) == [child_pid]
        assert os.getpgid(child_pid) == service.pid
        # ...until the launcher kills the dead service's process group, as restart_dead does.
        kill_group(service)
        assert _wait_until_gone(tag) == []
    finally:
        for pid in _pids_with(tag):
            os.kill(pid, 9)


def _children_with(parent: int, arg: str) -> list[int]:
    """Live processes whose parent is ``parent`` and whose command line has the argument ``arg``."""
    found = []
    for pid in _pids_with(arg):
        try:
            status = Path(f"/proc/{pid}/status").read_text()
        except OSError:
            continue
        ppid = next(int(line.split()[1]) for line in status.splitlines() if line.startswith("PPid:"))
        if ppid == parent:
            found.append(pid)
    return found


def _healthy(port: int) -> bool:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=2) as resp:
            return bool(resp.status == 200)
    except OSError:
        return False


@pytest.mark.e2e
@pytest.mark.timeout(300)
def test_a_sigkilled_rollout_leaves_no_engine_behind(tmp_path: Path, tiny_model_dir: str, nats_server: NatsServer,
                                                      redis_server: RedisServer) -> None:
    """The real rollout service with its real torch engine: SIGKILL the rollout, the engine goes."""
    cfg = load_config(None, {"run_dir": str(tmp_path / "run"), "model.path": tiny_model_dir,
                             "infra.nats_url": nats_server.url, "infra.redis_url": redis_server.public_url})
    config_path = tmp_path / "config.yaml"
    dump_config(cfg, config_path)
    port = free_port()
    with open(tmp_path / "rollout.log", "wb") as log:
        rollout = subprocess.Popen([sys.executable, "-m", "trajmesh.run.cli", "serve", "rollout", "--config",
                                    str(config_path), "--metrics-port", str(port)],
                                   stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    engine = "trajmesh.rollout.engines.engine_server"
    try:
        deadline = time.monotonic() + 240
        while not _healthy(port):  # ready = its engine answered /health
            assert rollout.poll() is None, (tmp_path / "rollout.log").read_text()[-3000:]
            assert time.monotonic() < deadline, "rollout not healthy"
            time.sleep(0.2)
        engines = _children_with(rollout.pid, engine)
        assert len(engines) == 1, engines
        rollout.kill()  # no stop(): only the kernel's parent-death signal can take the engine down
        rollout.wait()
        deadline = time.monotonic() + _DEADLINE_S
        while engines[0] in _pids_with(engine) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert engines[0] not in _pids_with(engine), "the engine outlived its SIGKILLed rollout"
    finally:
        kill_group(rollout)


# A launcher: starts the real environment service the way `trajmesh train` does, prints its pid, waits.
_LAUNCHER = textwrap.dedent("""
    import os, sys
    from pathlib import Path
    from trajmesh.config import dump_config, load_config
    from trajmesh.run.launcher import Mesh
    run_dir, config_path = Path(sys.argv[1]), Path(os.environ["ORPHAN_TEST_CONFIG"])  # only the service's argv has it
    cfg = load_config(None, {"run_dir": str(run_dir)})
    dump_config(cfg, config_path)
    mesh = Mesh(cfg, config_path)
    proc = mesh.start_service("environment", 0)
    mesh.wait_healthy([proc])
    print(proc.popen.pid, flush=True)
    sys.stdin.read()
""")


@pytest.mark.timeout(300)
def test_services_die_with_a_sigkilled_launcher(tmp_path: Path) -> None:
    """`trajmesh train` killed with SIGKILL runs no cleanup: its services get SIGTERM from the kernel
    (parent-death signal) and exit, instead of running on with nobody to stop them."""
    config_path = tmp_path / f"config-{uuid.uuid4().hex}.yaml"
    launcher = subprocess.Popen([sys.executable, "-c", _LAUNCHER, str(tmp_path / "run")], stdin=subprocess.PIPE,
                                stdout=subprocess.PIPE, env={**os.environ, "ORPHAN_TEST_CONFIG": str(config_path)})
    assert launcher.stdout is not None
    try:
        service_pid = int(launcher.stdout.readline())
        assert _pids_with(str(config_path)) == [service_pid]  # the service runs, found by its argv
        launcher.kill()
        launcher.wait()
        assert _wait_until_gone(str(config_path)) == []
    finally:
        launcher.kill()
        for pid in _pids_with(str(config_path)):
            os.kill(pid, 9)
