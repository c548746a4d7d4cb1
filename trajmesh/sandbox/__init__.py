"""Run untrusted, model-written Python in its own root, namespaces and limits, rootless (no torch).

The package::

    __init__.py       this module: run_code, the call's limits, the uid lease, the results
    init_program.py   the init (a program, never imported: its text runs from a memfd)
    boot_program.py   the sandboxed interpreter's first code (a program, on its command line)
    cgroups.py        one cgroup per call, on cgroup v2 or v1 hosts

::

    run_code(code)
        │ creates the call's cgroup (v2 or v1, trajmesh/sandbox/cgroups.py) where this process may
        │ spawns the init: python -I -S; its script, config and the code come on a memfd
        │ (its child joins the call's cgroup first; the init dies with the service: PDEATHSIG)
        │     fork ─▶ unshare user+mnt+pid+ipc+uts+net+cgroup+time; the init writes the id map
        │       fork ─▶ pid 1: tmpfs root, read-only nosuid nodev binds of the interpreter prefixes
        │               and system libraries, capped tmpfs /tmp, fresh /proc, pivot_root
        │         fork ─▶ program: rlimits, uid 1000 in the namespace, no groups or capabilities,
        │                 anonymous session keyring, no_new_privs, seccomp ─▶ python /tmp/work/main.py
        │ one selector loop: stdin fed, stdout/stderr, audit and report pipes read (all capped)
        │ every 0.25 s with a cgroup: its OOM kills, refused forks, CPU seconds of all processes
        │ deadline or limit: SIGKILL to the cgroup, pid 1 (its namespace dies with it), the init
        │ the end: cgroup removed (what is left killed), uid lease freed
        ▼
    SandboxResult(status, subclass)

Containment is the kernel's (docs/SECURITY.md, "Sandbox"): a user namespace maps one uid (the
caller's own when rootless, a leased one when root), so no capability or host uid is held; the
mount namespace's root is a fresh tmpfs with only the interpreter and system libraries bound
read-only (no host data, socket directory or checkout is reachable), writable space is one tmpfs
capped in bytes and inodes; private network (down loopback), IPC, UTS, cgroup, time and PID
namespaces (nothing outlives the call), the namespace's own per-user kernel quotas capped
(`USER_NS_MAX`), `/proc/keys` hidden, the inits non-dumpable; `PR_SET_NO_NEW_PRIVS` and nosuid
mounts (setuid binaries gain nothing); a seccomp filter denying keyring, io_uring, ptrace, bpf,
mount-family and namespace-creation calls (`SECCOMP_DENY`); rlimits for CPU, address space,
processes, file size and open files; where cgroup v2 or v1 is writable (root, or a delegated
cgroup), one cgroup per call (memory with tmpfs/shm/memfd/SysV shm, pids, a CPU quota, the CPU
seconds of all processes, kill of all; `preflight` for services says which mode holds). The service
enforces the wall-clock deadline and the output cap. Classification is best effort: a Python
audit hook in the sandbox names which forbidden operation was attempted (network, fs_write,
secret_access, signal), the init reports orphans, and exit signals / messages give the resource
class. Needs only unprivileged user namespaces (root is not required).
"""

from __future__ import annotations

import contextlib
import contextvars
import fcntl
import functools
import json
import os
import platform
import random
import selectors
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from trajmesh.sandbox import cgroups

OK, ERROR, SANDBOX_ERROR = "ok", "error", "SANDBOX_ERROR"
"""`status` values: ran and exited 0; the program failed on its own (exception, exit code);
the sandbox stopped a violation or a limit (see `SUBCLASSES`)."""

SUBCLASSES = (
    "wall_timeout", "cpu_time", "memory", "process_limit", "output_limit", "file_size",
    "network", "fs_write", "secret_access", "signal", "orphan_process", "setup",
    "memory_limit", "pids_limit", "cpu_limit",
)
"""Every `subclass` of SANDBOX_ERROR (metrics export each with an initial 0). The last three are the
call's cgroup's (all its processes together): an OOM kill at `memory_bytes`, a fork refused at
pids.max, the CPU seconds of all its processes past `cpu_s`."""
VIOLATIONS = ("network", "fs_write", "secret_access", "signal")
"""The only names the audit pipe may carry; anything else the program writes there is dropped."""
AUDIT_CAP_BYTES, REPORT_CAP_BYTES = 4096, 4096
"""Most bytes read from the audit and report pipes (the program can write to the audit pipe)."""

UID_BASE, UID_COUNT = 200_000, 1024
"""As root, each call's namespace uid maps to host uid UID_BASE + k, leased to one call at a time."""
LEASE_DIR = "/run/trajmesh-sandbox"
SANDBOX_UID = 1000
"""The program's uid and gid inside its user namespace (the only ones mapped)."""
SYSTEM_BINDS = ("/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32", "/etc/ld.so.cache",
                "/etc/localtime", "/etc/alternatives")
"""Host paths bound read-only into the sandbox's root (those that exist), besides the interpreter's
prefixes. Symlinks (merged /usr) are recreated as symlinks."""
DEVICES = ("null", "zero", "full", "random", "urandom")
"""Device files bound into the sandbox's /dev."""
USER_NS_MAX = {"max_inotify_instances": 16, "max_inotify_watches": 1024, "max_fanotify_groups": 0,
               "max_fanotify_marks": 0, "max_user_namespaces": 0, "max_mnt_namespaces": 0,
               "max_pid_namespaces": 0, "max_net_namespaces": 0, "max_ipc_namespaces": 0,
               "max_uts_namespaces": 0, "max_cgroup_namespaces": 0, "max_time_namespaces": 0}
"""/proc/sys/user limits of the call's user namespace, written by its init: the kernel charges these
objects to every user namespace up to the host's, i.e. to the uid that runs the service."""
HIDDEN_PROC = ("keys", "key-users")
"""/proc files covered with /dev/null inside (rootless, they list the caller's keyrings)."""

SECCOMP_DENY = (
    "keyctl", "add_key", "request_key",                             # keyrings
    "io_uring_setup", "io_uring_enter", "io_uring_register",        # io_uring
    "ptrace", "process_vm_readv", "process_vm_writev",              # reading/writing other processes
    "bpf", "perf_event_open", "userfaultfd",                        # kernel attack surface
    "mount", "umount2", "pivot_root", "chroot", "move_mount", "open_tree", "fsopen", "fsconfig",
    "fsmount", "fspick", "mount_setattr",                           # mount family
    "unshare", "setns",                                             # namespace creation / entry
    "open_by_handle_at", "name_to_handle_at",                       # file handles (bypass paths)
    "kexec_load", "kexec_file_load", "init_module", "finit_module", "delete_module",
    "acct", "swapon", "swapoff", "reboot", "syslog", "quotactl", "sethostname", "setdomainname",
    "fanotify_init", "lookup_dcookie",
)
"""Syscalls the sandboxed program gets EPERM for. Also: `clone` with any CLONE_NEW* flag is EPERM,
`clone3` is ENOSYS (its flags are out of the filter's reach; libc falls back to clone), and a
foreign syscall ABI (x32, i386 on x86_64) kills the process."""
SYSCALL_NUMBERS = {
    "x86_64": dict(keyctl=250, add_key=248, request_key=249, io_uring_setup=425, io_uring_enter=426,
                   io_uring_register=427, ptrace=101, process_vm_readv=310, process_vm_writev=311, bpf=321,
                   perf_event_open=298, userfaultfd=323, mount=165, umount2=166, pivot_root=155, chroot=161,
                   move_mount=429, open_tree=428, fsopen=430, fsconfig=431, fsmount=432, fspick=433,
                   mount_setattr=442, unshare=272, setns=308, open_by_handle_at=304, name_to_handle_at=303,
                   kexec_load=246, kexec_file_load=320, init_module=175, finit_module=313, delete_module=176,
                   acct=163, swapon=167, swapoff=168, reboot=169, syslog=103, quotactl=179, sethostname=170,
                   setdomainname=171, fanotify_init=300, lookup_dcookie=212, clone=56, clone3=435),
    "aarch64": dict(keyctl=219, add_key=217, request_key=218, io_uring_setup=425, io_uring_enter=426,
                    io_uring_register=427, ptrace=117, process_vm_readv=270, process_vm_writev=271, bpf=280,
                    perf_event_open=241, userfaultfd=282, mount=40, umount2=39, pivot_root=41, chroot=51,
                    move_mount=429, open_tree=428, fsopen=430, fsconfig=431, fsmount=432, fspick=433,
                    mount_setattr=442, unshare=97, setns=268, open_by_handle_at=265, name_to_handle_at=264,
                    kexec_load=104, kexec_file_load=294, init_module=105, finit_module=273, delete_module=106,
                    acct=89, swapon=224, swapoff=225, reboot=142, syslog=116, quotactl=60, sethostname=161,
                    setdomainname=162, fanotify_init=262, lookup_dcookie=18, clone=220, clone3=435),
}
"""Syscall numbers per machine (from the kernel's unistd tables); other machines are refused."""
AUDIT_ARCH = {"x86_64": 0xC000003E, "aarch64": 0xC00000B7}
"""seccomp_data.arch of each machine's native ABI."""
CLONE_NEW_ALL = 0x10000000 | 0x20000 | 0x20000000 | 0x08000000 | 0x04000000 | 0x40000000 | 0x02000000 | 0x80
"""CLONE_NEWUSER|NEWNS|NEWPID|NEWIPC|NEWUTS|NEWNET|NEWCGROUP|NEWTIME: the namespaces each call gets
(and the clone flags its program may not use)."""


SANDBOX_TASKS = 2
"""Tasks of the sandbox's own in every call's process count (`SandboxLimits.max_processes`): the
init's child that creates the namespaces (and joins the call's cgroup first) and the namespaces'
pid 1. The init itself (the service's child, outside the namespaces and the cgroup) is not."""


@dataclass(frozen=True)
class SandboxLimits:
    wall_s: float = 10.0
    """Wall-clock deadline of the whole call, seconds (sleeping past it is `wall_timeout`)."""
    cpu_s: int = 5
    """CPU seconds of the call: with a cgroup, of all its processes together (`cpu_limit`); else of
    each process (RLIMIT_CPU, `cpu_time`). Keep below wall_s so spinning is not `wall_timeout`."""
    memory_bytes: int = 1 << 30
    """Memory of the call with a cgroup (all its processes, tmpfs, shm and memfd pages included:
    `memory_limit`); also the address space of each process (RLIMIT_AS, `memory`)."""
    max_processes: int = 32
    """Tasks (processes and threads) of the whole call at once, the sandbox's own `SANDBOX_TASKS`
    included: the program and all its descendants get max_processes - 2. With a cgroup, pids.max of
    the call (`pids_limit`); else RLIMIT_NPROC (soft = hard) of the program, which the kernel checks
    against the sandbox uid's count in the call's user namespace, where those two count too
    (`process_limit`). At least SANDBOX_TASKS + 1."""
    cpus: float = 1.0
    """CPU cores the call's processes may use at once (cgroup CPU quota; no effect without one)."""
    file_size_bytes: int = 8 << 20
    """Largest file the program may write (RLIMIT_FSIZE)."""
    tmpfs_bytes: int = 64 << 20
    """Size of the writable /tmp (also /dev/shm: the same tmpfs), the only writable place."""
    tmpfs_inodes: int = 4096
    """Files and directories the writable /tmp may hold (a file-count fill stops here)."""
    output_bytes: int = 64 << 10
    """stdout + stderr cap; more is `output_limit` and the program is killed."""
    open_files: int = 64
    """Open file descriptors per process (RLIMIT_NOFILE)."""

    def __post_init__(self) -> None:
        if self.max_processes <= SANDBOX_TASKS:
            raise ValueError(f"max_processes={self.max_processes}: the call's count includes the sandbox's own "
                             f"{SANDBOX_TASKS} tasks, so the program needs max_processes >= {SANDBOX_TASKS + 1}")


@dataclass
class SandboxResult:
    status: str
    subclass: str = ""
    exit_code: int | None = None
    signal: int | None = None
    stdout: str = ""
    stderr: str = ""
    wall_s: float = 0.0
    violations: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return self.status == OK


def available() -> bool:
    """True where the sandbox can run here (see `unavailable_reason`)."""
    return not unavailable_reason()


@functools.lru_cache(maxsize=1)
def unavailable_reason() -> str:
    """Why the sandbox cannot run on this machine ("" when it can): an unknown machine type (no
    seccomp table), or a kernel refusing user namespaces to this uid (probed once per process)."""
    if platform.machine() not in SYSCALL_NUMBERS:
        return f"no seccomp syscall table for machine {platform.machine()!r}"
    probe = ("import ctypes, os\nlibc = ctypes.CDLL(None, use_errno=True)\n"
             f"if libc.unshare({CLONE_NEW_ALL}) != 0:\n"
             "    raise SystemExit(os.strerror(ctypes.get_errno()))\n")
    try:
        out = subprocess.run([sys.executable, "-I", "-S", "-c", probe], capture_output=True, text=True,
                             timeout=60, env={"PATH": "/usr/bin:/bin"})
    except (OSError, subprocess.SubprocessError) as exc:
        return f"cannot start the interpreter: {exc}"
    if out.returncode != 0:
        return f"user namespaces refused to uid {os.geteuid()}: {out.stderr.strip()[-200:]}"
    return ""


def uses_uid_pool() -> bool:
    """True where each call leases its own host uid (root); rootless calls all map the caller's uid."""
    return os.geteuid() == 0


class SandboxUnavailable(RuntimeError):
    """The sandbox cannot give the isolation the configuration asks for (raised at service start-up)."""


_CGROUP_FIX = {
    "v2": "give the service a cgroup v2 subtree with memory pids cpu delegated (systemd Delegate=yes; "
          "in a pod, a writable cgroupfs)",
    "v1": "on a cgroup v1 host run the service as root (in a pod: privileged, or a writable "
          "/sys/fs/cgroup/{memory,pids,cpu,cpuacct}) or in a cgroup delegated to its uid",
}


def preflight(allow_without_cgroup: bool) -> str:
    """Start-up check for a service that runs sandboxed code (`sandbox.allow_without_cgroup` in the
    run config). Returns a line to log naming the cgroup mode (v2, v1 or none); raises
    SandboxUnavailable when the sandbox cannot run, or when no per-call cgroup can be made here and
    weaker limits were not allowed explicitly."""
    problem = unavailable_reason()
    if problem:
        raise SandboxUnavailable(f"sandbox unavailable: {problem}")
    found = cgroups.mode()
    if found.kind != "none":
        return f"sandbox: cgroup {found.kind}: {found.describe()}"
    if not allow_without_cgroup:
        raise SandboxUnavailable(
            f"sandbox: cgroup none: {found.problem}. Per-process rlimits alone let CPU and memory multiply by "
            f"the process count and miss tmpfs/shm/memfd pages. To fix: {_CGROUP_FIX['v2']}; or "
            f"{_CGROUP_FIX['v1']}; or set sandbox.allow_without_cgroup: true to run with these weaker limits.")
    return f"sandbox: cgroup none: WEAKER LIMITS (allowed by sandbox.allow_without_cgroup): {found.problem}"


def cgroup_mode() -> cgroups.CgroupMode:
    """The per-call cgroup mode of this process (detected once; trajmesh/sandbox/cgroups.py)."""
    return cgroups.mode()


def cgroup_problem() -> str:
    """Why calls cannot each get their own cgroup here ("" when they can, on v2 or v1)."""
    return cgroups.mode().problem


NPROC_MARGIN = 8
"""With a cgroup, RLIMIT_NPROC (the backstop) is pids.max + this. The kernel checks RLIMIT_NPROC
before the cgroup at a fork; at + 1 a fork bomb was once classed `process_limit` instead of
`pids_limit` (a clean-clone CI run), which RLIMIT_NPROC refusing first explains."""


def _call_cgroup(limits: SandboxLimits) -> cgroups.CallCgroup | None:
    found = cgroups.mode()
    if found.kind == "none":
        return None
    # pids.max counts every task of the call: the init's child joins first, pid 1 is its child.
    return cgroups.CallCgroup.create(found, limits.memory_bytes, limits.max_processes, limits.cpus)


PROGRAMS = ("init_program", "boot_program")
"""Modules of this package that are programs: their text runs in a call; importing one raises."""
PROGRAM_MARK = "# ---- the program: what runs is every line below this one ----\n"
"""The line in init_program.py and boot_program.py above which is only for linters and readers."""


def _program(name: str) -> str:
    """The text of trajmesh/sandbox/<name>.py below its `PROGRAM_MARK`: the program that runs."""
    return (Path(__file__).parent / f"{name}.py").read_text().split(PROGRAM_MARK, 1)[1]


# The init: started by the service with only a tiny bootstrap on its command line (so the program's
# /proc/1/cmdline shows no host path or config); the payload (this script, cfg, code) is on a memfd.
_BOOTSTRAP = ("import json, os, sys\nfd = int(sys.argv[1]); b = b''\nwhile True:\n    c = os.read(fd, 1 << 16)\n"
              "    if not c:\n        break\n    b += c\nos.close(fd)\nP = json.loads(b)\nexec(P['init'])\n")

_INIT = _program("init_program")

# Runs in the sandboxed interpreter before the program: reports attempted violations (the kernel
# blocks them regardless; this only names them).
_BOOT = _program("boot_program")


class _UidLease:
    """An exclusive lease on one sandbox uid (flock), so concurrent calls never share a uid."""

    def __init__(self, fd: int, uid: int) -> None:
        self.fd = fd
        self.uid = uid

    @classmethod
    def acquire(cls) -> _UidLease | None:
        """A free uid's lease, or None when every uid of the pool is leased."""
        os.makedirs(LEASE_DIR, mode=0o700, exist_ok=True)
        for k in random.sample(range(UID_COUNT), UID_COUNT):
            fd = os.open(f"{LEASE_DIR}/{k}.lock", os.O_CREAT | os.O_RDWR, 0o600)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                os.close(fd)
                continue
            return cls(fd, UID_BASE + k)
        return None

    def release(self) -> None:
        fcntl.flock(self.fd, fcntl.LOCK_UN)
        os.close(self.fd)


def encode(text: str) -> bytes:
    """UTF-8 that round-trips every str, lone surrogates included (model output may hold them)."""
    return text.encode("utf-8", "surrogatepass")


def _interpreter() -> str:
    """This interpreter's path with its directories resolved (a venv reached through a symlinked
    directory) but its own name kept: a venv's `bin/python` link is how it finds its pyvenv.cfg."""
    return os.path.join(os.path.realpath(os.path.dirname(sys.executable)), os.path.basename(sys.executable))


def _python_prefixes() -> list[str]:
    """This interpreter's install prefixes (base and venv) and the directory of the binary it runs,
    real paths, outermost only, outside SYSTEM_BINDS."""
    found = sorted({os.path.realpath(p) for p in (sys.prefix, sys.base_prefix, sys.exec_prefix, sys.base_exec_prefix,
                                                  os.path.dirname(os.path.realpath(sys.executable)))})
    out: list[str] = []
    for p in found:
        covered = [d for d in (*SYSTEM_BINDS, *out) if p == d or p.startswith(d.rstrip("/") + "/")]
        if not covered and p != "/":
            out.append(p)
    return out


@functools.lru_cache(maxsize=1)
def _site_dirs() -> str:
    """This interpreter's site-packages (the program's interpreter starts without `site`)."""
    import site

    return os.pathsep.join(os.path.realpath(p) for p in site.getsitepackages() if os.path.isdir(p))


def _binds() -> list[tuple[str, str, str]]:
    """(host path, kind, symlink target) of everything the sandbox's root holds besides /tmp."""
    out = []
    for path in (*SYSTEM_BINDS, *_python_prefixes()):
        if os.path.islink(path) and path in SYSTEM_BINDS:
            out.append((path, "link", os.readlink(path)))
        elif os.path.isdir(path):
            out.append((path, "dir", ""))
        elif os.path.isfile(path):
            out.append((path, "file", ""))
    return out + [(f"/dev/{name}", "dev", "") for name in DEVICES if os.path.exists(f"/dev/{name}")]


def _classify(rep: dict, violations: list[str], stderr: str, killed_for: str, limits: SandboxLimits) -> str:
    """The SANDBOX_ERROR subclass, or "" when the program ran within bounds."""
    for kind in VIOLATIONS:
        if kind in violations:
            return kind
    if killed_for in ("memory_limit", "pids_limit", "cpu_limit"):
        return killed_for
    tail = stderr[-4000:]
    if "BlockingIOError" in tail or "Resource temporarily unavailable" in tail or "fork: retry" in tail:
        return "process_limit"
    if "MemoryError" in tail or "Cannot allocate memory" in tail:
        return "memory"
    if killed_for:
        return killed_for
    if rep.get("signal") == signal.SIGXCPU or (rep.get("signal") == signal.SIGKILL
                                                and rep.get("cpu_s", 0.0) >= limits.cpu_s - 0.05):
        return "cpu_time"
    if rep.get("signal") == signal.SIGXFSZ or "File too large" in tail:
        return "file_size"
    if rep.get("orphans", 0) > 0:
        return "orphan_process"
    return ""


_INJECTED_SETUP_FAILURE: contextvars.ContextVar[str] = contextvars.ContextVar("trajmesh_sandbox_injected", default="")
"""Why every `run_code` in this context fails its setup ("" : none); set by `injected_setup_failure`."""


@contextlib.contextmanager
def injected_setup_failure(why: str) -> Iterator[None]:
    """Fault injection (tests): every `run_code` in this context, threads started from it through
    `asyncio.to_thread` included, returns a `setup` failure saying `why` without running anything,
    as a sandbox that cannot be set up does (services/environment.py,
    `environment.inject_sandbox_failure`)."""
    token = _INJECTED_SETUP_FAILURE.set(why)
    try:
        yield
    finally:
        _INJECTED_SETUP_FAILURE.reset(token)


def run_code(code: str, *, stdin: str = "", limits: SandboxLimits | None = None) -> SandboxResult:
    """Run `code` as `python main.py` in a fresh sandbox. Never raises: whatever the code does and
    whatever fails on this side (no free uid, a missing tool, a kernel refusal) is a result."""
    limits = limits or SandboxLimits()
    start = time.monotonic()
    if _INJECTED_SETUP_FAILURE.get():
        return SandboxResult(SANDBOX_ERROR, "setup", stderr=f"sandbox setup failed: injected: {_INJECTED_SETUP_FAILURE.get()}")
    try:
        return _run(code, stdin, limits, start)
    except Exception as exc:  # noqa: BLE001 - the promise above: a SANDBOX_ERROR, never an exception
        return SandboxResult(SANDBOX_ERROR, "setup", stderr=f"sandbox setup failed: {type(exc).__name__}: {exc}",
                             wall_s=time.monotonic() - start)


def _run(code: str, stdin: str, limits: SandboxLimits, start: float) -> SandboxResult:
    problem = unavailable_reason()
    if problem:
        return SandboxResult(SANDBOX_ERROR, "setup", stderr=f"sandbox unavailable: {problem}")
    lease = _UidLease.acquire() if uses_uid_pool() else None
    if uses_uid_pool() and lease is None:
        return SandboxResult(SANDBOX_ERROR, "setup", stderr="no free sandbox uid (all leases taken)",
                             wall_s=time.monotonic() - start)
    root = tempfile.mkdtemp(prefix="trajmesh-sbx-")
    fds: list[int] = []
    group: cgroups.CallCgroup | None = None
    try:
        group = _call_cgroup(limits)
        report_r, report_w = os.pipe()
        audit_r, audit_w = os.pipe()
        payload = os.memfd_create("trajmesh-sandbox-init")
        fds += [report_r, report_w, audit_r, audit_w, payload]
        outer = (lease.uid, lease.uid) if lease else (os.geteuid(), os.getegid())
        os.write(payload, json.dumps({"init": _INIT, "code": code, "cfg": _init_config(
            limits, root, outer, report_w, audit_w, group)}).encode())
        os.lseek(payload, 0, os.SEEK_SET)
        proc = subprocess.Popen([sys.executable, "-I", "-S", "-c", _BOOTSTRAP, str(payload)],
                                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                pass_fds=(report_w, audit_w, payload), env={"PATH": "/usr/bin:/bin"},
                                start_new_session=True, close_fds=True)
        for fd in (report_w, audit_w, payload):
            os.close(fd)
            fds.remove(fd)
        return _collect(proc, report_r, audit_r, stdin, limits, start, group)
    finally:
        _clean_up(fds, root, group, lease)


def _clean_up(fds: list[int], root: str, group: cgroups.CallCgroup | None, lease: _UidLease | None) -> None:
    """Closes the call's descriptors, removes its mount point and cgroup, frees its uid; a failure
    here never replaces the call's result."""
    for fd in fds:
        os.close(fd)
    try:
        os.rmdir(root)  # empty on the host: the tmpfs was mounted in the sandbox's mount namespace
    except OSError:
        pass
    try:
        if group is not None:
            group.remove()
    except OSError:
        pass
    if lease is not None:
        _reap(lease.uid)
        lease.release()


def _init_config(limits: SandboxLimits, root: str, outer: tuple[int, int], report_w: int,
                 audit_w: int, group: cgroups.CallCgroup | None) -> dict[str, Any]:
    machine = platform.machine()
    return {
        "cgroup_procs": group.procs_files() if group else [], "service_pid": os.getpid(),
        "root": root, "root_mode": uses_uid_pool(), "outer_uid": outer[0], "outer_gid": outer[1],
        "inner_id": SANDBOX_UID, "report_fd": report_w, "audit_fd": audit_w, "binds": _binds(),
        "tmpfs_bytes": limits.tmpfs_bytes, "tmpfs_inodes": limits.tmpfs_inodes,
        "prefixes": _python_prefixes(), "python": _interpreter(), "boot": _BOOT, "site": _site_dirs(),
        "prefix": os.path.realpath(sys.prefix), "exec_prefix": os.path.realpath(sys.exec_prefix),
        "nr": SYSCALL_NUMBERS[machine], "deny": list(SECCOMP_DENY), "arch": AUDIT_ARCH[machine], "ns": CLONE_NEW_ALL,
        # With a cgroup its limits come first and the per-process rlimits are a backstop just above them.
        "limits": {"cpu_s": limits.cpu_s + (1 if group else 0), "memory_bytes": limits.memory_bytes,
                   "nproc": limits.max_processes + NPROC_MARGIN if group else limits.max_processes,
                   "file_size_bytes": limits.file_size_bytes, "open_files": limits.open_files},
        "user_max": USER_NS_MAX, "hidden_proc": list(HIDDEN_PROC),
    }


def _reap(uid: int, timeout_s: float = 5.0) -> None:
    """Kills and waits out every process of a sandbox uid (after a kill, the pid namespace's
    teardown is asynchronous), so the uid is empty before it is leased again."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        left = []
        for name in os.listdir("/proc"):
            if name.isdigit():
                try:
                    if os.stat(f"/proc/{name}").st_uid == uid:
                        left.append(int(name))
                except OSError:
                    continue
        if not left:
            return
        for pid in left:
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass
        time.sleep(0.01)


def _collect(proc: subprocess.Popen[bytes], report_r: int, audit_r: int, stdin: str,
             limits: SandboxLimits, start: float, group: cgroups.CallCgroup | None) -> SandboxResult:
    """Feeds stdin and reads stdout/stderr (capped), the audit and report pipes (capped) from one
    selector loop until EOF or the deadline, which counts from the call's start."""
    assert proc.stdin and proc.stdout and proc.stderr
    caps = {proc.stdout.fileno(): limits.output_bytes + 1, proc.stderr.fileno(): limits.output_bytes + 1,
            report_r: REPORT_CAP_BYTES, audit_r: AUDIT_CAP_BYTES}
    bufs: dict[int, bytearray] = {fd: bytearray() for fd in caps}
    sel = selectors.DefaultSelector()
    for fd in bufs:
        sel.register(fd, selectors.EVENT_READ)
    feed = _StdinFeed(proc.stdin, encode(stdin), sel)
    killed_for = _pump(sel, bufs, caps, feed, start + limits.wall_s, limits,
                       (proc.stdout.fileno(), proc.stderr.fileno()), group)
    sel.close()
    feed.close()
    if killed_for:
        _kill(proc, bufs[report_r], group)
    proc.wait()  # the init waits for pid 1, whose exit waits out every process of its namespace
    if group is not None and not killed_for:
        killed_for = _cgroup_verdict(group, limits)
    for fd in (report_r, audit_r):  # after a kill, keep what was already written (capped)
        try:
            os.set_blocking(fd, False)
            bufs[fd] += os.read(fd, max(0, caps[fd] - len(bufs[fd])))
        except OSError:
            pass
    return _result(bufs[proc.stdout.fileno()], bufs[proc.stderr.fileno()], bufs[report_r], bufs[audit_r],
                   killed_for, limits, start)


def _cgroup_verdict(group: cgroups.CallCgroup, limits: SandboxLimits) -> str:
    """The call's cgroup limit it hit so far ("" for none): an OOM kill (v1 kills one process, not
    the call: the service ends the rest), a refused fork, or its CPU seconds past the budget."""
    events = group.events()
    if events["oom_kill"]:
        return "memory_limit"
    if events["pids_max"]:
        return "pids_limit"
    if group.cpu_s() > limits.cpu_s:
        return "cpu_limit"
    return ""


def _kill(proc: subprocess.Popen[bytes], report: bytearray, group: cgroups.CallCgroup | None) -> None:
    """SIGKILL to the call's cgroup (the init is outside it), the namespace's pid 1 (all its
    processes die with it), then the init once it has reaped them (a subreaper: nothing is left for the host's init to
    reap, so the uid is free at once); the init itself if it has not exited within 2 s."""
    if group is not None:
        group.kill()
    first = bytes(report).split(b"\n", 1)[0]
    if first.startswith(b"pid ") and first[4:].isdigit() and proc.poll() is None:
        try:  # pid 1 is the init's grandchild, reaped only by it: while the init runs, not reused
            os.kill(int(first[4:]), signal.SIGKILL)
            proc.wait(timeout=2.0)
        except (OSError, subprocess.TimeoutExpired):
            pass
    proc.kill()


class _StdinFeed:
    """The program's stdin, written in non-blocking chunks when the pipe has room (a program that
    never reads it cannot hold the call past its deadline)."""

    def __init__(self, pipe: Any, data: bytes, sel: selectors.BaseSelector) -> None:
        self.pipe = pipe
        self.fd = pipe.fileno()
        self.view = memoryview(data)
        self.sel = sel
        os.set_blocking(self.fd, False)
        if self.view:
            sel.register(self.fd, selectors.EVENT_WRITE)
        else:
            self.close()

    def write(self) -> None:
        try:
            n = os.write(self.fd, self.view[:65536])
        except BlockingIOError:
            return
        except OSError:  # the program closed stdin or died: nothing more to feed
            n = len(self.view)
        self.view = self.view[n:]
        if not self.view:
            self.sel.unregister(self.fd)
            self.close()

    def close(self) -> None:
        if not self.pipe.closed:
            try:
                self.pipe.close()
            except OSError:
                pass


def _pump(sel: selectors.BaseSelector, bufs: dict[int, bytearray], caps: dict[int, int], feed: _StdinFeed,
          deadline: float, limits: SandboxLimits, out_fds: tuple[int, int], group: cgroups.CallCgroup | None) -> str:
    """The selector loop; returns why the program must be killed ("" when every pipe hit EOF)."""
    while len(sel.get_map()) > 0:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            return "wall_timeout"
        if group is not None:  # memory, tasks and CPU of all its processes together
            verdict = _cgroup_verdict(group, limits)
            if verdict:
                return verdict
        for key, _ in sel.select(timeout=min(remaining, 0.25 if group else 0.5)):
            if key.fd == feed.fd:
                feed.write()
                continue
            chunk = os.read(key.fd, 65536)
            if not chunk:
                sel.unregister(key.fd)
                continue
            room = caps[key.fd] - len(bufs[key.fd])
            bufs[key.fd] += chunk[:room]
            if len(chunk) >= room and key.fd not in out_fds:  # a flooded side pipe: stop reading it
                sel.unregister(key.fd)
        if sum(len(bufs[fd]) for fd in out_fds) > limits.output_bytes:
            return "output_limit"
    return ""


def _result(out: bytearray, err: bytearray, report: bytearray, audit: bytearray, killed_for: str,
            limits: SandboxLimits, start: float) -> SandboxResult:
    stdout = bytes(out)[: limits.output_bytes].decode("utf-8", "replace")
    stderr = bytes(err)[: limits.output_bytes].decode("utf-8", "replace")
    names = set(bytes(audit).decode("ascii", "replace").split())
    violations = sorted(names.intersection(VIOLATIONS))
    rep, setup_error = _read_report(report)
    if setup_error or (not rep and not killed_for):
        return SandboxResult(SANDBOX_ERROR, "setup", stdout=stdout, stderr=setup_error + stderr,
                             wall_s=time.monotonic() - start, violations=violations)
    subclass = _classify(rep, violations, stderr, killed_for, limits)
    code = rep.get("code")
    status = SANDBOX_ERROR if subclass else (OK if code == 0 else ERROR)
    return SandboxResult(status, subclass, exit_code=code, signal=rep.get("signal"), stdout=stdout,
                         stderr=stderr, wall_s=time.monotonic() - start, violations=violations)


def _read_report(report: bytearray) -> tuple[dict[str, Any], str]:
    """pid 1's exit report ({} if none) and the program process's setup error ("" if none)."""
    rep: dict[str, Any] = {}
    setup_error = ""
    for line in bytes(report).splitlines():
        try:
            obj = json.loads(line) if line.startswith(b"{") else None
        except ValueError:
            continue
        if isinstance(obj, dict) and "setup_error" in obj:
            setup_error = f"sandbox setup failed: {obj['setup_error']}\n"
        elif isinstance(obj, dict):
            rep = obj
    return rep, setup_error
