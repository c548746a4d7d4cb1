"""The resource class per-process rlimits cannot close, closed by one cgroup per call (v1 or v2).

Each attack spreads memory or CPU over what RLIMIT_AS / RLIMIT_CPU do not see (many processes,
memfds, /dev/shm files, detached SysV shm) and passes with the cgroup off
(`TRAJMESH_SANDBOX_CGROUP=none`): the program then ends `ok` holding several times `memory_bytes`,
or burns several times `cpu_s`. With the cgroup it ends SANDBOX_ERROR/memory_limit or cpu_limit.
Run as root in this process and as uid 65534 from a child in a cgroup delegated to it. No call's
cgroup is left behind: after each test, after a timeout, and after its service is killed -9
mid-call (the next service's start sweeps it).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from repo_paths import REPO
from test_sandbox_escapes import _attack_with, _rootless_python

from trajmesh import sandbox
from trajmesh.sandbox import cgroups


def _host_mode() -> cgroups.CgroupMode:
    """The mode this host gives, whatever TRAJMESH_SANDBOX_CGROUP says: with it set to `none` these
    tests run against a sandbox without cgroups (and fail)."""
    saved = os.environ.pop(cgroups.ENV, None)
    try:
        return cgroups.detect()
    finally:
        if saved is not None:
            os.environ[cgroups.ENV] = saved


MODE = _host_mode() if sandbox.available() else cgroups.CgroupMode("none", problem="no sandbox")
pytestmark = [pytest.mark.skipif(not sandbox.available(), reason="sandbox unavailable on this kernel"),
              pytest.mark.timeout(120)]
CI = os.environ.get("CI", "").lower() == "true"


def _mounted_hierarchies() -> list[str]:
    """The cgroup file systems this host mounts (``cgroup2``, ``cgroup``), whatever their state."""
    return sorted({m.fstype for m in cgroups._mounts() if m.fstype in ("cgroup", "cgroup2")})


@pytest.fixture(autouse=True)
def _usable_cgroup_mode() -> None:
    """Without a per-call cgroup these tests cannot run. Where the host mounts no cgroup at all the
    skip says so; where it mounts one that the sandbox cannot use (not writable, a failed set-up),
    that is a broken host, and under ``CI=true`` a failure naming the problem, not a skip."""
    if MODE.kind != "none":
        return
    mounted = _mounted_hierarchies()
    if mounted and CI:
        pytest.fail(f"CI=true: cgroup {'/'.join(mounted)} is mounted but the sandbox cannot use it: {MODE.problem}")
    pytest.skip(f"no per-call cgroup here ({'mounted but unusable' if mounted else 'none mounted'}): {MODE.problem}")

MiB = 1 << 20
MEMORY = dict(wall_s=20.0, cpu_s=5, memory_bytes=96 * MiB, max_processes=16, tmpfs_bytes=256 * MiB,
              file_size_bytes=8 * MiB, output_bytes=8192)
"""Small limits: each attack holds ~2x memory_bytes (192 MiB) in pieces RLIMIT_AS or FSIZE allow."""

# Each prints "held N" (MiB held at once) once all of it is held, then exits 0.
ATTACKS = {
    # A child that wrote its dot may be OOM-killed after (cgroup v1 kills one process): "held" only
    # when all six are alive together once every dot is in, each still holding its 32 MiB.
    "processes": ("import os, time\nr, w = os.pipe()\npids = []\nfor _ in range(6):\n    pid = os.fork()\n"
                  "    if pid == 0:\n        x = b'x' * (32 << 20)\n        os.write(w, b'.')\n        time.sleep(60)\n"
                  "        os._exit(0)\n    pids.append(pid)\n"
                  "n = 0\nwhile n < 6:\n    n += len(os.read(r, 6))\n"
                  "if all(os.waitpid(p, os.WNOHANG) == (0, 0) for p in pids):\n    print('held', 6 * 32)"),
    "memfd": ("import os\nfds = []\nfor i in range(28):\n    fd = os.memfd_create('m%d' % i)\n"
              "    for _ in range(7):\n        os.write(fd, b'x' * (1 << 20))\n    fds.append(fd)\n"
              "print('held', 28 * 7)"),
    "dev_shm": ("for i in range(28):\n    with open('/dev/shm/f%d' % i, 'wb') as fh:\n"
                "        for _ in range(7):\n            fh.write(b'x' * (1 << 20))\nprint('held', 28 * 7)"),
    "sysv_shm": ("import ctypes\nlibc = ctypes.CDLL(None, use_errno=True)\nlibc.shmat.restype = ctypes.c_void_p\n"
                 "for i in range(6):\n    sid = libc.shmget(0, 32 << 20, 0o1000 | 0o600)\n"
                 "    assert sid >= 0, ctypes.get_errno()\n    addr = libc.shmat(sid, None, 0)\n"
                 "    ctypes.memset(addr, 1, 32 << 20)\n    libc.shmdt(ctypes.c_void_p(addr))\n"  # detached, not removed
                 "print('held', 6 * 32)"),
}

CPU_BURNERS = ("import os, time\nfor _ in range(5):\n    if os.fork() == 0:\n        break\nlast = 0.0\n"
               "while True:\n    t = time.process_time()\n    if t - last >= 0.05:\n        last = t\n"
               "        os.write(1, b'%d %.3f\\n' % (os.getpid(), t))")
"""Six processes spinning, each under RLIMIT_CPU (cpu_s): together six times the budget. Each
writes its own CPU seconds so far on stdout."""


def _cpu_used(stdout: str) -> float:
    """CPU seconds the burners reported, summed over processes (the last report of each)."""
    last: dict[str, float] = {}
    for line in stdout.splitlines():
        parts = line.split()
        if len(parts) == 2:
            last[parts[0]] = float(parts[1])
    return sum(last.values())


def _ours(pid: int) -> list[str]:
    """Call cgroups of service `pid` under this process's parents."""
    return [p for p in cgroups.leftovers(MODE) if os.path.basename(p).startswith(f"{cgroups.CALL_PREFIX}{pid}-")]


@pytest.fixture(autouse=True)
def no_cgroup_left() -> Iterator[None]:
    assert _ours(os.getpid()) == []
    yield
    assert _ours(os.getpid()) == [], "a call's cgroup outlived the call"


@pytest.mark.parametrize("attack", sorted(ATTACKS))
def test_memory_outside_rlimit_as_is_one_budget(attack: str) -> None:
    res = sandbox.run_code(ATTACKS[attack], limits=sandbox.SandboxLimits(**MEMORY))  # type: ignore[arg-type]
    assert "held" not in res.stdout, f"held {res.stdout.split()[-1]} MiB with memory_bytes 96 MiB"
    assert (res.status, res.subclass) == (sandbox.SANDBOX_ERROR, "memory_limit"), res


def test_cpu_seconds_of_all_processes_are_one_budget() -> None:
    res = sandbox.run_code(CPU_BURNERS, limits=sandbox.SandboxLimits(wall_s=30.0, cpu_s=1, max_processes=8))
    used = _cpu_used(res.stdout)
    assert 0.5 < used < 2.0, f"the call's processes used {used:.1f} CPU seconds with cpu_s=1"
    assert (res.status, res.subclass) == (sandbox.SANDBOX_ERROR, "cpu_limit"), res


def test_a_fork_bomb_stops_at_pids_max() -> None:
    code = "import os\nwhile True:\n    os.fork()"
    res = sandbox.run_code(code, limits=sandbox.SandboxLimits(wall_s=10.0, cpu_s=2, max_processes=8))
    assert (res.status, res.subclass) == (sandbox.SANDBOX_ERROR, "pids_limit"), res


@pytest.mark.skipif(os.geteuid() != 0 or _rootless_python() is None, reason="needs root to delegate a cgroup to uid 65534")
@pytest.mark.parametrize("attack", ["processes", "sysv_shm", "cpu"])
def test_the_cgroup_holds_for_an_unprivileged_service(attack: str) -> None:
    if attack == "cpu":
        res = _attack_with("rootless", CPU_BURNERS, {"wall_s": 30.0, "cpu_s": 1, "max_processes": 8})
        expected = "cpu_limit"
        assert _cpu_used(res["stdout"]) < 2.0
    else:
        res = _attack_with("rootless", ATTACKS[attack], MEMORY)
        expected = "memory_limit"
    assert "held" not in res["stdout"], f"held {res['stdout'].split()[-1]} MiB with memory_bytes 96 MiB"
    assert (res["status"], res["subclass"]) == (sandbox.SANDBOX_ERROR, expected), res
    assert res["cgroup"] == MODE.kind  # uid 65534 made its calls' cgroups in the one delegated to it


def test_a_timed_out_call_leaves_no_cgroup() -> None:
    res = sandbox.run_code("import os, time\nos.fork()\ntime.sleep(60)", limits=sandbox.SandboxLimits(wall_s=1.0))
    assert (res.status, res.subclass) == (sandbox.SANDBOX_ERROR, "wall_timeout")
    # the fixture checks that no cgroup of this process is left


_SERVICE = "import sys\nsys.path.insert(0, sys.argv[1])\nfrom trajmesh import sandbox\n"


def _alive(pid: int) -> bool:
    try:
        return open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def test_a_service_killed_mid_call_leaves_a_cgroup_the_next_start_sweeps() -> None:
    call = _SERVICE + "sandbox.run_code('import time\\ntime.sleep(100)', limits=sandbox.SandboxLimits(wall_s=100.0))\n"
    service = subprocess.Popen([sys.executable, "-c", call, str(REPO)])
    try:
        deadline = time.monotonic() + 60
        procs: list[int] = []
        while len(procs) < 3 and time.monotonic() < deadline:  # the init's child, pid 1 and the program
            stale = _ours(service.pid)
            procs = [int(p) for p in open(stale[0] + "/cgroup.procs").read().split()] if stale else []
            time.sleep(0.02)  # a poll on the kernel's view of the call's cgroup
        assert len(procs) >= 3, "the call never started"
        service.send_signal(signal.SIGKILL)
        service.wait()
    finally:
        if service.poll() is None:
            service.kill()
            service.wait()
    stale = _ours(service.pid)
    assert stale, "nothing to sweep: the call's cgroup went with its service"
    out = subprocess.run([sys.executable, "-c", _SERVICE + "print(sandbox.cgroup_mode().kind)", str(REPO)],
                         capture_output=True, text=True, timeout=60, check=True)
    assert out.stdout.strip() == MODE.kind
    assert _ours(service.pid) == [], "the next service's start did not sweep the dead one's cgroup"
    assert [p for p in procs if _alive(p)] == [], "a process of the dead service's call still runs"


@pytest.mark.skipif(MODE.kind != "v2", reason="cgroup v1 host: the v2 files (memory.max, cpu.max) do not exist here")
def test_v2_writes_the_unified_limits() -> None:
    group = cgroups.CallCgroup.create(MODE, 64 * MiB, 11, 0.5)
    try:
        read = {f: Path(group.paths["memory"], f).read_text().strip() for f in ("memory.max", "memory.swap.max",
                                                                                 "memory.oom.group", "pids.max", "cpu.max")}
        assert read == {"memory.max": str(64 * MiB), "memory.swap.max": "0", "memory.oom.group": "1",
                        "pids.max": "11", "cpu.max": "50000 100000"}
    finally:
        group.remove()


@pytest.mark.skipif(MODE.kind != "v1", reason="cgroup v2 host: the v1 files do not exist there")
def test_v1_writes_each_hierarchys_limits() -> None:
    group = cgroups.CallCgroup.create(MODE, 64 * MiB, 11, 0.5)
    try:
        mem, pids, cpu = group.paths["memory"], group.paths["pids"], group.paths["cpu"]
        assert Path(mem, "memory.limit_in_bytes").read_text().strip() == str(64 * MiB)
        if Path(mem, "memory.memsw.limit_in_bytes").exists():
            assert Path(mem, "memory.memsw.limit_in_bytes").read_text().strip() == str(64 * MiB)
        assert Path(pids, "pids.max").read_text().strip() == "11"
        assert (Path(cpu, "cpu.cfs_quota_us").read_text().strip(), Path(cpu, "cpu.cfs_period_us").read_text().strip()) \
            == ("50000", "100000")
    finally:
        group.remove()
