"""The ``external_agent`` task source's plug-in entry (`trajmesh.plugins`): reasoning-gym tasks that a
user's own agent solves through the rollout's agent endpoint (envs/external_agent.py runs the agent,
graders/external_agent.py scores its answer). No torch."""

from __future__ import annotations

from typing import Any

from trajmesh.envs.external_agent import ExternalAgentEnv

from trajmesh.config import ExternalAgentSource
from trajmesh.plugins import SourcePlugin


def draw(src: ExternalAgentSource, seed: int, n: int, exclude: set[str]) -> list[dict[str, Any]]:
    """The source's task generator (`trajmesh.plugins.SourcePlugin.draw`): reasoning-gym (or
    workplace, ``tasks_from``) tasks that name the agent, its budget and how its run is graded
    (``answer_grader``; ``agent_environment``: the environment the runner hosts for the agent)."""
    agent = {"environment": "external_agent", "grader": "external_agent", "agent": src.agent,
             "budget_s": src.budget_s, "python_path": list(src.python_path)}
    if src.tasks_from == "workplace":
        from trajmesh.envs import workplace

        tasks = [t for t in workplace.make_tasks(seed, n, source=src.name, tool_format="native")
                 if t["prompt"] not in exclude]
        agent |= {"answer_grader": "workplace", "agent_environment": "workplace"}
    else:
        from trajmesh.envs import reasoning_gym

        tasks = reasoning_gym.make_tasks(src.family, seed, n, dict(src.knobs), source=src.name, exclude=exclude)
        agent |= {"answer_grader": "reasoning_gym"}
    return [{**t, "metadata": {**t["metadata"], **agent}} for t in tasks]


PLUGIN = SourcePlugin(
    type="external_agent", config=ExternalAgentSource, draw=draw,
    environments={"external_agent": ExternalAgentEnv},
    graders={"external_agent": "trajmesh.graders.external_agent:ExternalAgentGrader"},
    description="a user's own agent solves reasoning-gym or workplace tasks through the rollout's agent endpoint")
