"""The ``external_agent`` source's rollout hooks, named by its plug-in (envs/external_agent_source.py:
``rollout_setup`` and ``rollout_episodes``, `trajmesh.plugins.SourcePlugin`): the rollout process
serves the OpenAI/Anthropic-compatible agent endpoint (rollout/agents/agent_endpoint.py) and runs the
user's agent once per sample against it (rollout/agents/agent_runner.py). services/rollout.py calls them
through the registry and names no source.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import time
from pathlib import Path
from typing import Any, Protocol

from prometheus_client import Counter

from trajmesh.contract import Trajectory
from trajmesh.infra import free_port
from trajmesh.rollout.agents.agent_runner import AgentRunner
from trajmesh.v1 import trajectory_pb2


class AgentHost(Protocol):
    """What the hooks may ask of the rollout process that runs them (services/rollout.py's
    `RolloutService` is one): its config, tokenizer, chat template, sampler and weight-load pause,
    its worker id, and three slots the hooks fill (the endpoint's server and serving task, closed by
    the service's stop, and the agent runner)."""

    cfg: Any
    tokenizer: Any
    chat: Any
    sampler: Any
    pause: Any
    worker_id: str
    agent_server: Any
    agent_serve_task: asyncio.Task[None] | None
    agents: Any

log = logging.getLogger("trajmesh.rollout")

AGENT_SEGMENTED = Counter("trajmesh_rollout_agent_segmented_trajectories_total",
                          "External agents' trajectories holding several segments (each trained as its own row)")


def served_model_name(configured: str, model_path: str) -> str:
    """The name the endpoint serves the policy under: the configured one, else the model
    directory's (or hub id's) last component, never a path."""
    return configured or Path(model_path.rstrip("/")).name


async def serve_endpoint(rollout: AgentHost, sources: list[Any]) -> None:
    """``rollout_setup``: the endpoint external agents call, generating with this rollout process's
    sampler (pauses for weight loads included); sets ``rollout.agent_server`` / ``agent_serve_task``
    (closed by `RolloutService.stop`) and ``rollout.agents``, the runner `run_episode` uses."""
    from trajmesh.rollout.agents.agent_endpoint import AgentEndpoint, serve

    ecfg = rollout.cfg.rollout.agent_endpoint
    endpoint = AgentEndpoint(rollout.tokenizer, rollout.chat, rollout.sampler, rollout.pause,
                             model_name=served_model_name(ecfg.model_name, rollout.cfg.model.path),
                             default_max_tokens=ecfg.max_tokens, api_key=ecfg.api_key)
    port = ecfg.port or free_port()
    rollout.agent_server, rollout.agent_serve_task = await serve(endpoint, ecfg.host, port)
    rollout.agents = AgentRunner(endpoint, f"http://{ecfg.host}:{port}", api_key=ecfg.api_key or "trajmesh")
    log.info("agent endpoint on http://%s:%d/sessions/<sid>/v1", ecfg.host, port)


async def run_episode(rollout: AgentHost, task: trajectory_pb2.Task, index: int) -> Trajectory:
    """``rollout_episodes["external_agent"]``: one sample of an external_agent task is the agent's run
    (rollout/agents/agent_runner.py). The session's one trajectory, every segment in it (one per sample
    keeps the gate's accounting; the learner trains each segment as a row). No LLM call: INFRA_FAILURE."""
    agents = rollout.agents
    assert isinstance(agents, AgentRunner), "external_agent task without the agent endpoint"
    meta = json.loads(task.metadata_json or "{}")
    tid = f"{task.task_id}-{index}"
    trajs, outcome = await agents.run(task, str(meta["agent"]), float(meta.get("budget_s", 300.0)),
                                      session_id=f"{tid}-{os.urandom(4).hex()}",
                                      rollout_worker=rollout.worker_id,
                                      python_path=list(meta.get("python_path") or []))
    if outcome.detail:
        log.warning("agent on %s: %s", tid, outcome.detail[-500:])
    if not trajs:
        traj = Trajectory.new(task, trajectory_id=tid, rollout_worker=rollout.worker_id,
                              created_unix_seconds=time.time())
        traj.append_prompt(rollout.tokenizer.encode(task.prompt))
        traj.fail_infra(trajectory_pb2.INFRA_AGENT)
        return traj
    if outcome.segments > 1:
        AGENT_SEGMENTED.inc()
    (traj,) = trajs
    traj.pb.trajectory_id = tid
    traj.pb.timing.rollout_seconds = outcome.seconds
    return traj
