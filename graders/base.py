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
    """The answer an external agent returned (``Trajectory.final_answer``; rollout/agent_runner.py),
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
