"""trajmesh.graders: verifiers keyed by the task's `grader` kind.

    base.py            the grader interface (Grade, Sample)
    reasoning_gym.py   reasoning-gym's own score_answer      math.py math answers (math-verify)
    code.py            model-written programs against tests, in the sandbox
    search.py          search answers                       workplace.py the workplace's end state
    gym.py             a Gymnasium environment's own reward  verifiers.py a verifiers rubric
    external_agent.py  what a user's own agent returned, graded by the grader it delegates to
    judge.py           a judge model's verdict (config `judge`, not a task's kind: the grader
                       service asks it for the sources `judge.sources` names); judge_groups.py
                       parks a pairwise group's members in Redis until the group is whole

Which kinds exist is the plug-in registry's business (`trajmesh.plugins`: each task source names its
graders; `STANDALONE_GRADERS` the rest); grader modules are imported on first use. Imports: the core
and envs/.
"""

from __future__ import annotations

from typing import Any

from trajmesh import plugins
from trajmesh.graders.base import PARSE_ERROR, Grade, Grader, Sample, UnparseableAnswer, grade_sample


def grader_kind(task: dict[str, Any]) -> str:
    """Dispatch key: the task's `metadata.grader`; chain_sum tasks predate it (reasoning_gym)."""
    return str(task.get("metadata", {}).get("grader") or "reasoning_gym")


def make_grader(kind: str) -> Grader:
    """A grader by kind (`trajmesh.plugins.grader_class`); an unknown kind names the registered ones."""
    return plugins.grader_class(kind)()


__all__ = ["PARSE_ERROR", "Grade", "Grader", "Sample", "UnparseableAnswer", "grade_sample", "grader_kind", "make_grader"]
