"""The rollout hooks of sources that run their own agent or harness (envs/external_agent_source.py,
envs/verifiers_env.py: ``rollout_setup`` and ``rollout_episodes``, `trajmesh.plugins.SourcePlugin`):
the rollout process serves the OpenAI/Anthropic-compatible agent endpoint (rollout/agents/agent_endpoint.py),
and each sample's agent runs in the environment service (its ``RunAgent`` RPC, the source's
``environment_agents`` hook), in the environment's pod, against this sample's endpoint session:

::

    rollout ── open session <sid> ── RunAgent(task, base_url=<advertised endpoint>/sessions/<sid>/v1,
       │                                       api_key, model, budget_s) ──▶ environment service
       │                                             runs the user's agent / the verifiers harness
       │        every model call ◀── POST <base_url>/chat/completions ◀──┘ (recorded with its token
       │                                             ids, log-probs and versions by the session)
       ◀── RunAgentResponse(EOS / WALL_TIMEOUT / INFRA_FAILURE, answer) ── close session
       ▼
    session.trajectory(task): the sample's one trajectory, the answer as its ``final_answer``

An environment replica that fails before the agent made any call is retried on the next one (and
waited for, `rollout.environment_wait_s`, as a Reset is); one that fails mid-run ends the sample
INFRA_FAILURE with cause INFRA_ENVIRONMENT (the store refills its group). services/rollout.py calls
these hooks through the registry and names no source.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import socket
import time
from pathlib import Path
from typing import Any, Protocol

import grpc
from prometheus_client import Counter

from trajmesh.contract import Trajectory
from trajmesh.infra import free_port
from trajmesh.rollout.agents.agent_runner import AgentOutcome, AgentRunner
from trajmesh.rollout.agents.agent_session import HostedEnvironment
from trajmesh.rollout.agents.environment_replicas import sticky_call
from trajmesh.v1 import services_pb2, trajectory_pb2


class AgentHost(Protocol):
    """What the hooks may ask of the rollout process that runs them (services/rollout.py's
    `RolloutService` is one): its config, tokenizer, chat template, sampler and weight-load pause,
    its worker id, its environment service stubs, and three slots the hooks fill (the endpoint's
    server and serving task, closed by the service's stop, and the agent runner)."""

    cfg: Any
    envs: list[Any]
    tokenizer: Any
    chat: Any
    sampler: Any
    pause: Any
    worker_id: str
    agent_server: Any
    agent_serve_task: asyncio.Task[None] | None
    agents: Any

log = logging.getLogger("trajmesh.rollout")

RUN_AGENT_MARGIN_S = 30.0
"""How long past a sample's budget the rollout waits for the environment service's RunAgent answer
(the service ends the agent at the budget, then answers)."""

AGENT_ENV_FAILURES = Counter("trajmesh_rollout_agent_environment_failures_total",
                             "RunAgent calls the environment service failed (retried before the agent's first "
                             "model call, else the sample ends INFRA_FAILURE)", ["code"])
AGENT_SEGMENTED = Counter("trajmesh_rollout_agent_segmented_trajectories_total",
                          "External agents' trajectories holding several segments (each trained as its own row)")


def served_model_name(configured: str, model_path: str) -> str:
    """The name the endpoint serves the policy under: the configured one, else the model
    directory's (or hub id's) last component, never a path."""
    return configured or Path(model_path.rstrip("/")).name


def advertised_host(host: str, advertise: str = "") -> str:
    """The address the environment service reaches this process's endpoint at: `advertise` when
    set; for an endpoint listening on every interface, the pod's IP (``POD_IP``, set by the chart)
    or this host name's address; else the interface it listens on."""
    if advertise:
        return advertise
    if host in ("0.0.0.0", "::", ""):
        return os.environ.get("POD_IP") or socket.gethostbyname(socket.gethostname())
    return host


async def serve_endpoint(rollout: AgentHost, sources: list[Any]) -> None:
    """``rollout_setup``: the endpoint the agents call, generating with this rollout process's
    sampler (pauses for weight loads included); sets ``rollout.agent_server`` / ``agent_serve_task``
    (closed by `RolloutService.stop`) and ``rollout.agents``, the runner `run_episode` uses. The
    agents run in another process (the environment service, on a cluster another pod), so the
    endpoint always checks a key: the configured one, else a random one of this process's."""
    from trajmesh.rollout.agents.agent_endpoint import AgentEndpoint, serve

    if rollout.agents is not None:  # another source's setup already serves it
        return
    ecfg = rollout.cfg.rollout.agent_endpoint
    api_key = ecfg.api_key or os.urandom(16).hex()
    endpoint = AgentEndpoint(rollout.tokenizer, rollout.chat, rollout.sampler, rollout.pause,
                             model_name=served_model_name(ecfg.model_name, rollout.cfg.model.path),
                             default_max_tokens=ecfg.max_tokens, api_key=api_key)
    port = ecfg.port or free_port()
    rollout.agent_server, rollout.agent_serve_task = await serve(endpoint, ecfg.host, port)
    url = f"http://{advertised_host(ecfg.host, ecfg.advertise_host)}:{port}"
    rollout.agents = AgentRunner(endpoint, url, api_key=api_key)
    log.info("agent endpoint on %s:%d, reached at %s/sessions/<sid>/v1", ecfg.host, port, url)


async def run_in_environment(rollout: AgentHost, task: trajectory_pb2.Task, tid: str, base_url: str,
                             session: Any, budget_s: float) -> AgentOutcome:
    """The sample's agent run by the environment service (``RunAgent``) on the session's sticky
    replica. A replica that fails before the agent made a call (nothing of the sample exists yet)
    is retried on the next ones, and waited for with backoff for `rollout.environment_wait_s`; one
    that fails after is the sample's end: INFRA_FAILURE, cause INFRA_ENVIRONMENT."""
    agents = rollout.agents
    envs = list(rollout.envs)
    if not envs:
        return AgentOutcome(trajectory_pb2.INFRA_FAILURE, "", "no environment service to run the agent in "
                            "(infra.environment_addresses)", cause=trajectory_pb2.INFRA_ENVIRONMENT)
    req = services_pb2.RunAgentRequest(session_id=tid, task=task, base_url=base_url, api_key=agents.api_key,
                                       model=agents.endpoint.model_name, budget_s=budget_s)

    def failed(exc: grpc.aio.AioRpcError) -> bool:
        """Counted; the next replica only while the agent has not run (nothing of the sample exists)."""
        AGENT_ENV_FAILURES.labels(exc.code().name.lower()).inc()
        hosted = session.environment
        return not (session.calls or (hosted is not None and hosted.steps))

    try:
        got = await sticky_call(envs, tid, lambda stub: stub.RunAgent(req, timeout=budget_s + RUN_AGENT_MARGIN_S),
                                wait_s=rollout.cfg.rollout.environment_wait_s, failed=failed)
    except grpc.aio.AioRpcError as exc:
        if exc.code() == grpc.StatusCode.INVALID_ARGUMENT:
            raise  # a config error (no agent hook for this environment there), not infrastructure
        return AgentOutcome(trajectory_pb2.INFRA_FAILURE, "", f"environment service failed mid-run: {exc.code().name}",
                            cause=trajectory_pb2.INFRA_ENVIRONMENT)  # the agent ran: no retry
    if got is None:
        return AgentOutcome(trajectory_pb2.INFRA_FAILURE, "", "no environment replica answered RunAgent for "
                            f"{rollout.cfg.rollout.environment_wait_s:.0f}s", cause=trajectory_pb2.INFRA_ENVIRONMENT)
    reply = got[1]
    return AgentOutcome(reply.terminal_reason, reply.answer, reply.detail, environment_revision=reply.environment_revision)


async def run_episode(rollout: AgentHost, task: trajectory_pb2.Task, index: int) -> Trajectory:
    """``rollout_episodes`` of external agents and verifiers harnesses: one sample is one agent run
    in the environment service (`run_in_environment`) through its own endpoint session. The
    session's one trajectory, every segment in it (one per sample keeps the gate's accounting; the
    learner trains each segment as a row). No LLM call: INFRA_FAILURE."""
    agents = rollout.agents
    assert isinstance(agents, AgentRunner), f"{task.environment} task without the agent endpoint"
    meta = json.loads(task.metadata_json or "{}")
    tid = f"{task.task_id}-{index}"
    sid = f"{tid}-{os.urandom(4).hex()}"
    budget_s = float(meta.get("budget_s", 300.0))

    async def in_environment(base_url: str, session: Any) -> AgentOutcome:
        return await run_in_environment(rollout, task, sid, base_url, session, budget_s)

    hosted: HostedEnvironment | None = None
    if meta.get("agent_environment"):  # the task's own environment, hosted by the environment service
        hosted = await hosted_in_environment(rollout, task, sid, str(meta["agent_environment"]))
        if hosted is None:
            return _no_call(rollout, task, tid, trajectory_pb2.INFRA_ENVIRONMENT,
                            "no environment replica answered the hosted environment's Reset")
    try:
        trajs, outcome = await agents.run_session(task, in_environment, session_id=sid,
                                                  rollout_worker=rollout.worker_id, hosted=hosted)
    finally:
        if hosted is not None:
            await _close_hosted(hosted)
    if outcome.detail:
        log.warning("agent on %s: %s", tid, outcome.detail[-500:])
    if not trajs:  # the agent never called the model: nothing to train, never rewarded
        return _no_call(rollout, task, tid, outcome.cause if outcome.terminal_reason == trajectory_pb2.INFRA_FAILURE
                        else trajectory_pb2.INFRA_AGENT, outcome.detail[-500:] or "the agent made no model call")
    if outcome.segments > 1:
        AGENT_SEGMENTED.inc()
    (traj,) = trajs
    traj.pb.trajectory_id = tid
    traj.pb.timing.rollout_seconds = outcome.seconds
    if outcome.environment_revision:
        traj.pb.environment_revision = outcome.environment_revision
    return traj


def _no_call(rollout: AgentHost, task: trajectory_pb2.Task, tid: str, cause: int, detail: str) -> Trajectory:
    """A sample with no model call: its prompt alone, ended INFRA_FAILURE (never trained or rewarded)."""
    traj = Trajectory.new(task, trajectory_id=tid, rollout_worker=rollout.worker_id, created_unix_seconds=time.time())
    traj.append_prompt(rollout.tokenizer.encode(task.prompt))
    traj.fail_infra(cause, detail)  # type: ignore[arg-type]
    return traj


async def hosted_in_environment(rollout: AgentHost, task: trajectory_pb2.Task, sid: str,
                                kind: str) -> HostedEnvironment | None:
    """The task's hosted environment (``metadata.agent_environment``, e.g. workplace) reset in the
    environment service, on the session's sticky replica (the next ones on an infrastructure
    error, waited for as an episode's Reset is: `rollout.environment_wait_s`): the agent's
    ``/env/step`` calls become that session's Steps. None: no replica answered."""
    from trajmesh.rollout.agents.agent_session import HostedEnvironment

    req = services_pb2.ResetRequest(session_id=f"{sid}-env", seed=int(task.seed))
    req.task.CopyFrom(task)
    req.task.environment = kind

    def failed(exc: grpc.aio.AioRpcError) -> bool:
        AGENT_ENV_FAILURES.labels(exc.code().name.lower()).inc()
        return True

    got = await sticky_call(list(rollout.envs), sid, lambda stub: stub.Reset(req, timeout=60.0),
                            wait_s=rollout.cfg.rollout.environment_wait_s, failed=failed)
    if got is None:
        return None
    stub, reset = got
    return HostedEnvironment(None, [reset.state_hash], remote=(stub, req.session_id))


async def _close_hosted(hosted: HostedEnvironment) -> None:
    stub, session_id = hosted.remote
    try:
        await stub.Close(services_pb2.CloseRequest(session_id=session_id), timeout=5.0)
    except grpc.aio.AioRpcError as exc:  # its TTL ends it
        AGENT_ENV_FAILURES.labels(exc.code().name.lower()).inc()
