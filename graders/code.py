"""Code tests decided by a harness the program cannot reach (no torch).

::

    grade ── run_code(HARNESS, stdin = {nonce, tests, program, budget_s}) ──▶ sandbox
                 harness (the sandbox's program; non-dumpable; tests and nonce only in its memory)
                   │ writes the program to /tmp/cand/solution.py (tests never there)
                   │ spawns a fresh `python -I` RUNNER in /tmp/cand, stdout/stderr to a log file
                   │ ◀── pipe: ("ready", names)     the runner imports solution.py as a module
                   │ ──▶ pipe: (call id, name, args, kwargs)    one per call a test makes
                   │ ◀── pipe: ("ok", call id, result) | ("raise", call id, exception name, text)
                   ▼
    stdout of the harness (the program has no handle on it): one JSON verdict line with the nonce

Tests are asserts from the task (`metadata.tests`); each runs in the harness with one proxy per
public callable of the program. Arguments and results cross the pipe as Python literals (`repr`,
read back with `ast.literal_eval`), so a result is plain data: an object whose `__eq__` always says
yes cannot come back. The verdict is the harness's own count: the program's exit code, stdout and
files never enter it, so an early `os._exit`, a patched `sys.exit`, a forged pass line, reading
the harness file, monkey-patching its own interpreter or writing an expected-output file all
score 0. Limits: tests may pass and compare only literal data (numbers, strings, bytes, tuples,
lists, dicts, sets, None); in-place mutation of an argument is not seen by the test; the program
may not keep state across tests apart from what its own process keeps.
"""

from __future__ import annotations

import json
import re
import secrets
from typing import Any

from trajmesh import sandbox
from trajmesh.graders.base import Grade, Sample

RUNNER = r"""
import ast, importlib.util, sys
rd, wr = open(int(sys.argv[1]), "rb"), open(int(sys.argv[2]), "wb", buffering=0)
def send(obj):
    wr.write(repr(obj).encode("utf-8", "surrogatepass") + b"\n")
sys.argv = ["solution.py"]
spec = importlib.util.spec_from_file_location("solution", "/tmp/cand/solution.py")
mod = importlib.util.module_from_spec(spec)
sys.modules["solution"] = mod
spec.loader.exec_module(mod)
send(("ready", [n for n, v in vars(mod).items() if callable(v) and not n.startswith("_")]))
for line in rd:
    cid, name, args, kwargs = ast.literal_eval(line.decode("utf-8", "surrogatepass"))
    try:
        out = ("ok", cid, getattr(mod, name)(*args, **kwargs))
    except BaseException as e:
        out = ("raise", cid, type(e).__name__, str(e)[:200])
    send(out)
"""

HARNESS = r"""
import ast, builtins, ctypes, json, os, select, secrets, subprocess, sys, time
ctypes.CDLL(None).prctl(4, 0)  # PR_SET_DUMPABLE 0: the program may not read this process (/proc/pid/mem, fd, ptrace)
job = json.loads(sys.stdin.buffer.read().decode("utf-8", "surrogatepass"))
deadline = time.monotonic() + job["budget_s"]
RUNNER, CAP = job["runner"], 1 << 20

class CandidateGone(Exception):
    pass

class Candidate:
    def __init__(self):
        os.makedirs("/tmp/cand", exist_ok=True)
        with open("/tmp/cand/solution.py", "wb") as fh:
            fh.write(job["program"].encode("utf-8", "surrogatepass"))
        req_r, self.req_w = os.pipe()
        self.resp_r, resp_w = os.pipe()
        log = open("/tmp/cand/output.log", "wb")
        self.proc = subprocess.Popen([sys.executable, "-I", "-c", RUNNER, str(req_r), str(resp_w)], cwd="/tmp/cand",
                                     stdin=subprocess.DEVNULL, stdout=log, stderr=log, pass_fds=(req_r, resp_w))
        os.close(req_r); os.close(resp_w); log.close()
        self.buf, self.alive = b"", True
        msg = self.read()
        if not (isinstance(msg, tuple) and len(msg) == 2 and msg[0] == "ready" and isinstance(msg[1], list)):
            self.fail("no ready message")
        self.names = [n for n in msg[1] if isinstance(n, str) and n.isidentifier()]

    def fail(self, why):
        self.alive = False
        self.proc.kill()
        raise CandidateGone(why)

    def read(self):
        while b"\n" not in self.buf:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([self.resp_r], [], [], left)[0]:
                self.fail("timeout")
            chunk = os.read(self.resp_r, 65536)
            if not chunk or len(self.buf) > CAP:
                self.fail("exited" if not chunk else "reply too long")
            self.buf += chunk
        line, self.buf = self.buf.split(b"\n", 1)
        try:
            return ast.literal_eval(line.decode("utf-8", "surrogatepass"))
        except (ValueError, SyntaxError, UnicodeDecodeError, MemoryError, RecursionError):
            self.fail("unreadable reply")

    def call(self, name, args, kwargs):
        if not self.alive:
            raise CandidateGone("gone")
        cid = secrets.token_hex(8)
        req = repr((cid, name, args, kwargs))
        try:
            literal = ast.literal_eval(req) == (cid, name, args, kwargs)
        except (ValueError, SyntaxError, MemoryError, RecursionError):
            literal = False
        if not literal:
            raise TypeError("arguments must be literals")
        try:
            os.write(self.req_w, req.encode("utf-8", "surrogatepass") + b"\n")
        except OSError:
            self.fail("exited")
        msg = self.read()
        if isinstance(msg, tuple) and len(msg) == 3 and msg[:2] == ("ok", cid):
            return msg[2]
        if isinstance(msg, tuple) and len(msg) == 4 and msg[:2] == ("raise", cid):
            cls = getattr(builtins, str(msg[2]), None)
            if isinstance(cls, type) and issubclass(cls, Exception):
                raise cls(str(msg[3]))
            raise RuntimeError(str(msg[2]))
        self.fail("bad reply")

def proxy(cand, name):
    return lambda *a, **k: cand.call(name, a, k)

passed, failures = 0, []
try:
    cand = Candidate()
except CandidateGone as e:
    cand, failures = None, [[-1, "program: " + str(e)]]
for i, src in enumerate(job["tests"]):
    if cand is None or not cand.alive:
        failures.append([i, "program gone"])
        continue
    ns = {"__builtins__": builtins, "__name__": "__tests__"}
    ns.update({n: proxy(cand, n) for n in cand.names})
    try:
        exec(compile(src, "<test %d>" % i, "exec"), ns)
        passed += 1
    except BaseException as e:
        failures.append([i, type(e).__name__])
if cand is not None:
    cand.proc.kill()
    cand.proc.wait()
print(json.dumps({"nonce": job["nonce"], "passed": passed, "total": len(job["tests"]), "failures": failures[:20]}))
"""


def extract_program(text: str) -> tuple[str, bool]:
    blocks = re.findall(r"```(?:python)?\n(.*?)```", text, flags=re.DOTALL)
    return (blocks[-1], True) if blocks else (text, False)


def read_verdict(stdout: str, nonce: str, total: int) -> int | None:
    """Tests passed according to the harness's verdict line carrying this call's nonce, or None."""
    for line in reversed(stdout.splitlines()):
        try:
            verdict = json.loads(line)
        except ValueError:
            continue
        if isinstance(verdict, dict) and verdict.get("nonce") == nonce and verdict.get("total") == total:
            passed = verdict.get("passed")
            return passed if isinstance(passed, int) and 0 <= passed <= total else None
    return None


class CodeTestsGrader:
    revision = "code-tests-harness-v2"
    components = ("all_passed", "pass_ratio", "format_code_block", "sandbox_error")

    def __init__(self, limits: sandbox.SandboxLimits | None = None) -> None:
        self.limits = limits or sandbox.SandboxLimits(wall_s=10.0, cpu_s=5)

    def grade(self, sample: Sample, task: dict[str, Any]) -> Grade:
        tests = [str(t) for t in task["metadata"]["tests"]]
        program, fenced = extract_program(sample.text)
        nonce = secrets.token_hex(16)
        job = {"nonce": nonce, "tests": tests, "program": program, "runner": RUNNER,
               "budget_s": self.limits.wall_s * 0.8}
        res = sandbox.run_code(HARNESS, stdin=json.dumps(job), limits=self.limits)
        verdict = read_verdict(res.stdout, nonce, len(tests)) if res.status == sandbox.OK else None
        passed = verdict or 0
        ratio = passed / max(1, len(tests))
        components = {"all_passed": float(bool(tests) and passed == len(tests)), "pass_ratio": ratio,
                      "format_code_block": float(fenced), "sandbox_error": float(bool(res.subclass))}
        out = f"status={res.status} subclass={res.subclass} passed={passed}/{len(tests)}"
        return Grade(components["all_passed"], components, out, self.revision)
