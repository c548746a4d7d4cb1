"""Math equivalence with `math-verify`, a format check, and a metamorphic audit (no torch).

The final answer is the last ``<answer>`` block (else the last ``\\boxed{}``); only it is scored:
code and tool output earn nothing. The audit (survey §8.3) renames variables consistently in the
gold and the answer (x→u, y→v, ...) and re-verifies: a verifier whose verdict changes under an
isomorphic renaming is inconsistent. Disagreements are counted, never rewarded.
"""

from __future__ import annotations

import re
from typing import Any

from trajmesh.envs.base import last_tag
from trajmesh.graders.base import Grade, Sample
from trajmesh.tool_calls import parse_tool_calls

RENAME = {"x": "u", "y": "v", "z": "w", "n": "m", "a": "p", "b": "q"}


def extract_answer(text: str) -> str | None:
    ans = last_tag(text, "answer")
    if ans is not None:
        return ans
    boxed = re.findall(r"\\boxed\{([^{}]*)\}", text)
    return boxed[-1] if boxed else None


def equivalent(gold: str, answer: str) -> bool:
    from math_verify import parse, verify

    return bool(verify(parse(f"${gold}$"), parse(f"${answer}$")))


def rename(expr: str) -> str:
    """Consistent renaming of single-letter variables (words and LaTeX commands untouched)."""
    return re.sub(r"(?<![A-Za-z\\])([a-z])(?![A-Za-z])", lambda m: RENAME.get(m.group(1), m.group(1)), expr)


class MathGrader:
    revision = "math-verify-0.9.0-v1"
    components = ("correct", "format_answer", "tool_calls")

    def grade(self, sample: Sample, task: dict[str, Any]) -> Grade:
        answer = extract_answer(sample.text)
        gold = str(task["answer"])
        correct = answer is not None and equivalent(gold, answer)
        audit: dict[str, float] = {}
        if answer is not None:
            audit["math_rename_invariant"] = float(equivalent(rename(gold), rename(answer)) == correct)
        components = {"correct": float(correct), "format_answer": float(answer is not None),
                      "tool_calls": float(sample.text.count("<code>") + sum(
                          c.name == "python" for c in parse_tool_calls(sample.text)[1]))}
        return Grade(float(correct), components, f"answer={answer!r} expected={gold!r}", self.revision, audit)
