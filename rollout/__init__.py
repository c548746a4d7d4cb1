"""The rollout side of the mesh: engines that sample, and agents that play episodes with them.

- `trajmesh.rollout.engines`: every engine and what speaks to one (the torch engine's server and
  sampler, vLLM, SGLang's client and GPU check, the synthetic engine, the distillation teacher, the
  sampling turn that survives an engine restart). Its ``__init__`` holds the engine factories.
- `trajmesh.rollout.agents`: episodes (the token layout, the model's chat format) and the agent
  loops that produce them (the OpenAI/Anthropic-compatible agent endpoint, its sessions and runner,
  the hooks of the external-agent and verifiers sources).

The rollout service (services/rollout.py) wires the two. Imports: trajmesh's core and each other
(agents use engines, never the reverse); never the services or the learner.
"""
