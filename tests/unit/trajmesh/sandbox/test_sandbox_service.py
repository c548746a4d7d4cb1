"""The service side of the sandbox cannot be attacked through its pipes: stdin is fed from the
selector loop, every pipe read is capped, violation names come from a closed set, text travels
losslessly, and every failure is a SANDBOX_ERROR result, never an exception in the caller."""

from __future__ import annotations

import json
import os
import resource
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from repo_paths import REPO

from trajmesh import sandbox

pytestmark = [pytest.mark.skipif(not sandbox.available(), reason="sandbox unavailable on this kernel"),
              pytest.mark.timeout(120)]

LIMITS = sandbox.SandboxLimits(wall_s=3.0, cpu_s=2, memory_bytes=512 << 20, output_bytes=8192)

# Finds the write end of the audit pipe among the program's inherited descriptors.
_FIND_AUDIT_FD = """
import fcntl, os, stat
def audit_fds():
    out = []
    for name in os.listdir('/proc/self/fd'):
        fd = int(name)
        try:
            st = os.fstat(fd)
        except OSError:
            continue
        if fd > 2 and stat.S_ISFIFO(st.st_mode) and fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_ACCMODE == os.O_WRONLY:
            out.append(fd)
    return out
"""


def test_a_program_that_never_reads_stdin_cannot_hold_the_call_past_its_deadline() -> None:
    # 1 MiB of stdin and a program that never reads it: the old sandbox wrote stdin before the
    # deadline started and blocked until the program exited (here: an hour, far past the timeout).
    res = sandbox.run_code("import time\ntime.sleep(3600)", stdin="x" * (1 << 20), limits=LIMITS)
    assert (res.status, res.subclass) == (sandbox.SANDBOX_ERROR, "wall_timeout")


def test_a_program_that_writes_before_reading_stdin_gets_all_of_it() -> None:
    # 200 KiB of output before reading 1 MiB of stdin: both pipes overflow unless the service
    # reads and writes in one loop.
    code = "import sys, hashlib\nprint('y' * 200_000)\nprint(hashlib.sha256(sys.stdin.buffer.read()).hexdigest())"
    limits = sandbox.SandboxLimits(wall_s=20.0, cpu_s=5, memory_bytes=512 << 20, output_bytes=1 << 20)
    res = sandbox.run_code(code, stdin="ab" * (1 << 19), limits=limits)
    import hashlib
    assert res.status == sandbox.OK, res
    assert res.stdout.splitlines()[-1] == hashlib.sha256(b"ab" * (1 << 19)).hexdigest()


def test_a_flooded_audit_pipe_is_read_only_up_to_its_cap() -> None:
    code = _FIND_AUDIT_FD + "block = b'network ' * 8192\nfor fd in audit_fds():\n    while True:\n        os.write(fd, block)"
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    res = sandbox.run_code(code, limits=LIMITS)
    grown_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before
    # The old service read the pipe without a cap: ~1 GiB per 10 s of flooding.
    assert grown_kib < 64 << 10, f"the service grew by {grown_kib} KiB"
    assert res.status == sandbox.SANDBOX_ERROR and res.subclass in ("network", "wall_timeout")


def test_invented_violation_names_are_dropped() -> None:
    code = _FIND_AUDIT_FD + "for fd in audit_fds():\n    os.write(fd, b'pwned\\nrm_rf\\n' + 'réseau'.encode() + b'\\n')\nprint('done')"
    res = sandbox.run_code(code, limits=LIMITS)
    assert res.violations == []
    assert (res.status, res.subclass, res.stdout.strip()) == (sandbox.OK, "", "done")


def test_lone_surrogates_travel_losslessly_and_never_raise() -> None:
    res = sandbox.run_code("import sys\nprint(sys.stdin.buffer.read().hex())", stdin="a\udc80b\ud800", limits=LIMITS)
    assert res.status == sandbox.OK and res.stdout.strip() == "a\udc80b\ud800".encode("utf-8", "surrogatepass").hex()
    bad = sandbox.run_code("print('\udc80')", limits=LIMITS)  # not valid UTF-8 source: the program's error
    assert bad.status == sandbox.ERROR and "SyntaxError" in bad.stderr


def test_an_exhausted_uid_pool_is_a_sandbox_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    if not sandbox.uses_uid_pool():
        pytest.skip("rootless: no uid pool (one uid mapped in a user namespace per call)")
    monkeypatch.setattr(sandbox, "LEASE_DIR", str(tmp_path))
    monkeypatch.setattr(sandbox, "UID_COUNT", 2)
    held = [sandbox._UidLease.acquire() for _ in range(2)]
    try:
        assert all(lease is not None for lease in held)
        res = sandbox.run_code("print(1)", limits=LIMITS)
        assert (res.status, res.subclass) == (sandbox.SANDBOX_ERROR, "setup") and "uid" in res.stderr
    finally:
        for lease in held:
            if lease is not None:
                lease.release()
    assert sandbox.run_code("print(1)", limits=LIMITS).ok


def test_a_failing_setup_is_a_result_not_an_exception(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sandbox.tempfile, "mkdtemp", lambda **_: (_ for _ in ()).throw(OSError(28, "No space left")))
    res = sandbox.run_code("print(1)", limits=LIMITS)
    assert (res.status, res.subclass) == (sandbox.SANDBOX_ERROR, "setup") and "No space left" in res.stderr
    monkeypatch.undo()
    # A failure in the program's process before exec (here: a syscall missing from the table) is the
    # sandbox's, not the program's: SANDBOX_ERROR/setup, not `error` with the init's exit code.
    monkeypatch.setattr(sandbox, "SECCOMP_DENY", (*sandbox.SECCOMP_DENY, "no_such_syscall"))
    res = sandbox.run_code("print(1)", limits=LIMITS)
    assert (res.status, res.subclass) == (sandbox.SANDBOX_ERROR, "setup") and "no_such_syscall" in res.stderr


def test_without_a_cgroup_a_service_refuses_unless_weaker_limits_are_allowed(monkeypatch: pytest.MonkeyPatch) -> None:
    from trajmesh.config import RunConfig
    from trajmesh.sandbox import cgroups

    found = sandbox.cgroup_mode()
    if found.kind != "none":  # the mode this host has is named in the line to log
        assert sandbox.preflight(allow_without_cgroup=False).startswith(f"sandbox: cgroup {found.kind}: ")
    monkeypatch.setenv(cgroups.ENV, "none")  # as on a host with no usable cgroup
    cgroups.mode.cache_clear()
    try:
        assert RunConfig().sandbox.allow_without_cgroup is False  # refusing is the default
        with pytest.raises(sandbox.SandboxUnavailable, match="cgroup none: .*allow_without_cgroup"):
            sandbox.preflight(allow_without_cgroup=False)
        assert "WEAKER LIMITS" in sandbox.preflight(allow_without_cgroup=True)
    finally:
        monkeypatch.undo()
        cgroups.mode.cache_clear()


@pytest.mark.skipif(os.geteuid() != 0 or shutil.which("unshare") is None, reason="needs root to mask /proc")
def test_a_masked_host_proc_runs_the_program_without_proc() -> None:
    # Kubernetes masks paths of a container's /proc (procMount: Default); the kernel then refuses a
    # fresh procfs in the sandbox. The call still runs, with no /proc inside.
    probe = ("import json\nfrom trajmesh import sandbox\n"
             "r = sandbox.run_code('import os, subprocess\\nprint(os.path.exists(\"/proc/self\"))\\n"
             "print(subprocess.run([\"echo\", \"hi\"], capture_output=True, text=True).stdout)')\n"
             "print(json.dumps([r.status, r.subclass, r.stdout, r.stderr[-500:]]))\n")
    script = f"mount --bind /dev/null /proc/uptime && exec {sys.executable} -c {shlex.quote(probe)}"
    out = subprocess.run(["unshare", "--mount", "--propagation", "private", "sh", "-c", script],
                         capture_output=True, text=True, timeout=100, cwd=str(REPO))
    assert out.returncode == 0, out.stderr
    status, subclass, stdout, stderr = json.loads(out.stdout.strip().splitlines()[-1])
    assert (status, subclass) == (sandbox.OK, ""), stderr
    assert stdout.split() == ["False", "hi"]
