"""Run untrusted, model-written Python with no network, a fresh filesystem and hard limits (no torch).

::

    run_code(code) ── unshare --net --mount --pid --fork --kill-child ──▶ init (pid 1, root)
        │ stdout/stderr (capped)        │ fresh tmpfs on /tmp, /var/tmp, /dev/shm; /root etc. masked
        │ audit pipe (violation kinds)  │ fork ──▶ user child: rlimits, uid from a leased range,
        │ report pipe (exit, orphans)   │          no caps, clean env ─▶ python -I main.py
        ▼                               ▼ exit ──▶ the kernel kills everything left in the pid ns
    SandboxResult(status, subclass)

Containment is the kernel's: a network namespace with only a down loopback (no NATS/Redis
reachable), a mount namespace whose writable places are fresh tmpfs, a pid namespace (nothing
outlives the call; the parent's processes are invisible), an unprivileged uid that is unique per
concurrent call (so RLIMIT_NPROC holds — root ignores it), and rlimits for CPU, address space,
processes, file size and open files. The service enforces the wall-clock deadline and the output
cap. Classification is best effort: a Python audit hook in the sandbox reports which forbidden
operation was attempted (network, fs_write, secret_access, signal), the init reports orphans, and
exit signals / messages give the resource class. Needs root (or CAP_SYS_ADMIN) and util-linux.
"""

from __future__ import annotations

import fcntl
import json
import os
import random
import selectors
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from typing import Any

OK, ERROR, SANDBOX_ERROR = "ok", "error", "SANDBOX_ERROR"
"""`status` values: ran and exited 0; the program failed on its own (exception, exit code);
the sandbox stopped a violation or a limit (see `SUBCLASSES`)."""

SUBCLASSES = (
    "wall_timeout", "cpu_time", "memory", "process_limit", "output_limit", "file_size",
    "network", "fs_write", "secret_access", "signal", "orphan_process", "setup",
)
"""Every `subclass` of SANDBOX_ERROR (metrics export each with an initial 0)."""
VIOLATIONS = ("network", "fs_write", "secret_access", "signal")
"""The only names the audit pipe may carry; anything else the program writes there is dropped."""
AUDIT_CAP_BYTES, REPORT_CAP_BYTES = 4096, 4096
"""Most bytes read from the audit and report pipes (the program can write to the audit pipe)."""

UID_BASE, UID_COUNT = 200_000, 1024
"""Sandboxes run as uid/gid UID_BASE + k, each leased to one call at a time (RLIMIT_NPROC is per uid)."""
LEASE_DIR = "/run/trajmesh-sandbox"
MASKED_DIRS = ("/root", "/home", "/run/secrets", "/var/run/secrets", "/etc/trajmesh")
"""Hidden behind an empty tmpfs inside the sandbox (service secrets, credentials, home dirs)."""
FRESH_TMPFS = ("/tmp", "/var/tmp", "/dev/shm")


@dataclass(frozen=True)
class SandboxLimits:
    wall_s: float = 10.0
    """Wall-clock deadline of the whole call, seconds (sleeping past it is `wall_timeout`)."""
    cpu_s: int = 5
    """CPU seconds of the program (RLIMIT_CPU); keep below wall_s so spinning is `cpu_time`."""
    memory_bytes: int = 1 << 30
    """Address space of each sandboxed process (RLIMIT_AS)."""
    max_processes: int = 32
    """Processes of the sandbox uid (RLIMIT_NPROC), the program included."""
    file_size_bytes: int = 8 << 20
    """Largest file the program may write (RLIMIT_FSIZE)."""
    tmpfs_bytes: int = 64 << 20
    """Size of the fresh /tmp."""
    output_bytes: int = 64 << 10
    """stdout + stderr cap; more is `output_limit` and the program is killed."""
    open_files: int = 64


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
    """True where the sandbox can run: root (namespaces, uid switch) and util-linux `unshare`."""
    return os.geteuid() == 0 and shutil.which("unshare") is not None


def uses_uid_pool() -> bool:
    """True where each call leases its own host uid (root); rootless calls all run as the caller's uid."""
    return os.geteuid() == 0


# The init runs as pid 1 of the new namespaces, as root, with `python -I -S`.
_INIT = r"""
import ctypes, json, os, sys
cfg = json.loads(sys.argv[1])
libc = ctypes.CDLL(None, use_errno=True)
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_REMOUNT, MS_BIND, MS_MOVE, MS_REC = 1, 2, 4, 32, 4096, 8192, 16384
def mount(src, dst, fstype, flags, data=None):
    if libc.mount(src and src.encode(), dst.encode(), fstype and fstype.encode(), flags,
                  data and data.encode()) != 0:
        raise OSError(ctypes.get_errno(), "mount " + dst)
code = open(cfg["code_path"], "rb").read()
stdin_data = None
# Python installs under /tmp, /var/tmp or /dev/shm (e.g. a checkout's venv in /tmp) are about to be
# hidden by fresh tmpfs: hold them open now and bind them back read-only afterwards.
held = [(os.open(p, os.O_PATH | os.O_DIRECTORY), p) for p in cfg["expose_fresh"]]
mount("tmpfs", "/tmp", "tmpfs", MS_NOSUID | MS_NODEV, "size=%d,mode=1777" % cfg["tmpfs_bytes"])
for d in cfg["fresh"]:
    if os.path.isdir(d):
        mount("tmpfs", d, "tmpfs", MS_NOSUID | MS_NODEV, "size=1m,mode=1777")
stage = []
for i, p in enumerate(cfg["expose"]):  # python installs under masked dirs: stage, mask, re-expose ro
    s = "/tmp/.stage%d" % i
    os.mkdir(s)
    mount(p, s, None, MS_BIND | MS_REC)
    stage.append((s, p))
for d in cfg["masked"]:
    if os.path.isdir(d):
        mount("tmpfs", d, "tmpfs", MS_NOSUID | MS_NODEV, "size=1m,mode=755")
for s, p in stage:
    os.makedirs(p, exist_ok=True)
    mount(s, p, None, MS_MOVE)
    mount(None, p, None, MS_BIND | MS_REMOUNT | MS_RDONLY | MS_REC)
    os.rmdir(s)
for fd, p in held:
    os.makedirs(p, exist_ok=True)
    mount("/proc/self/fd/%d" % fd, p, None, MS_BIND | MS_REC)
    mount(None, p, None, MS_BIND | MS_REMOUNT | MS_RDONLY | MS_REC)
    os.close(fd)
uid = cfg["uid"]
os.mkdir("/tmp/work", 0o755)
with open("/tmp/work/main.py", "wb") as fh:
    fh.write(code)
os.chown("/tmp/work", uid, uid)
os.chown("/tmp/work/main.py", uid, uid)
report_fd, audit_fd = cfg["report_fd"], cfg["audit_fd"]
pid = os.fork()
if pid == 0:
    import resource
    L = cfg["limits"]
    for what, val in ((resource.RLIMIT_CPU, (L["cpu_s"], L["cpu_s"] + 1)),
                      (resource.RLIMIT_AS, (L["memory_bytes"],) * 2),
                      (resource.RLIMIT_NPROC, (L["max_processes"],) * 2),
                      (resource.RLIMIT_FSIZE, (L["file_size_bytes"],) * 2),
                      (resource.RLIMIT_NOFILE, (L["open_files"],) * 2),
                      (resource.RLIMIT_CORE, (0, 0))):
        resource.setrlimit(what, val)
    os.close(report_fd)
    os.closerange(3, audit_fd)
    os.closerange(audit_fd + 1, 1 << 16)
    os.setgroups([])
    os.setresgid(uid, uid, uid)
    os.setresuid(uid, uid, uid)
    libc.prctl(1, 9)  # PR_SET_PDEATHSIG SIGKILL (after the uid change, which clears it)
    os.chdir("/tmp/work")
    env = {"PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": "/tmp/work", "LANG": "C.UTF-8",
           "OPENBLAS_NUM_THREADS": "1", "OMP_NUM_THREADS": "1", "MPLCONFIGDIR": "/tmp"}
    os.execve(cfg["python"], [cfg["python"], "-I", "-c", cfg["boot"], str(audit_fd)] + cfg["expose"]
              + cfg["expose_fresh"], env)
os.close(audit_fd)
_, status, usage = os.wait4(pid, 0)
orphans = 0
for name in os.listdir("/proc"):
    if name.isdigit() and name != "1":
        try:
            state = open("/proc/%s/stat" % name).read().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        orphans += state != "Z"
rep = {"exited": os.WIFEXITED(status), "code": os.WEXITSTATUS(status) if os.WIFEXITED(status) else None,
       "signal": os.WTERMSIG(status) if os.WIFSIGNALED(status) else None,
       "cpu_s": usage.ru_utime + usage.ru_stime, "orphans": orphans}
os.write(report_fd, json.dumps(rep).encode())
"""

# Runs in the sandboxed interpreter before the program: reports attempted violations (the kernel
# blocks them regardless; this only names them).
_BOOT = r"""
import os, re, sys
_fd = int(sys.argv[1]); _seen = set()
_PY = tuple(p + "/" for p in sys.argv[2:])
def _flag(kind):
    if kind not in _seen:
        _seen.add(kind)
        try:
            os.write(_fd, (kind + "\n").encode())
        except OSError:
            pass
_W = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND
_SECRET = re.compile(r"^/proc/[^/]+/(environ|mem)$|^/(root|home|run/secrets|var/run/secrets|etc/trajmesh)(/|$)|^/etc/(shadow|gshadow|sudoers)")
_OKW = ("/tmp/", "/dev/null", "/dev/stdout", "/dev/stderr", "/proc/self/fd/")
def _path(p):
    if isinstance(p, int):
        return None
    p = os.fsdecode(p)
    return p if p.startswith("/") else os.path.join("/tmp/work", p)
def _hook(event, args):
    if event in ("socket.connect", "socket.sendto", "socket.sendmsg", "socket.bind"):
        _flag("network")
    elif event == "open":
        p = _path(args[0])
        if p is None:
            return
        mode, flags = args[1], args[2] or 0
        write = (isinstance(mode, str) and any(c in mode for c in "wax+")) or bool(flags & _W)
        p = os.path.normpath(p)
        if _SECRET.search(p) and not p.startswith(_PY):
            _flag("secret_access")
        elif write and not (p + "/").startswith(_OKW) and not p.startswith(_OKW):
            _flag("fs_write")
    elif event in ("os.remove", "os.rename", "os.mkdir", "os.rmdir", "os.chmod", "os.chown", "os.symlink",
                   "os.link", "os.truncate", "os.utime"):
        p = _path(args[0])
        if p is not None and not os.path.normpath(p).startswith("/tmp"):
            _flag("fs_write")
    elif event in ("os.kill", "os.killpg"):
        pid = args[0]
        if pid <= 1 or not os.path.exists("/proc/%d" % pid):
            _flag("signal")
    elif event == "os.getenv" or event == "os.environ":
        pass
sys.addaudithook(_hook)
del _hook
sys.argv = ["main.py"]
import runpy
runpy.run_path("/tmp/work/main.py", run_name="__main__")
"""


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


def _python_prefixes_under(dirs: tuple[str, ...]) -> list[str]:
    """This interpreter's install prefixes (base and venv) that lie under one of `dirs`."""
    out = {p for p in (os.path.realpath(sys.base_prefix), os.path.realpath(sys.prefix))
           if any(p == d or p.startswith(d + "/") for d in dirs)}
    return sorted(out)


def _classify(rep: dict, violations: list[str], stderr: str, killed_for: str, limits: SandboxLimits) -> str:
    """The SANDBOX_ERROR subclass, or "" when the program ran within bounds."""
    for kind in VIOLATIONS:
        if kind in violations:
            return kind
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


def run_code(code: str, *, stdin: str = "", limits: SandboxLimits | None = None) -> SandboxResult:
    """Run `code` as `python main.py` in a fresh sandbox. Never raises: whatever the code does and
    whatever fails on this side (no free uid, a missing tool, a kernel refusal) is a result."""
    limits = limits or SandboxLimits()
    start = time.monotonic()
    try:
        return _run(code, stdin, limits, start)
    except Exception as exc:  # noqa: BLE001 - the promise above: a SANDBOX_ERROR, never an exception
        return SandboxResult(SANDBOX_ERROR, "setup", stderr=f"sandbox setup failed: {type(exc).__name__}: {exc}",
                             wall_s=time.monotonic() - start)


def _run(code: str, stdin: str, limits: SandboxLimits, start: float) -> SandboxResult:
    if not available():
        return SandboxResult(SANDBOX_ERROR, "setup", stderr="sandbox needs root and util-linux unshare")
    lease = _UidLease.acquire()
    if lease is None:
        return SandboxResult(SANDBOX_ERROR, "setup", stderr="no free sandbox uid (all leases taken)",
                             wall_s=time.monotonic() - start)
    host_dir = tempfile.mkdtemp(prefix="trajmesh-sbx-")
    report_r, report_w = os.pipe()
    audit_r, audit_w = os.pipe()
    try:
        code_path = os.path.join(host_dir, "main.py")
        with open(code_path, "wb") as fh:
            fh.write(encode(code))
        cfg = {
            "code_path": code_path, "uid": lease.uid, "report_fd": report_w, "audit_fd": audit_w,
            "tmpfs_bytes": limits.tmpfs_bytes, "fresh": [d for d in FRESH_TMPFS if d != "/tmp"],
            "masked": list(MASKED_DIRS), "expose": _python_prefixes_under(MASKED_DIRS),
            "expose_fresh": _python_prefixes_under(FRESH_TMPFS),
            "python": sys.executable,
            "boot": _BOOT, "limits": {k: getattr(limits, k) for k in
                                      ("cpu_s", "memory_bytes", "max_processes", "file_size_bytes", "open_files")},
        }
        cmd = ["unshare", "--net", "--mount", "--pid", "--fork", "--kill-child", "--mount-proc",
               sys.executable, "-I", "-S", "-c", _INIT, json.dumps(cfg)]
        proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                pass_fds=(report_w, audit_w), env={"PATH": "/usr/bin:/bin"},
                                start_new_session=True, close_fds=True)
        os.close(report_w)
        os.close(audit_w)
        report_w = audit_w = -1
        return _collect(proc, report_r, audit_r, stdin, limits, start)
    finally:
        for fd in (report_r, audit_r, report_w, audit_w):
            if fd >= 0:
                try:
                    os.close(fd)
                except OSError:
                    pass
        shutil.rmtree(host_dir, ignore_errors=True)
        _reap(lease.uid)
        lease.release()


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
             limits: SandboxLimits, start: float) -> SandboxResult:
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
    killed_for = _pump(sel, bufs, caps, feed, start + limits.wall_s, limits.output_bytes,
                       (proc.stdout.fileno(), proc.stderr.fileno()))
    sel.close()
    feed.close()
    if killed_for:
        proc.kill()  # --kill-child: the init dies, and with it the whole pid namespace
    proc.wait()
    for fd in (report_r, audit_r):  # after a kill, keep what was already written (capped)
        try:
            os.set_blocking(fd, False)
            bufs[fd] += os.read(fd, max(0, caps[fd] - len(bufs[fd])))
        except OSError:
            pass
    return _result(bufs[proc.stdout.fileno()], bufs[proc.stderr.fileno()], bufs[report_r], bufs[audit_r],
                   killed_for, limits, start)


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
          deadline: float, output_bytes: int, out_fds: tuple[int, int]) -> str:
    """The selector loop; returns why the program must be killed ("" when every pipe hit EOF)."""
    while len(sel.get_map()) > 0:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            return "wall_timeout"
        for key, _ in sel.select(timeout=min(remaining, 0.5)):
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
        if sum(len(bufs[fd]) for fd in out_fds) > output_bytes:
            return "output_limit"
    return ""


def _result(out: bytearray, err: bytearray, report: bytearray, audit: bytearray, killed_for: str,
            limits: SandboxLimits, start: float) -> SandboxResult:
    stdout = bytes(out)[: limits.output_bytes].decode("utf-8", "replace")
    stderr = bytes(err)[: limits.output_bytes].decode("utf-8", "replace")
    names = set(bytes(audit).decode("ascii", "replace").split())
    violations = sorted(names.intersection(VIOLATIONS))
    try:
        rep = json.loads(bytes(report) or b"{}")
    except ValueError:
        rep = {}
    if not isinstance(rep, dict) or (not rep and not killed_for):
        return SandboxResult(SANDBOX_ERROR, "setup", stdout=stdout, stderr=stderr,
                             wall_s=time.monotonic() - start, violations=violations)
    subclass = _classify(rep, violations, stderr, killed_for, limits)
    code = rep.get("code")
    status = SANDBOX_ERROR if subclass else (OK if code == 0 else ERROR)
    return SandboxResult(status, subclass, exit_code=code, signal=rep.get("signal"), stdout=stdout,
                         stderr=stderr, wall_s=time.monotonic() - start, violations=violations)
