"""Math with a Python tool (ReTool / rStar2-Agent style, survey §3.8, §5.2). No torch.

The policy writes ``<code>...</code>`` (or, in the model's native format, a ``python`` tool call
``<tool_call>{"name": "python", "arguments": {"code": ...}}</tool_call>``, see envs/base.py); the
environment runs it in the sandbox (`trajmesh.sandbox`) and answers ``<output>...</output>`` (the
plain output for a native call; an observation either way: loss mask 0). A turn
without a code block is the final answer (``<answer>...</answer>``), which the math grader scores;
tool use itself earns nothing. Budgets come from the task (`tool`): calls per episode, per-call
timeout and output bytes. Resource limits (timeout, memory, output) come back as an error
observation; containment violations (network, writes outside /tmp, secrets, signals, fork bombs,
orphans) end the episode as SANDBOX_ERROR. A sandbox that could not be set up (subclass `setup`:
no user namespaces, no free uid, a full disk) ends it as INFRA_FAILURE: the policy did nothing
wrong, so training drops the episode and held-out evaluation counts it apart from the answers.

Tasks are generated here from a seed (`make_tasks`): integer / fraction problems whose answers
`math-verify` can check.
"""

from __future__ import annotations

import hashlib
import random
import time
from fractions import Fraction
from typing import Any, Literal

from pydantic import Field

from trajmesh import sandbox
from trajmesh.config import ToolSourceConfig
from trajmesh.envs.base import (
    SingleToolEnv,
    StepResult,
    function_schemas,
    native_instruction,
)
from trajmesh.plugins import SourcePlugin


class MathToolSource(ToolSourceConfig):
    """Math problems solved with a sandboxed Python tool (envs/math_tool.py, graded by math-verify)."""

    type: Literal["math_tool"] = "math_tool"
    """Selects this source: math with a sandboxed Python tool."""
    name: str = "math_tool"
    """Source name recorded on every task and trajectory (unique across sources)."""
    difficulty: int = Field(1, ge=1, le=4)
    """Operand size: about 10**(1+difficulty)."""
    max_tool_calls: int = Field(3, ge=0)
    """Sandboxed code runs per episode; more are answered 'tool budget exhausted'."""
    call_timeout_s: float = Field(5.0, gt=0)
    """Wall-clock deadline of one code run (CPU limit 0.8x)."""
    max_output_bytes: int = Field(1024, gt=0)
    """Tool output returned to the policy per call."""


CONTAINMENT = ("network", "fs_write", "secret_access", "signal", "process_limit", "orphan_process")
"""Sandbox subclasses that end the episode as SANDBOX_ERROR (`setup` ends it as INFRA_FAILURE; the
rest are returned to the policy as tool errors)."""
INSTRUCTION = "Run python with <code>...</code>; reply <answer>x</answer>.\n"
TOOLS: dict[str, dict[str, Any]] = {
    "python": {"description": "Run a Python program in a sandbox; returns what it prints (stdout, or the error).",
               "parameters": {"type": "object", "required": ["code"],
                              "properties": {"code": {"type": "string", "description": "The program."}}}},
}
NATIVE_INSTRUCTION = native_instruction(TOOLS, "reply <answer>x</answer>.")
"""The instruction line of a task whose source has ``tool_format: native``."""


class MathToolEnv(SingleToolEnv):
    revision = "math_tool-v1"
    uses_sandbox = True
    """Runs model-written code: the environment service checks the sandbox at start-up."""
    config_keys = ("max_tool_calls", "call_timeout_s", "max_output_bytes")
    invalid_actions = ("schema", "tool_budget")
    """`info.invalid_action` reasons its steps report (the environment service pre-creates their series)."""

    tool, argument, tool_tag, output_tag, action_type = "python", "code", "code", "output", "CODE"
    budget_key, budget_reason, budget_text = "max_tool_calls", "tool_budget", "tool budget exhausted"

    def settings(self, task: dict[str, Any]) -> dict[str, Any]:
        return {**tool_settings(), **task.get("metadata", {}).get("tool", {})}

    def call(self, code: str, h: str, *, native: bool) -> StepResult:
        """Runs `code` in the sandbox; the answer is wrapped in ``<output>`` unless it goes back as a
        native tool message (the chat template wraps that)."""
        wall = float(self.cfg["call_timeout_s"])
        limits = sandbox.SandboxLimits(wall_s=wall, cpu_s=max(1, int(wall * 0.8)),
                                       output_bytes=int(self.cfg["max_output_bytes"]) * 4)
        t0 = time.perf_counter()
        res = sandbox.run_code(code, limits=limits)
        latency = time.perf_counter() - t0
        cap = int(self.cfg["max_output_bytes"])
        body = res.stdout if res.status == sandbox.OK else (res.stdout + res.stderr[-cap:])
        if res.subclass:
            body += f"\n[sandbox: {res.subclass}]"
        obs = body[:cap].rstrip("\n") if native else f"<output>\n{body[:cap]}\n</output>\n"
        status = {"": "ok" if res.ok else "error", "wall_timeout": "timeout", "cpu_time": "timeout"}.get(
            res.subclass, "sandbox_violation" if res.subclass else "error")
        info: dict[str, Any] = {
            "action_type": "CODE",
            "tool_call": {"name": "python", "request": code, "response": obs, "status": status,
                          "latency_s": latency, "sandbox_error": res.subclass, "native": native},
        }
        if res.subclass == "setup":
            info.update(terminal_reason="INFRA_FAILURE", sandbox_error=res.subclass)
            return StepResult(obs, True, h, info=info)
        if res.subclass in CONTAINMENT:
            info.update(terminal_reason="SANDBOX_ERROR", sandbox_error=res.subclass)
            return StepResult(obs, True, h, info=info)
        return StepResult(obs, False, h, info=info)


# --------------------------------------------------------------------------- tasks

def _count_primes_below(n: int) -> int:
    sieve = bytearray([1]) * max(n, 2)
    sieve[0:2] = b"\x00\x00"
    for k in range(2, int(n**0.5) + 1):
        if sieve[k]:
            sieve[k * k :: k] = bytearray(len(sieve[k * k :: k]))
    return sum(sieve)


def _problem(rng: random.Random, difficulty: int) -> tuple[str, str]:
    kind = rng.randrange(4)
    big = 10 ** (1 + difficulty)
    if kind == 0:
        a = rng.randrange(1, big)
        b = a + rng.randrange(1, big)
        return f"Sum of the integers from {a} to {b}?", str((a + b) * (b - a + 1) // 2)
    if kind == 1:
        a, e, m = rng.randrange(2, 50), rng.randrange(5, 20 * difficulty + 10), rng.randrange(7, big + 8)
        return f"{a}^{e} mod {m}?", str(pow(a, e, m))
    if kind == 2:
        n = rng.randrange(10, 20 * big)
        return f"How many primes are below {n}?", str(_count_primes_below(n))
    a, b, c, d = (rng.randrange(1, 12 * difficulty) for _ in range(4))
    f = Fraction(a, b + 1) + Fraction(c, d + 1)
    return f"{a}/{b + 1} + {c}/{d + 1} in lowest terms?", f"{f.numerator}/{f.denominator}" if f.denominator != 1 else str(f.numerator)


def make_tasks(seed: int, n: int, *, difficulty: int = 1, tool: dict[str, Any] | None = None,
               source: str = "math_tool", exclude: set[str] | None = None,
               tool_format: str = "tags") -> list[dict[str, Any]]:
    """``n`` distinct problems; each ``{prompt, answer, task_id, metadata}`` (metadata carries the
    budgets, and for ``tool_format="native"`` the tools' JSON schemas under ``tools``)."""
    rng = random.Random(f"math_tool|{seed}|{difficulty}")
    out: list[dict[str, Any]] = []
    seen = set(exclude or ())
    while len(out) < n:
        question, answer = _problem(rng, difficulty)
        if question in seen:
            if len(seen) > 50 * (n + 10):
                raise ValueError(f"cannot draw {n} distinct math_tool problems at difficulty {difficulty}")
            continue
        seen.add(question)
        prompt = (NATIVE_INSTRUCTION if tool_format == "native" else INSTRUCTION) + question
        tid = hashlib.sha256(f"{source}|{seed}|{prompt}".encode()).hexdigest()[:16]
        out.append({"prompt": prompt, "answer": answer, "task_id": tid,
                    "metadata": {"source": source, "grader": "math", "environment": "math_tool",
                                 "tool": {**tool_settings(), **(tool or {})}, "question": question,
                                 **({"tools": function_schemas(TOOLS)} if tool_format == "native" else {})}})
    return out


def tool_settings(src: MathToolSource | None = None) -> dict[str, Any]:
    """The tool budgets a task carries (``metadata.tool``), from the source's config (None: its defaults)."""
    src = src or MathToolSource()
    return {key: getattr(src, key) for key in MathToolEnv.config_keys}


def draw(src: MathToolSource, seed: int, n: int, exclude: set[str]) -> list[dict[str, Any]]:
    """The source's task generator (`trajmesh.plugins.SourcePlugin.draw`); ``exclude`` holds whole
    prompts, compared here by question (the instruction line depends on tool_format)."""
    return make_tasks(seed, n, difficulty=src.difficulty, tool=tool_settings(src), source=src.name,
                      exclude={p.split("\n", 1)[-1] for p in exclude}, tool_format=src.tool_format)


PLUGIN = SourcePlugin(
    type="math_tool", config=MathToolSource, draw=draw, environments={"math_tool": MathToolEnv},
    graders={"math": "trajmesh.graders.math:MathGrader"},
    description="math with a sandboxed Python tool, graded by math-verify")
