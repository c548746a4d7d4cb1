"""Grader for reasoning-gym task families: the family's own `score_answer` (no torch)."""

from __future__ import annotations

from typing import Any

from trajmesh.graders.base import Grade, Sample


class ReasoningGymGrader:
    """Scores the decoded response with the task family's scorer; reward = correctness."""

    revision = "reasoning_gym-score_answer-v2"
    components = ("correct", "format_eos")

    def grade(self, sample: Sample | str, task: dict[str, Any], *, ended_with_eos: bool | None = None) -> Grade:
        if isinstance(sample, str):
            sample = Sample(sample, [sample], bool(ended_with_eos))
        meta = task.get("metadata", {})
        if str(meta.get("source", "")).endswith("chain_sum"):
            from trajmesh.envs import chain_sum

            correct = chain_sum.score(sample.text, task)
        elif "family" in meta:
            from trajmesh.envs import reasoning_gym

            correct = reasoning_gym.score(sample.text, task)
        else:
            raise ValueError(f"no reasoning-gym family on task source {meta.get('source')!r}")
        components = {"correct": float(correct), "format_eos": 1.0 if sample.ended_with_eos else 0.0}
        return Grade(float(correct), components,
                     f"answer={sample.text.strip()!r} expected={task['answer']!r}", self.revision)
