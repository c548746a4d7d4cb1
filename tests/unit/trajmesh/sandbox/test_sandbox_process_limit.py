"""`SandboxLimits.max_processes` bounds every task of a call at its peak (issue 41, item 5).

The attack tries to get a child user namespace (unshare, then a raw clone), raises its
RLIMIT_NPROC as far as the kernel lets it, then forks until a fork is refused and holds every
child. The peak is measured by the kernel or from the host, never by the sandbox: with the host's
per-call cgroup, the call cgroup's `pids.peak` (read just before the cgroup is removed); without
one (`TRAJMESH_SANDBOX_CGROUP=none`), the tasks of the namespaces' creator and all its descendants,
counted in the host's /proc once the program says (its process name) that it holds them. Each
runs as root and as uid 65534 (`test_sandbox_escapes._attack_with`). With the cgroup, the peak
was max_processes + 2 (18 with 16) while pids.max left the sandbox's own two tasks out of the count.
"""

from __future__ import annotations

import os
import secrets
import shutil
import signal
import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import pytest
from test_sandbox_cgroup import CI, MODE, _mounted_hierarchies
from test_sandbox_escapes import _attack_with, _rootless_python

from trajmesh import sandbox
from trajmesh.sandbox import cgroups

pytestmark = [pytest.mark.skipif(not sandbox.available(), reason="sandbox unavailable on this kernel"),
              pytest.mark.timeout(120)]

MAX_PROCESSES = 16
LIMITS = {"wall_s": 20.0, "cpu_s": 5, "memory_bytes": 512 << 20, "max_processes": MAX_PROCESSES}

# {marker} is the process name the program takes once it holds its peak; it then waits for SIGUSR1.
ATTACK = r"""
import ctypes, json, os, resource, signal
libc = ctypes.CDLL(None, use_errno=True)
NEWUSER = 0x10000000
CLONE = {"x86_64": 56, "aarch64": 220}[os.uname().machine]
notes = {}
if libc.unshare(NEWUSER) == 0:
    notes["userns"] = "unshare"
else:
    pid = libc.syscall(CLONE, NEWUSER | signal.SIGCHLD, 0, 0, 0, 0)
    if pid == 0:
        notes["userns"] = "clone"  # the child, in the new namespace, carries on
    elif pid > 0:
        os.waitpid(pid, 0)
        os._exit(0)
    else:
        notes["userns"] = "refused: " + os.strerror(ctypes.get_errno())
for want in ((resource.RLIM_INFINITY,) * 2, (resource.getrlimit(resource.RLIMIT_NPROC)[1],) * 2):
    try:
        resource.setrlimit(resource.RLIMIT_NPROC, want)
        break
    except (OSError, ValueError):
        continue
notes["nproc"] = resource.getrlimit(resource.RLIMIT_NPROC)
r, w = os.pipe()
tree = 1
while True:
    try:
        pid = os.fork()
    except OSError as exc:
        notes["refused"] = exc.strerror
        break
    if pid == 0:
        os.close(w)
        os.read(r, 1)
        os._exit(0)
    tree += 1
notes["tree"] = tree
signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGUSR1})
libc.prctl(15, b"{marker}")  # PR_SET_NAME
signal.sigwait({signal.SIGUSR1})
print(json.dumps(notes), flush=True)
os.close(w)
while True:
    try:
        os.wait()
    except ChildProcessError:
        break
"""

# Runs in the caller before the call: records the call cgroup's pids.peak as the cgroup goes.
PEAK_SETUP = """
from trajmesh.sandbox import cgroups
peaks = []
_remove = cgroups.CallCgroup.remove
def _remove_recording_peak(self):
    try:
        peaks.append(int(open(self.paths["pids"] + "/pids.peak").read()))
    except FileNotFoundError:
        peaks.append(None)
    _remove(self)
cgroups.CallCgroup.remove = _remove_recording_peak
"""
PEAK_CHECK = "verdict = peaks"
NO_CGROUP_SETUP = f"import os\nos.environ[{cgroups.ENV!r}] = 'none'\n"
"""Runs in the caller before its first call: no cgroup for its calls (this process keeps its mode)."""


def _skip_unless(mode: str) -> None:
    if mode == "rootless" and os.geteuid() == 0 and (shutil.which("setpriv") is None or _rootless_python() is None):
        pytest.skip("no setpriv or no interpreter uid 65534 can start")
    if mode == "root" and os.geteuid() != 0:
        pytest.skip("not root here")


def _status(pid: int) -> dict[str, str]:
    out = {}
    for line in open(f"/proc/{pid}/status").read().splitlines():
        key, _, value = line.partition(":")
        out[key] = value.strip()
    return out


def _find(marker: str, call: Future[dict[str, Any]]) -> int:
    """The host pid of the process named `marker` (the program holding its peak), while the call runs."""
    while not call.done():
        for name in filter(str.isdigit, os.listdir("/proc")):
            try:
                if open(f"/proc/{name}/comm").read().strip() == marker:
                    return int(name)
            except OSError:
                continue
        time.sleep(0.01)
    raise AssertionError(f"the call ended before its program held its peak: {call.result()}")


def _tasks_of_call(program: int) -> int:
    """Tasks (threads included) of the namespaces' creator and of all its descendants, in any
    namespace: the creator is the program's nearest ancestor in this test's pid namespace."""
    depth = len(_status(os.getpid())["NSpid"].split())
    creator = program
    while len(_status(creator)["NSpid"].split()) > depth:
        creator = int(_status(creator)["PPid"])
    children: dict[int, list[int]] = {}
    for name in filter(str.isdigit, os.listdir("/proc")):
        try:
            children.setdefault(int(_status(int(name))["PPid"]), []).append(int(name))
        except OSError:
            continue
    total, todo = 0, [creator]
    while todo:
        pid = todo.pop()
        total += len(os.listdir(f"/proc/{pid}/task"))
        todo += children.get(pid, [])
    return total


@pytest.mark.parametrize("mode", ["root", "rootless"])
def test_the_call_cgroup_holds_every_task_of_the_call(mode: str) -> None:
    _skip_unless(mode)
    if MODE.kind == "none":
        mounted = _mounted_hierarchies()
        if mounted and CI:
            pytest.fail(f"CI=true: cgroup {'/'.join(mounted)} is mounted but the sandbox cannot use it: {MODE.problem}")
        pytest.skip(f"no per-call cgroup here: {MODE.problem}")
    code = ATTACK.replace("{marker}", f"nproc-{secrets.token_hex(4)}")
    res = _attack_with(mode, code, LIMITS, setup=PEAK_SETUP, check=PEAK_CHECK)
    assert res["cgroup"] == MODE.kind
    assert len(res["check"]) == 1, res["check"]
    if res["check"][0] is None:
        pytest.skip("this kernel's pids controller has no pids.peak")
    assert (res["status"], res["subclass"]) == (sandbox.SANDBOX_ERROR, "pids_limit"), res
    assert res["check"][0] <= MAX_PROCESSES, f"{res['check'][0]} tasks at the call's peak with max_processes {MAX_PROCESSES}"


@pytest.mark.parametrize("mode", ["root", "rootless"])
def test_without_a_cgroup_rlimit_nproc_holds_every_task_of_the_call(mode: str) -> None:
    _skip_unless(mode)
    marker = f"nproc-{secrets.token_hex(4)}"
    with ThreadPoolExecutor(1) as pool:
        call = pool.submit(_attack_with, mode, ATTACK.replace("{marker}", marker), LIMITS, setup=NO_CGROUP_SETUP)
        program = _find(marker, call)
        try:
            peak = _tasks_of_call(program)
        finally:
            os.kill(program, signal.SIGUSR1)  # the program prints what it did and ends
        res: dict[str, Any] = call.result()
    assert res["cgroup"] == "none"
    assert res["status"] == sandbox.OK and "refused" in res["stdout"], res  # it forked until refused
    assert peak <= MAX_PROCESSES, f"{peak} tasks at the call's peak with max_processes {MAX_PROCESSES}"


def test_a_limit_leaving_the_program_no_task_is_refused() -> None:
    with pytest.raises(ValueError, match="max_processes=2"):
        sandbox.SandboxLimits(max_processes=2)
    assert sandbox.SandboxLimits(max_processes=3).max_processes == 3
