"""Code tests decided by a harness the program cannot reach (no torch).

::

    grade ── run_code(HARNESS, stdin = {nonce, tests, program, budget_s}) ──▶ sandbox
                 harness (the sandbox's program; non-dumpable; tests and nonce only in its memory)
                   │ forks the program's process BEFORE reading the job (it never holds the tests);
                   │ sends it the program, which it writes to /tmp/cand/solution.py and runs as
                   │ module `solution` in /tmp/cand, stdout/stderr to a log file, stdin /dev/null
                   │ ◀── pipe: ("ready", names)
                   │ ──▶ pipe: (call id, name, args, kwargs)    one per call a test makes
                   │ ◀── pipe: ("ok", call id, result) | ("raise", call id, exception name, text)
                   ▼
    stdout of the harness (the program has no handle on it): one verdict line (a Python literal)
    carrying the grader's per-call nonce

Tests are asserts from the task (`metadata.tests`); each runs in the harness with one proxy per
public callable of the program. Arguments and results cross the pipe as Python literals (`repr`,
read back with `ast.literal_eval`), so a result is plain data: an object whose `__eq__` always says
yes cannot come back. The verdict is the harness's own count: the program's exit code, stdout and
files never enter it, so an early `os._exit`, a patched `sys.exit`, a forged pass line, reading
the harness file or any process, monkey-patching its own interpreter, writing an expected-output
file or killing the harness all score 0 (tests/unit/graders/test_code_grader_hacking.py). Limits: tests may
pass and compare only literal data (numbers, strings, bytes, tuples, lists, dicts, sets, None);
in-place mutation of an argument is not seen by the test; one process serves all tests of a call
(module state carries over, as after one import); a task with no tests scores 0.
"""

from __future__ import annotations

import ast
import re
import secrets
from typing import Any

from trajmesh import sandbox
from trajmesh.graders.base import Grade, Sample

HARNESS = r"""
import ast, builtins, ctypes, os, select, sys, time  # no json/re: every import costs each call
ctypes.CDLL(None).prctl(4, 0)  # PR_SET_DUMPABLE 0: the program may not read this process (/proc/pid/mem, fd, ptrace)
req_r, req_w = os.pipe()
resp_r, resp_w = os.pipe()
prog_r, prog_w = os.pipe()

def serve():
    # The program's process: forked before the job (tests, nonce) is read, so it never holds them.
    null = os.open("/dev/null", os.O_RDWR)
    os.dup2(null, 0)  # the job arrives on stdin after the fork: only the harness reads it
    for fd in (req_w, resp_r, prog_w, null):
        os.close(fd)
    chunks = []
    while True:
        chunk = os.read(prog_r, 1 << 16)
        if not chunk:
            break
        chunks.append(chunk)
    os.makedirs("/tmp/cand", exist_ok=True)
    with open("/tmp/cand/solution.py", "wb") as fh:
        fh.write(b"".join(chunks))
    log = os.open("/tmp/cand/output.log", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(log, 1)
    os.dup2(log, 2)
    os.chdir("/tmp/cand")
    wr = open(resp_w, "wb", buffering=0)
    send = lambda obj: wr.write(repr(obj).encode("utf-8", "surrogatepass") + b"\n")
    sys.argv = ["solution.py"]
    ns = {"__name__": "solution", "__file__": "/tmp/cand/solution.py", "__builtins__": builtins}
    exec(compile(open("/tmp/cand/solution.py", "rb").read(), "/tmp/cand/solution.py", "exec"), ns)
    send(("ready", [n for n, v in ns.items() if callable(v) and not n.startswith("_")]))
    for line in open(req_r, "rb"):
        cid, name, args, kwargs = ast.literal_eval(line.decode("utf-8", "surrogatepass"))
        try:
            out = ("ok", cid, ns[name](*args, **kwargs))
        except BaseException as e:
            out = ("raise", cid, type(e).__name__, str(e)[:200])
        send(out)

child = os.fork()
if child == 0:
    try:
        serve()
    finally:
        os._exit(0)
for fd in (req_r, resp_w, prog_r):
    os.close(fd)
job = ast.literal_eval(sys.stdin.buffer.read().decode("utf-8", "surrogatepass"))
deadline = time.monotonic() + job["budget_s"]
CAP = 1 << 20

class CandidateGone(Exception):
    pass

class Candidate:
    def __init__(self):
        self.buf, self.alive = b"", True
        try:
            os.write(prog_w, job["program"].encode("utf-8", "surrogatepass"))
        except OSError:
            pass
        os.close(prog_w)
        msg = self.read()
        if not (isinstance(msg, tuple) and len(msg) == 2 and msg[0] == "ready" and isinstance(msg[1], list)):
            self.fail("no ready message")
        self.names = [n for n in msg[1] if isinstance(n, str) and n.isidentifier()]

    def fail(self, why):
        self.alive = False
        try:
            os.kill(child, 9)
        except OSError:
            pass
        raise CandidateGone(why)

    def read(self):
        while b"\n" not in self.buf:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([resp_r], [], [], left)[0]:
                self.fail("timeout")
            chunk = os.read(resp_r, 65536)
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
        cid = os.urandom(8).hex()
        req = repr((cid, name, args, kwargs))
        try:
            literal = ast.literal_eval(req) == (cid, name, args, kwargs)
        except (ValueError, SyntaxError, MemoryError, RecursionError):
            literal = False
        if not literal:
            raise TypeError("arguments must be literals")
        try:
            os.write(req_w, req.encode("utf-8", "surrogatepass") + b"\n")
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
try:
    os.kill(child, 9)
except OSError:
    pass
os.waitpid(child, 0)
print(repr({"nonce": job["nonce"], "passed": passed, "total": len(job["tests"]), "failures": failures[:20]}))
"""


def extract_program(text: str) -> tuple[str, bool]:
    blocks = re.findall(r"```(?:python)?\n(.*?)```", text, flags=re.DOTALL)
    return (blocks[-1], True) if blocks else (text, False)


def read_verdict(stdout: str, nonce: str, total: int) -> int | None:
    """Tests passed according to the harness's verdict line carrying this call's nonce, or None."""
    for line in reversed(stdout.splitlines()):
        try:
            verdict = ast.literal_eval(line)
        except (ValueError, SyntaxError, TypeError, MemoryError, RecursionError):
            continue
        if isinstance(verdict, dict) and verdict.get("nonce") == nonce and verdict.get("total") == total:
            passed = verdict.get("passed")
            return passed if isinstance(passed, int) and 0 <= passed <= total else None
    return None


class CodeTestsGrader:
    revision = "code-tests-harness-v2"
    components = ("all_passed", "pass_ratio", "format_code_block", "sandbox_error")
    uses_sandbox = True
    """Runs model-written code: the grader service checks the sandbox at start-up."""

    def __init__(self, limits: sandbox.SandboxLimits | None = None) -> None:
        self.limits = limits or sandbox.SandboxLimits(wall_s=10.0, cpu_s=5)

    def grade(self, sample: Sample, task: dict[str, Any]) -> Grade:
        tests = [str(t) for t in task["metadata"]["tests"]]
        program, fenced = extract_program(sample.text)
        nonce = secrets.token_hex(16)
        job = {"nonce": nonce, "tests": tests, "program": program, "budget_s": self.limits.wall_s * 0.8}
        res = sandbox.run_code(HARNESS, stdin=repr(job), limits=self.limits)
        if res.subclass == "setup":  # the sandbox, not the program: raised, so never a wrong answer
            raise sandbox.SandboxUnavailable(f"sandbox setup failed: {res.stderr[-300:]}")
        verdict = read_verdict(res.stdout, nonce, len(tests)) if res.status == sandbox.OK else None
        passed = verdict or 0
        ratio = passed / max(1, len(tests))
        components = {"all_passed": float(bool(tests) and passed == len(tests)), "pass_ratio": ratio,
                      "format_code_block": float(fenced), "sandbox_error": float(bool(res.subclass))}
        out = f"status={res.status} subclass={res.subclass} passed={passed}/{len(tests)}"
        return Grade(components["all_passed"], components, out, self.revision)
