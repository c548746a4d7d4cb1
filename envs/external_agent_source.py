"""The ``external_agent`` task source's plug-in entry (`trajmesh.plugins`): reasoning-gym tasks that a
user's own agent solves through the rollout's agent endpoint (rollout/agents/agent_runner.py runs the agent,
in the environment service: its ``RunAgent``, the plug-in's ``environment_agents``; graders/external_agent.py
scores its answer; rollout/agents/agent_episodes.py holds the rollout hooks the plug-in names: serve the
endpoint, hand one agent run per sample to the environment service). No torch."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field

from trajmesh.config import SourceConfig
from trajmesh.envs.external_agent import ExternalAgentEnv
from trajmesh.plugins import SourcePlugin


class ExternalAgentSource(SourceConfig):
    """A user's own agent solves reasoning-gym tasks through the rollout's OpenAI/Anthropic-compatible
    endpoint (rollout/agents/agent_runner.py, docs/AGENTS.md); its LLM calls become the trajectories."""

    type: Literal["external_agent"] = "external_agent"
    """Selects this source: tasks solved by an external agent through the agent endpoint."""
    name: str = "external_agent"
    """Source name recorded on every task and trajectory (unique across sources)."""
    agent: str
    """``package.module:function`` called as ``function(task, base_url, api_key)`` in its own
    process (returns the final answer), or the URL of an HTTP agent (POST {task, base_url, api_key},
    answers {"answer": ...})."""
    python_path: list[str] = Field(default_factory=list)
    """Folders prepended to the agent process's PYTHONPATH (where its module lives)."""
    budget_s: float = Field(300.0, gt=0)
    """Wall-clock budget of one agent run; past it the run ends as WALL_TIMEOUT."""
    family: str = "chain_sum"
    """reasoning-gym task family the agent is given (graded by its own score_answer)."""
    knobs: dict[str, Any] = Field(default_factory=dict)
    """Difficulty knobs passed to the family's generator."""
    tasks_from: Literal["reasoning_gym", "workplace"] = "reasoning_gym"
    """Where the agent's tasks come from: ``reasoning_gym`` (the ``family``'s tasks; the answer the
    agent returns is graded by the family's scorer) or ``workplace`` (workplace tasks; the agent acts
    on a workplace environment the runner hosts for its session, ``POST <base_url without /v1>/env/step``,
    and the run is graded by that environment's final state)."""


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
    rollout_setup="trajmesh.rollout.agents.agent_episodes:serve_endpoint",
    rollout_episodes={"external_agent": "trajmesh.rollout.agents.agent_episodes:run_episode"},
    environment_agents={"external_agent": "trajmesh.rollout.agents.agent_runner:external_agent_play"},
    description="a user's own agent solves reasoning-gym or workplace tasks through the rollout's agent endpoint")
