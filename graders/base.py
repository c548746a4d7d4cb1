"""The grader interface and the registry keyed by the task's `grader` (no torch).

A grader sees what the policy sampled (all turns and each turn alone), the episode's state hashes
and terminal reason, and the task record; it returns raw reward components, the scalar, its raw
output and its revision. `audit` holds metamorphic-audit results: reported as metrics and in the
verifier output, never part of the reward.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol


@dataclass(frozen=True)
class Sample:
    text: str
    """Every sampled token decoded, turns concatenated."""
    turns: list[str] = field(default_factory=list)
    """Sampled text of each turn (the action log a stateful grader replays)."""
    ended_with_eos: bool = False
    state_hashes: list[str] = field(default_factory=list)
    terminal_reason: str = "EOS"
    final_answer: str | None = None
    """The answer an external agent returned (``Trajectory.final_answer``; rollout/agents/agent_runner.py),
    None for the project's own agent loop, whose answer is the sampled text."""


@dataclass(frozen=True)
class Grade:
    reward: float
    components: dict[str, float]
    verifier_output: str
    revision: str
    audit: dict[str, float] = field(default_factory=dict)
    """Metamorphic audit: {"<family>_invariant": 1.0 | 0.0}; never used as reward."""


class Grader(Protocol):
    revision: str

    def grade(self, sample: Sample, task: dict[str, Any]) -> Grade: ...


class UnparseableAnswer(ValueError):
    """Raised by a grader whose scorer cannot read the model's answer: the sample scores 0 with a
    ``parse_error`` component (`grade_sample`), never an infrastructure failure."""


PARSE_ERROR = "parse_error"
"""The reward component of a sample whose answer the scorer could not read (1.0)."""


def grade_sample(grader: Grader, sample: Sample, task: dict[str, Any]) -> Grade:
    """``grader.grade(sample, task)``, with the line between the model's output and a broken grader:

    - `UnparseableAnswer`: reward 0, components ``{"parse_error": 1.0}``;
    - any other exception: the same grader grades the task's gold answer (``task["answer"]``) as the
      sample. If that succeeds the scorer is sound and raised on what the model wrote (a parse error,
      reward 0); if the gold answer raises too, or the task has none, the original exception
      propagates (the grader service records an infrastructure failure).
    """
    try:
        return grader.grade(sample, task)
    except UnparseableAnswer as exc:
        return _parse_error(grader, exc)
    except Exception as exc:
        gold = str(task.get("answer", ""))
        if gold.strip() in ("", "None"):
            raise
        probe = Sample(gold, [gold], True, list(sample.state_hashes), "EOS",
                       gold if sample.final_answer is not None else None)
        try:
            grader.grade(probe, task)
        except Exception:
            raise exc from None
        return _parse_error(grader, exc)


def _parse_error(grader: Grader, exc: BaseException) -> Grade:
    cause = exc.__cause__ if isinstance(exc, UnparseableAnswer) and exc.__cause__ is not None else exc
    return Grade(0.0, {PARSE_ERROR: 1.0}, f"parse error: {type(cause).__name__}: {cause}"[:500], grader.revision)
