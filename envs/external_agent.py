"""The ``external_agent`` environment: the registry entry of tasks a user's own agent solves
through the rollout's agent endpoint. The agent runs itself (rollout/agents/agent_runner.py starts it and
turns its calls into one trajectory); graders/external_agent.py scores its answer. No torch here."""

from __future__ import annotations

from trajmesh.envs.base import SingleAnswerEnv


class ExternalAgentEnv(SingleAnswerEnv):
    """The registry entry of ``external_agent`` tasks. Rollout never steps it (the agent runs its
    own tools and talks to the endpoint); held-out evaluation serves the prompt as one answer."""

    revision = "external_agent-v1"
