"""Grader for external agents' runs (envs/external_agent.py): the final answer, never a timeout (no torch).

An agent's final answer is its model's last message in the typical loop (examples/openai_agent.py
returns it), so the final sampled turn is scored with the task family's own scorer — not the
concatenation of every turn, which holds tool calls. A run that did not end EOS (WALL_TIMEOUT:
budget exceeded; INFRA_FAILURE never reaches a grader) scores 0 whatever its text says.
"""

from __future__ import annotations

from typing import Any

from trajmesh.graders.base import Grade, Sample
from trajmesh.graders.reasoning_gym import ReasoningGymGrader


class ExternalAgentGrader:
    """The family's scorer on the final turn; 0 for a run that did not finish."""

    revision = "external_agent-final_turn-v1"
    components = ("correct", "finished")

    def grade(self, sample: Sample, task: dict[str, Any]) -> Grade:
        if sample.terminal_reason != "EOS":
            return Grade(0.0, {"correct": 0.0, "finished": 0.0},
                         f"not scored: the agent run ended {sample.terminal_reason}", self.revision)
        final = sample.turns[-1] if sample.turns else sample.text
        inner = ReasoningGymGrader().grade(Sample(final, [final], sample.ended_with_eos), task)
        return Grade(inner.reward, {"correct": inner.components["correct"], "finished": 1.0},
                     inner.verifier_output, self.revision)
