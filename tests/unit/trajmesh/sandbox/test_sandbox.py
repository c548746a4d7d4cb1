"""The sandbox abuse suite: each attack is contained, classified SANDBOX_ERROR/<subclass>, the host is
untouched, nothing is left running, and the next call still works."""

from __future__ import annotations

import dataclasses
import fcntl
import os
import socket
from pathlib import Path

import pytest
from repo_paths import REPO

from trajmesh import sandbox
from trajmesh.sandbox import cgroups

pytestmark = [pytest.mark.skipif(not sandbox.available(), reason="sandbox unavailable on this kernel (see sandbox.unavailable_reason())"),
              pytest.mark.timeout(120)]

LIMITS = sandbox.SandboxLimits(wall_s=3.0, cpu_s=1, memory_bytes=512 << 20, max_processes=16, output_bytes=8192)
CGROUP_SUBCLASS = {"process_limit": "pids_limit", "cpu_time": "cpu_limit"}
"""With a per-call cgroup (v1 or v2), its limit on all processes fires before the per-process rlimit."""


def _expected(subclass: str) -> str:
    return CGROUP_SUBCLASS.get(subclass, subclass) if sandbox.cgroup_mode().kind != "none" else subclass


def _processes_by_sandbox_uid() -> dict[int, list[int]]:
    out: dict[int, list[int]] = {}
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                st = os.stat(f"/proc/{name}")
            except OSError:
                continue
            if sandbox.UID_BASE <= st.st_uid < sandbox.UID_BASE + sandbox.UID_COUNT:
                out.setdefault(st.st_uid, []).append(int(name))
    return out


def _sandbox_processes() -> list[int]:
    """Live processes running as a sandbox uid that no call holds: they outlived their call. A uid
    whose lease another call holds (another test run or mesh on this machine; leases are
    machine-wide) is that call's business — counting it failed a run beside a second `make test`."""
    out = []
    for uid, pids in _processes_by_sandbox_uid().items():
        fd = os.open(f"{sandbox.LEASE_DIR}/{uid - sandbox.UID_BASE}.lock", os.O_CREAT | os.O_RDWR, 0o600)
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                continue  # leased: a live call's processes
            # Free lease, held by us now: anything still running as this uid outlived its call.
            if uid in _processes_by_sandbox_uid():
                out += pids
        finally:
            os.close(fd)  # releases the lock
    return sorted(out)


def _call_cgroups() -> list[str]:
    """This process's calls' cgroups under its parents (none between calls)."""
    mine = f"{cgroups.CALL_PREFIX}{os.getpid()}-"
    return [p for p in cgroups.leftovers(sandbox.cgroup_mode()) if os.path.basename(p).startswith(mine)]


def _run(code: str, limits: sandbox.SandboxLimits = LIMITS) -> sandbox.SandboxResult:
    assert _call_cgroups() == []
    res = sandbox.run_code(code, limits=limits)
    assert _sandbox_processes() == [], "a sandboxed process outlived the call"
    assert _call_cgroups() == [], "a call's cgroup outlived the call"
    healthy = sandbox.run_code("print(6 * 7)", limits=LIMITS)
    assert healthy.ok and healthy.stdout.strip() == "42"
    return res


def test_normal_code_runs_with_stdin_and_scratch_files() -> None:
    res = sandbox.run_code("import sys, json\nopen('x.txt','w').write(sys.stdin.read())\nprint(open('x.txt').read()[::-1])",
                           stdin="abc", limits=LIMITS)
    assert res.status == sandbox.OK and res.stdout.strip() == "cba"
    err = sandbox.run_code("raise ValueError('boom')", limits=LIMITS)
    assert err.status == sandbox.ERROR and "boom" in err.stderr


@pytest.mark.parametrize("code,subclass", [
    ("import os\nwhile True:\n    os.fork()", "process_limit"),
    ("x = bytearray(8 << 30)", "memory"),
    ("while True:\n    pass", "cpu_time"),
    ("import time\ntime.sleep(60)", "wall_timeout"),
    ("while True:\n    print('x' * 1000)", "output_limit"),
    ("import subprocess\nsubprocess.Popen(['sleep', '60'], start_new_session=True)\nprint('bye')", "orphan_process"),
])
def test_resource_abuse_is_contained(code: str, subclass: str) -> None:
    # cpu_time gets a long deadline: on a loaded machine one CPU-second can take several wall seconds.
    res = _run(code, dataclasses.replace(LIMITS, wall_s=20.0) if subclass == "cpu_time" else LIMITS)
    assert (res.status, res.subclass) == (sandbox.SANDBOX_ERROR, _expected(subclass)), res


def test_local_nats_and_redis_ports_are_unreachable() -> None:
    servers = [socket.create_server(("127.0.0.1", 0)) for _ in range(2)]  # stand-ins for NATS and Redis
    try:
        ports = [s.getsockname()[1] for s in servers]
        code = f"import socket\nfor p in {ports!r}:\n    socket.create_connection(('127.0.0.1', p), timeout=1)"
        res = _run(code)
        assert (res.status, res.subclass) == (sandbox.SANDBOX_ERROR, "network")
        for s in servers:
            s.setblocking(False)
            with pytest.raises(BlockingIOError):
                s.accept()
    finally:
        for s in servers:
            s.close()


def test_writes_outside_the_temp_dir_are_blocked(tmp_path: Path) -> None:
    target = tmp_path / "escaped"
    code = ("import os\n"
            f"try:\n    os.makedirs({str(tmp_path)!r}, exist_ok=True); open({str(target)!r}, 'w').write('x')\n"
            "except OSError:\n    pass\n"
            "open('/etc/trajmesh-pwned', 'w').write('x')")
    res = _run(code)  # the first write lands in the sandbox's own /tmp, the second is refused
    assert not target.exists() and not Path("/etc/trajmesh-pwned").exists()
    assert res.status == sandbox.SANDBOX_ERROR and res.subclass == "fs_write"


def test_service_env_and_secret_files_are_unreadable(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TRAJMESH_TEST_SECRET", "s3cr3t-value")
    secret = tmp_path / "secret.txt"
    secret.write_text("s3cr3t-file")
    secret.chmod(0o600)
    code = ("import os\nprint(dict(os.environ))\n"
            f"for p in ['/proc/1/environ', '/proc/{os.getpid()}/environ', {str(secret)!r}, '/root/.bashrc']:\n"
            "    try:\n        print(open(p).read())\n    except OSError as e:\n        print('denied', e)\n")
    res = _run(code)
    assert "s3cr3t" not in res.stdout + res.stderr
    assert (res.status, res.subclass) == (sandbox.SANDBOX_ERROR, "secret_access")


def test_signalling_the_parent_fails() -> None:
    res = _run(f"import os, signal\nos.kill({os.getpid()}, signal.SIGKILL)")
    assert (res.status, res.subclass) == (sandbox.SANDBOX_ERROR, "signal")


def test_a_python_install_under_tmp_stays_usable_and_read_only() -> None:
    # The sandbox replaces /tmp with a fresh tmpfs; an interpreter whose venv lives under /tmp (a
    # checkout in /tmp) must still start inside, and the venv must not be writable from there.
    import json
    import shutil
    import subprocess
    import sys
    import sysconfig
    import tempfile

    root = Path(tempfile.mkdtemp(prefix="trajmesh-venv-", dir="/tmp"))
    try:
        venv = root / "venv"
        subprocess.run([os.path.realpath(sys.executable), "-m", "venv", "--without-pip", str(venv)], check=True)
        probe = (
            "import json, site, sys; site.addsitedir(sys.argv[1]); sys.path.insert(0, sys.argv[2])\n"
            "from trajmesh import sandbox\n"
            "code = 'import sys\\nprint(6 * 7, sys.prefix)\\n"
            "try:\\n    open(sys.prefix + \"/x\", \"w\")\\nexcept OSError as e:\\n    print(\"ro\", e.errno)'\n"
            "r = sandbox.run_code(code)\n"
            "print(json.dumps([r.status, r.subclass, r.stdout, r.stderr[-500:]]))\n"
        )
        out = subprocess.run([str(venv / "bin" / "python"), "-c", probe, sysconfig.get_paths()["purelib"],
                              str(REPO)],
                             capture_output=True, text=True, timeout=60, check=True).stdout
        status, subclass, stdout, stderr = json.loads(out.strip().splitlines()[-1])
        assert status == sandbox.OK and subclass == "", stderr
        assert stdout.splitlines()[0] == f"42 {venv}"
        assert stdout.splitlines()[1] == "ro 30"  # EROFS: the venv is mounted read-only inside
    finally:
        shutil.rmtree(root, ignore_errors=True)


def test_a_venv_reached_through_a_symlink_runs_calls(tmp_path: Path) -> None:
    # A shared or relocated venv is often a symlink to the real directory; the new root binds real
    # paths, so the interpreter, its prefixes and site-packages must be resolved before binding.
    import json
    import subprocess
    import sys

    link = tmp_path / "venv"
    link.symlink_to(os.path.realpath(sys.prefix), target_is_directory=True)
    python = link / "bin" / os.path.basename(sys.executable)
    assert python.exists()
    probe = ("import json, sys\nsys.path.insert(0, sys.argv[1])\nfrom trajmesh import sandbox\n"
             "r = sandbox.run_code('import sys, json\\nprint(6 * 7, sys.prefix)\\n"
             "import pydantic\\nprint(pydantic.__name__)')\n"
             "print(json.dumps([sys.prefix, r.status, r.subclass, r.stdout, r.stderr[-500:]]))\n")
    out = subprocess.run([str(python), "-c", probe, str(REPO)],
                         capture_output=True, text=True, timeout=60, check=True).stdout
    prefix, status, subclass, stdout, stderr = json.loads(out.strip().splitlines()[-1])
    assert prefix == str(link)  # the caller's interpreter runs through the link
    assert (status, subclass) == (sandbox.OK, ""), stderr
    assert stdout.split() == ["42", os.path.realpath(sys.prefix), "pydantic"]  # site-packages of the venv
