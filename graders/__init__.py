"""trajmesh.graders: verifiers keyed by the task's `grader` (see `GRADERS`)."""

from __future__ import annotations

from typing import Any

from trajmesh.graders.base import Grade, Grader, Sample
from trajmesh.graders.code import CodeTestsGrader
from trajmesh.graders.external_agent import ExternalAgentGrader
from trajmesh.graders.math import MathGrader
from trajmesh.graders.reasoning_gym import ReasoningGymGrader
from trajmesh.graders.search import SearchGrader
from trajmesh.graders.workplace import WorkplaceGrader

GRADERS: dict[str, type] = {
    "reasoning_gym": ReasoningGymGrader, "math": MathGrader, "code": CodeTestsGrader,
    "search": SearchGrader, "workplace": WorkplaceGrader, "external_agent": ExternalAgentGrader,
}


def grader_kind(task: dict[str, Any]) -> str:
    """Dispatch key: the task's `metadata.grader`; chain_sum tasks predate it (reasoning_gym)."""
    return str(task.get("metadata", {}).get("grader") or "reasoning_gym")


def make_grader(kind: str) -> Grader:
    try:
        return GRADERS[kind]()  # type: ignore[no-any-return]
    except KeyError:
        raise ValueError(f"unknown grader {kind!r}; available: {sorted(GRADERS)}") from None


__all__ = ["GRADERS", "Grade", "Grader", "Sample", "grader_kind", "make_grader"]
