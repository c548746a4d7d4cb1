"""The environment registry keyed by the task's `environment` (config `type`). No torch."""

from __future__ import annotations

from trajmesh.envs.base import SingleAnswerEnv, make_environment
from trajmesh.envs.external_agent import ExternalAgentEnv
from trajmesh.envs.math_tool import MathToolEnv
from trajmesh.envs.search import SearchEnv
from trajmesh.envs.workplace import WorkplaceEnv

ENVIRONMENTS: dict[str, type] = {
    "chain_sum": SingleAnswerEnv, "single_answer": SingleAnswerEnv, "reasoning_gym": SingleAnswerEnv,
    "math_tool": MathToolEnv, "workplace": WorkplaceEnv, "search": SearchEnv,
    "external_agent": ExternalAgentEnv,
}

__all__ = ["ENVIRONMENTS", "make_environment"]
