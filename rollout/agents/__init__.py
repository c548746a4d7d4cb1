"""Agents and episodes: what the rollout plays with an engine, and the tokens it keeps.

::

    episode               the token layout of one episode (rollout service and held-out evaluation)
    chat_format           the model's own chat format for the agent loop (no torch)
    agent_endpoint        an OpenAI/Anthropic-compatible endpoint turning an agent's calls into
                          trajectories ─ agent_session (one agent's calls, with the engine's tokens),
                          agent_runner (runs a user's agent on a task through it)
    agent_episodes        the rollout hooks of sources that run their own agent (external agents,
                          verifiers): serve the endpoint, run each sample's agent in the
                          environment service (its RunAgent)
    environment_replicas  one call on a session's sticky environment replica (Reset, RunAgent),
                          the next replicas on an infrastructure error, backoff while none answers
    verifiers_episodes    the ``verifiers`` source's agent hook (run in the environment service)

Imports: trajmesh's core and `trajmesh.rollout.engines`.
"""
