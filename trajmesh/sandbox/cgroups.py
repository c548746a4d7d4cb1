"""One cgroup per sandboxed call, on cgroup v2 or v1 hosts, behind one interface (no torch).

::

    mode()  (once per process: detect, then sweep what dead services left)
      v2:   <own cgroup>/sandbox/trajmesh-call-…      one cgroup, memory pids cpu enabled
      v1:   <own cgroup in memory/ pids/ cpu/ cpuacct/>/trajmesh-call-…   one per hierarchy
      none: why not, and what would fix it
    CallCgroup.create(mode, …) ─▶ limits written ─▶ the call's first process joins (procs_files)
      ─▶ cpu_s() / events() while it runs ─▶ kill() ─▶ remove()

A call's cgroup holds every process of the call, so its limits are the call's, not each process's:
memory (anonymous, tmpfs, /dev/shm, memfd, SysV shm and kernel memory alike; v1
`memory.limit_in_bytes` and `memory.memsw.limit_in_bytes` where swap is accounted, v2
`memory.max` and `memory.swap.max`), tasks (`pids.max`), CPU cores at once (v1
`cpu.cfs_quota_us`/`cpu.cfs_period_us`, v2 `cpu.max`) and the CPU seconds of all its processes
(v1 `cpuacct.usage`, v2 `cpu.stat`), read by the caller to enforce a budget. v1 has no
`cgroup.kill` or `memory.oom.group`: `kill` signals every listed pid until none is left.

The parent is the calling process's own cgroup (v1: in each hierarchy; v2: a `sandbox` child, after
moving the process's cgroup members into a `service` leaf where the kernel requires it). It must
be writable: root, or a cgroup delegated to the service's uid (`delegate`: the directory and its
`cgroup.procs` chowned, as systemd's `Delegate=yes` does). A call cgroup is named after its service's pid and that process's
start time, so the first `mode()` of a later service removes those whose service is gone
(killed -9 mid-call) and leaves those of a live one alone.

`TRAJMESH_SANDBOX_CGROUP` = `auto` (default: v2, else v1, else none), `v2`, `v1` or `none` (no
cgroup: per-process rlimits only) chooses the mode.
"""

from __future__ import annotations

import errno
import functools
import os
import random
import signal
import time
from collections.abc import Iterable
from dataclasses import dataclass, field

ENV = "TRAJMESH_SANDBOX_CGROUP"
"""Environment variable choosing the mode: auto (default), v2, v1 or none."""
CALL_PREFIX = "trajmesh-call-"
"""Name prefix of every call's cgroup: trajmesh-call-<service pid>-<its start time>-<random>."""
V1_CONTROLLERS = ("memory", "pids", "cpu", "cpuacct")
"""cgroup v1 hierarchies a call needs (memory and pids limits, CPU quota, CPU usage)."""
V2_CONTROLLERS = ("memory", "pids", "cpu")
"""cgroup v2 controllers a call needs, enabled in the parent's cgroup.subtree_control."""
CPU_PERIOD_US = 100_000
"""The CPU quota's period (cfs_period_us; the second number of cpu.max)."""


@dataclass(frozen=True)
class CgroupMode:
    """Which cgroup mode holds for this process: "v2", "v1" or "none"."""

    kind: str
    parents: dict[str, str] = field(default_factory=dict)
    """controller → the directory under which each call gets its cgroup (v2: one for all)."""
    problem: str = ""
    """Why there is no per-call cgroup ("" unless kind is "none"), with the fix."""

    @property
    def dirs(self) -> list[str]:
        """The distinct parent directories (v1: co-mounted controllers share one)."""
        return sorted(set(self.parents.values()))

    def describe(self) -> str:
        if self.kind == "v2":
            return f"one cgroup v2 per call under {self.dirs[0]}"
        if self.kind == "v1":
            return "one cgroup v1 per call in each of " + ", ".join(self.dirs)
        return f"no per-call cgroup ({self.problem})"


@dataclass(frozen=True)
class _Mount:
    fstype: str
    root: str
    point: str
    options: frozenset[str]


def _mounts() -> list[_Mount]:
    out = []
    for line in open("/proc/self/mountinfo").read().splitlines():
        left, _, right = line.partition(" - ")
        fields, tail = left.split(), right.split()
        if len(fields) >= 5 and len(tail) >= 3 and tail[0] in ("cgroup", "cgroup2"):
            out.append(_Mount(tail[0], _unescape(fields[3]), _unescape(fields[4]), frozenset(tail[2].split(","))))
    return out


def _unescape(path: str) -> str:
    return path.replace("\\040", " ").replace("\\011", "\t").replace("\\012", "\n").replace("\\134", "\\")


def _own_paths() -> dict[str, str]:
    """controller (v1) or "" (v2) → this process's cgroup path, from /proc/self/cgroup."""
    out = {}
    for line in open("/proc/self/cgroup").read().splitlines():
        _, controllers, path = line.split(":", 2)
        for c in controllers.split(",") if controllers else [""]:
            out[c] = path
    return out


def _in_mount(m: _Mount, path: str) -> str | None:
    """Where cgroup `path` of this process lies under mount `m` (None when outside the mount)."""
    root = m.root.rstrip("/")
    if path != root and not path.startswith(root + "/"):
        return None
    return (m.point.rstrip("/") + path[len(root):]).rstrip("/") or "/"


def _writable(d: str) -> bool:
    return os.access(d, os.W_OK) and os.access(d + "/cgroup.procs", os.W_OK)


def _detect_v2(mounts: list[_Mount], own: dict[str, str]) -> tuple[CgroupMode | None, str]:
    m2 = [m for m in mounts if m.fstype == "cgroup2"]
    if not m2:
        return None, "no cgroup2 mount"
    base = _in_mount(m2[0], own.get("", "/"))
    if base is None:
        return None, f"this process's cgroup v2 is outside the mount {m2[0].point}"
    have = open(base + "/cgroup.controllers").read().split()
    missing = sorted(set(V2_CONTROLLERS) - set(have))
    if missing:
        return None, f"cgroup v2 controllers {missing} not available in {base} (bound to v1 hierarchies, or not delegated)"
    if not _writable(base) or not os.access(base + "/cgroup.subtree_control", os.W_OK):
        return None, f"{base} is not writable by uid {os.geteuid()} (not delegated)"
    parent = _delegate_v2(base)
    return CgroupMode("v2", {c: parent for c in V2_CONTROLLERS}), ""


def _delegate_v2(base: str) -> str:
    """Enables the controllers for a `sandbox` child and returns it. v2 lets only leaves hold
    processes (the host's root excepted): where the kernel refuses (EBUSY), this cgroup's members
    move into a `service` leaf first (a container's namespace root too; the host's root never)."""
    enable = " ".join("+" + c for c in V2_CONTROLLERS)
    try:
        _write(base + "/cgroup.subtree_control", enable)
    except OSError as exc:
        if exc.errno != errno.EBUSY:
            raise
        os.makedirs(base + "/service", exist_ok=True)
        for pid in open(base + "/cgroup.procs").read().split():
            try:
                _write(base + "/service/cgroup.procs", pid)
            except ProcessLookupError:
                continue
        _write(base + "/cgroup.subtree_control", enable)
    os.makedirs(base + "/sandbox", exist_ok=True)
    _write(base + "/sandbox/cgroup.subtree_control", enable)
    return base + "/sandbox"


def _detect_v1(mounts: list[_Mount], own: dict[str, str]) -> tuple[CgroupMode | None, str]:
    parents = {}
    for c in V1_CONTROLLERS:
        m = next((m for m in mounts if m.fstype == "cgroup" and c in m.options), None)
        if m is None:
            return None, f"no cgroup v1 mount of the {c} controller"
        d = _in_mount(m, own.get(c, "/"))
        if d is None:
            return None, f"this process's {c} cgroup is outside the mount {m.point}"
        if not _writable(d):
            return None, f"{d} is not writable by uid {os.geteuid()} (run the service as root or in a cgroup delegated to it)"
        parents[c] = d
    return CgroupMode("v1", parents), ""


def detect() -> CgroupMode:
    """The mode that holds for this process (see `ENV`); never raises."""
    want = os.environ.get(ENV, "auto").strip().lower() or "auto"
    if want == "none":
        return CgroupMode("none", problem=f"disabled by {ENV}=none")
    if want not in ("auto", "v1", "v2"):
        return CgroupMode("none", problem=f"{ENV}={want!r} is not one of auto, v2, v1, none")
    reasons = []
    for kind, probe in (("v2", _detect_v2), ("v1", _detect_v1)):
        if want not in ("auto", kind):
            continue
        try:
            found, why = probe(_mounts(), _own_paths())
        except (OSError, ValueError) as exc:
            found, why = None, f"setup failed: {exc}"
        if found is not None:
            return found
        reasons.append(f"{kind}: {why}")
    return CgroupMode("none", problem="; ".join(reasons))


@functools.lru_cache(maxsize=1)
def mode() -> CgroupMode:
    """`detect()` once per process; the first call also sweeps cgroups left by dead services."""
    found = detect()
    if found.kind != "none":
        sweep(found)
    return found


def _start_time(pid: int) -> str | None:
    try:
        return open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return None


def _owner_alive(name: str) -> bool:
    """Whether the service that created call cgroup `name` still runs (same pid, same start time)."""
    parts = name[len(CALL_PREFIX):].split("-")
    if len(parts) != 3 or not parts[0].isdigit():
        return False
    return _start_time(int(parts[0])) == parts[1]


def leftovers(found: CgroupMode) -> list[str]:
    """Every call cgroup under the mode's parents (a live call's or a stale one)."""
    out = []
    for d in found.dirs:
        try:
            out += [f"{d}/{n}" for n in sorted(os.listdir(d)) if n.startswith(CALL_PREFIX)]
        except OSError:
            continue
    return out


def sweep(found: CgroupMode) -> list[str]:
    """Kills the processes of, and removes, every call cgroup whose service is gone; returns them."""
    stale = [p for p in leftovers(found) if not _owner_alive(os.path.basename(p))]
    for path in stale:
        try:
            _remove_dirs([path], kill=True)
        except OSError:
            continue
    return stale


class CallCgroup:
    """One call's cgroup (one directory per v1 hierarchy, one for v2)."""

    def __init__(self, found: CgroupMode, name: str) -> None:
        self.mode = found
        self.name = name
        self.paths = {c: f"{d}/{name}" for c, d in found.parents.items()}
        """controller → this call's directory for it."""

    @classmethod
    def create(cls, found: CgroupMode, memory_bytes: int, pids_max: int, cpus: float) -> CallCgroup:
        """Creates the cgroup with its limits; on failure removes what was made and raises OSError."""
        me = os.getpid()
        group = cls(found, f"{CALL_PREFIX}{me}-{_start_time(me)}-{random.getrandbits(48):012x}")
        made: list[str] = []
        try:
            for d in group.dirs:
                os.mkdir(d)
                made.append(d)
            group._limit(memory_bytes, pids_max, cpus)
        except OSError:
            _remove_dirs(made, kill=False)
            raise
        return group

    @property
    def dirs(self) -> list[str]:
        return sorted(set(self.paths.values()))

    def _limit(self, memory_bytes: int, pids_max: int, cpus: float) -> None:
        quota = max(1000, int(cpus * CPU_PERIOD_US))
        mem, cpu = self.paths["memory"], self.paths["cpu"]
        if self.mode.kind == "v2":
            _write(mem + "/memory.max", str(memory_bytes))
            _write(mem + "/memory.swap.max", "0")
            _write(mem + "/memory.oom.group", "1")
            _write(cpu + "/cpu.max", f"{quota} {CPU_PERIOD_US}")
        else:
            _write(mem + "/memory.limit_in_bytes", str(memory_bytes))
            if os.path.exists(mem + "/memory.memsw.limit_in_bytes"):  # swap accounting: no swap either
                _write(mem + "/memory.memsw.limit_in_bytes", str(memory_bytes))
            _write(cpu + "/cpu.cfs_period_us", str(CPU_PERIOD_US))
            _write(cpu + "/cpu.cfs_quota_us", str(quota))
        _write(self.paths["pids"] + "/pids.max", str(pids_max))

    def procs_files(self) -> list[str]:
        """The files the call's first process (the init's child) writes "0" to, joining every hierarchy."""
        return [d + "/cgroup.procs" for d in self.dirs]

    def cpu_s(self) -> float:
        """CPU seconds of every process of the call so far, exited ones included."""
        if self.mode.kind == "v2":
            for line in open(self.paths["cpu"] + "/cpu.stat").read().splitlines():
                if line.startswith("usage_usec "):
                    return int(line.split()[1]) / 1e6
            return 0.0
        return int(open(self.paths["cpuacct"] + "/cpuacct.usage").read()) / 1e9

    def events(self) -> dict[str, int]:
        """{"oom_kill": processes the memory limit killed, "pids_max": forks pids.max refused}."""
        mem = self.paths["memory"]
        name = "/memory.events" if self.mode.kind == "v2" else "/memory.oom_control"
        memory = _keyed(open(mem + name).read())
        pids = _keyed(open(self.paths["pids"] + "/pids.events").read())
        return {"oom_kill": memory.get("oom_kill", 0) + memory.get("oom_group_kill", 0), "pids_max": pids.get("max", 0)}

    def kill(self) -> None:
        """SIGKILL to every process of the call (v2: cgroup.kill; v1: each listed pid)."""
        _kill_dirs(self.dirs, self.mode.kind == "v2")

    def remove(self) -> None:
        """Kills what is left and removes every directory of the call (raises OSError if it cannot)."""
        _remove_dirs(self.dirs, kill=True)


def _keyed(text: str) -> dict[str, int]:
    out = {}
    for line in text.splitlines():
        parts = line.split()
        if len(parts) == 2 and parts[1].lstrip("-").isdigit():
            out[parts[0]] = int(parts[1])
    return out


def _write(path: str, value: str) -> None:
    with open(path, "w") as fh:
        fh.write(value)


def _pids(d: str) -> list[int]:
    try:
        return [int(p) for p in open(d + "/cgroup.procs").read().split()]
    except OSError:
        return []


def _kill_dirs(dirs: Iterable[str], v2: bool) -> None:
    for d in dirs:
        if v2 and os.path.exists(d + "/cgroup.kill"):
            try:
                _write(d + "/cgroup.kill", "1")
                continue
            except OSError:
                pass
        for pid in _pids(d):
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                continue


def _remove_dirs(dirs: list[str], kill: bool, timeout_s: float = 10.0) -> None:
    """rmdir each directory, killing its processes first (when asked) until the kernel lets it go:
    a killed process leaves its cgroup only once it has exited and been reaped."""
    deadline = time.monotonic() + timeout_s
    for d in dirs:
        while True:
            if kill:
                _kill_dirs([d], v2=os.path.exists(d + "/cgroup.kill"))
            try:
                os.rmdir(d)
                break
            except FileNotFoundError:
                break
            except OSError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.01)


def delegate(uid: int, gid: int, name: str) -> CgroupMode:
    """As root: a new child of this process's cgroup in every hierarchy a call needs, owned by
    uid/gid (directory, cgroup.procs, tasks, v2's cgroup.subtree_control), for a service of that
    uid to run its calls in (`join` moves a process there; on v2 the service then enables the
    controllers itself). Raises OSError where root cannot."""
    found = detect()
    if found.kind == "none":
        raise OSError(f"no cgroup to delegate from: {found.problem}")
    out = {}
    for d in found.dirs:
        # v2: d is this process's `sandbox` cgroup (controllers enabled); the child is made under it
        child = f"{d}/{name}"
        os.makedirs(child, exist_ok=True)
        for f in ("", "/cgroup.procs", "/tasks", "/cgroup.subtree_control", "/cgroup.threads"):
            if os.path.exists(child + f):
                os.chown(child + f, uid, gid)
        out.update({c: child for c, p in found.parents.items() if p == d})
    return CgroupMode(found.kind, out)


def join(found: CgroupMode) -> None:
    """Moves the calling process into the mode's parent directories (after `delegate`)."""
    for d in found.dirs:
        _write(d + "/cgroup.procs", "0")


def undelegate(found: CgroupMode) -> None:
    """Removes what `delegate` made, call cgroups left in it and any process still there included."""
    _remove_dirs(leftovers(found) + found.dirs, kill=True)
