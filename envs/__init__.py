"""Task sources and their environments (no torch), each registered as a plug-in.

    base.py                  the environment interface; environments are looked up by key
    chain_sum.py             the demo's task source (reasoning-gym's chain_sum, compact)
    reasoning_gym.py         any reasoning-gym family by name
    math_tool.py             math with a Python tool (runs in the sandbox)
    search.py                local BM25 search                 workplace.py a stateful SQLite workplace
    gym_env.py               Gymnasium-style text environments by import path
    verifiers_env.py         a verifiers taskset
    external_agent.py        tasks a user's own agent solves ─ external_agent_source.py their source
    open_ended.py            open-ended prompts, no gold answer and no program verifier: the judge scores them

Each source module ends with a `trajmesh.plugins.SourcePlugin` (its graders and rollout hooks named
by "module:attr"). Imports: the core only.
"""
