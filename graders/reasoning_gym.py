"""Grader for reasoning-gym task families: the family's own `score_answer` (no torch)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Grade:
    reward: float
    components: dict[str, float]
    verifier_output: str
    revision: str


class ReasoningGymGrader:
    """Scores the decoded response with the task family's scorer; reward = correctness."""

    revision = "reasoning_gym-score_answer-v1"

    def grade(self, response_text: str, task: dict[str, Any], *, ended_with_eos: bool) -> Grade:
        family = task.get("metadata", {}).get("source", "")
        if family.endswith("chain_sum"):
            from trajmesh.envs import chain_sum

            correct = chain_sum.score(response_text, task)
        else:
            raise ValueError(f"no grader for task source {family!r}")
        components = {"correct": float(correct), "format_eos": 1.0 if ended_with_eos else 0.0}
        return Grade(float(correct), components, f"answer={response_text.strip()!r} expected={task['answer']!r}",
                     self.revision)
