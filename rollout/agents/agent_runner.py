"""Runs a user's own agent on a task through the agent endpoint and turns its calls into trajectories.

::

    task ──▶ AgentRunner.run_session ── open session <sid> on the endpoint
               │ play(base_url): where the agent runs. In the mesh, the environment service's RunAgent
               │   (services/environment.py, the source's `environment_agents` hook: `play_agent` for an
               │   external agent), in its pod; `AgentRunner.run`: this process's children.
               │ agent = "package.module:function"  → its own process:
               │     function(task: dict, base_url: str, api_key: str) -> str   (the final answer)
               │ agent = "http(s)://..."            → POST {task, base_url, api_key}, answer {"answer": str}
               │ wall-clock budget: past it the process is killed (by pid) / the request dropped
               ▼
             close session ── session.trajectory(task): ONE trajectory, every segment of the session
                            in it (``sequence_starts``: the learner trains each as its own row), finished as
               EOS          the agent returned an answer (a string): recorded on every trajectory
                            as ``final_answer``, which the grader scores (graders/external_agent.py)
               WALL_TIMEOUT the budget ran out (truncated; its calls so far are kept, never rewarded
                            as an answer: the final answer is empty)
               INFRA_FAILURE the agent crashed, returned nothing (None) or garbage, or its HTTP
                            service failed (INFRA_AGENT); the environment service running it
                            failed (INFRA_ENVIRONMENT)
                            (forwarded ungraded by the grader, never trained on a reward)

``base_url`` is the endpoint's ``/sessions/<sid>/v1``: the official ``openai`` client takes it as
``base_url``; the ``anthropic`` client takes it without the trailing ``/v1``. No torch here.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib
import json
import os
import signal
import sys
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import aiohttp

from trajmesh.contract import Trajectory
from trajmesh.v1 import trajectory_pb2

if TYPE_CHECKING:
    from trajmesh.rollout.agents.agent_session import HostedEnvironment


@dataclass
class AgentOutcome:
    """How one agent run ended."""

    terminal_reason: int
    """trajectory_pb2.TerminalReason: EOS, WALL_TIMEOUT or INFRA_FAILURE."""
    answer: str
    """The agent's final answer ("" unless it returned one; only EOS runs have one)."""
    detail: str = ""
    """Why it failed (exit status, stderr tail, HTTP error)."""
    seconds: float = 0.0
    segments: int = 0
    """Segments (sequences) in the run's trajectory: > 1 where the agent changed history, branched
    or asked for ``n`` > 1 samples (0: no LLM call, no trajectory)."""
    cause: int = trajectory_pb2.INFRA_AGENT
    """trajectory_pb2.InfraCause of an INFRA_FAILURE: the agent's (INFRA_AGENT) unless the environment
    service running it failed (INFRA_ENVIRONMENT)."""
    environment_revision: str = ""
    """The revision of the environment that ran it (the environment service's answer; "" here)."""


HIDDEN_METADATA = ("solution", "answer", "entry")
"""Task metadata the agent never sees (reference solutions and answers)."""


def task_dict(task: trajectory_pb2.Task, model: str) -> dict[str, Any]:
    """What the agent gets: the task without its reference answer or solution, and ``model``, the
    name its calls must give (the endpoint's served model)."""
    meta = {k: v for k, v in json.loads(task.metadata_json or "{}").items() if k not in HIDDEN_METADATA}
    return {"task_id": task.task_id, "source": task.source, "prompt": task.prompt, "metadata": meta, "model": model}


def hosted_environment(task: trajectory_pb2.Task) -> HostedEnvironment | None:
    """The task's own environment, reset on it, when its metadata names one (``agent_environment``:
    the external_agent source's workplace tasks); the agent acts on it through the endpoint."""
    meta = json.loads(task.metadata_json or "{}")
    name = meta.get("agent_environment")
    if not name:
        return None
    from trajmesh import plugins  # the registry imports this module's source entry
    from trajmesh.rollout.agents.agent_session import HostedEnvironment

    env = plugins.environment_class(str(name))()
    _, state = env.reset({"prompt": task.prompt, "answer": task.answer, "metadata": meta}, int(task.seed))
    return HostedEnvironment(env, [state])


@dataclass
class AgentCall:
    """One sample's agent run as the environment service's ``RunAgent`` hands it to a source's hook
    (`SourcePlugin.environment_agents`)."""

    task: trajectory_pb2.Task
    base_url: str
    """The rollout's endpoint session (``.../sessions/<sid>/v1``): every model call goes there."""
    api_key: str
    model: str
    """The name the endpoint serves the policy under (calls must name it)."""
    budget_s: float
    resources: contextlib.AsyncExitStack = field(default_factory=contextlib.AsyncExitStack)
    """Closed when the environment service stops: what a hook keeps serving between calls."""
    cache: dict[str, Any] = field(default_factory=dict)
    """The environment service's own state for hooks, kept between calls (e.g. served harnesses)."""


Play = Callable[[str, Any], Awaitable[AgentOutcome]]
"""How one session's agent is run: ``play(base_url, session) -> AgentOutcome`` (`AgentRunner.run_session`)."""


async def play_agent(agent: str, task: trajectory_pb2.Task, model: str, base_url: str, api_key: str,
                     budget_s: float, python_path: list[str]) -> AgentOutcome:
    """Runs the user's `agent` ("module:function" in its own process, or an HTTP service) on `task`
    against `base_url` within `budget_s` (see the module docstring)."""
    if agent.startswith(("http://", "https://")):
        return await _http(agent, task_dict(task, model), base_url, api_key, budget_s)
    return await _process(agent, task_dict(task, model), base_url, api_key, budget_s, python_path)


async def external_agent_play(call: AgentCall) -> AgentOutcome:
    """``environment_agents["external_agent"]``: the task's agent (``metadata.agent``; its module
    folders ``metadata.python_path``), run in the environment service's process."""
    meta = json.loads(call.task.metadata_json or "{}")
    return await play_agent(str(meta["agent"]), call.task, call.model, call.base_url, call.api_key, call.budget_s,
                            list(meta.get("python_path") or []))


class AgentRunner:
    """Runs agents against an endpoint (``rollout/agents/agent_endpoint.py``) served at `endpoint_url`
    (the address the agents reach it at)."""

    def __init__(self, endpoint: Any, endpoint_url: str, *, api_key: str = "trajmesh",
                 python_path: list[str] | None = None) -> None:
        self.endpoint = endpoint
        self.endpoint_url = endpoint_url.rstrip("/")
        self.api_key = api_key
        self.python_path = list(python_path or [])
        """Folders prepended to the agent process's PYTHONPATH (where its module lives)."""

    async def run(self, task: trajectory_pb2.Task, agent: str, budget_s: float, *, session_id: str,
                  rollout_worker: str = "", python_path: list[str] | None = None
                  ) -> tuple[list[Trajectory], AgentOutcome]:
        """Runs `agent` on `task` in this process's children (`play_agent`): the session's one
        trajectory (none without an LLM call), finished with the outcome's reason. `python_path`:
        this run's extra agent module folders (before the runner's own)."""
        async def here(base_url: str, session: Any) -> AgentOutcome:
            return await play_agent(agent, task, self.endpoint.model_name, base_url, self.api_key, budget_s,
                                    [*(python_path or []), *self.python_path])

        return await self.run_session(task, here, session_id=session_id, rollout_worker=rollout_worker)

    async def run_session(self, task: trajectory_pb2.Task, play: Play, *, session_id: str,
                          rollout_worker: str = "", hosted: HostedEnvironment | None = None
                          ) -> tuple[list[Trajectory], AgentOutcome]:
        """Opens endpoint session `session_id`, awaits `play(base_url, session)` (wherever it runs
        the agent: here, or the environment service), closes the session and returns its one
        trajectory (none without an LLM call), finished with the outcome's reason. A held-out task
        (`task.evaluation`) samples at its own sampling, whatever the agent asks. The task's hosted
        environment: `hosted` (the environment service's, reset already), else one reset here
        (`hosted_environment`); a run whose hosted environment failed a step is the environment's
        infrastructure failure."""
        session = self.endpoint.open_session(session_id, forced=task.sampling if task.evaluation else None)
        session.environment = hosted if hosted is not None else hosted_environment(task)
        base_url = f"{self.endpoint_url}/sessions/{session_id}/v1"
        start = time.monotonic()
        try:
            outcome = await play(base_url, session)
        finally:
            self.endpoint.close_session(session_id)
        if session.environment is not None and session.environment.failed:
            outcome = AgentOutcome(trajectory_pb2.INFRA_FAILURE, "", session.environment.failed,
                                   cause=trajectory_pb2.INFRA_ENVIRONMENT)
        outcome.seconds = time.monotonic() - start
        whole = session.trajectory(task, trajectory_id=session_id, rollout_worker=rollout_worker)
        trajs = [whole] if whole is not None else []
        outcome.segments = len(session.segments())
        for traj in trajs:
            traj.finish(outcome.terminal_reason, truncated=outcome.terminal_reason == trajectory_pb2.WALL_TIMEOUT)
            if outcome.terminal_reason == trajectory_pb2.INFRA_FAILURE:
                traj.fail_infra(outcome.cause)
            if outcome.terminal_reason == trajectory_pb2.EOS:
                traj.pb.final_answer = outcome.answer  # what the grader scores
            if session.environment is not None:  # the hosted environment's states; the last one is graded
                traj.pb.state_hashes.extend(session.environment.state_hashes)
        return trajs, outcome


async def _process(entry: str, task: dict[str, Any], base_url: str, api_key: str, budget_s: float,
                   python_path: list[str]) -> AgentOutcome:
    payload = json.dumps({"entry": entry, "task": task, "base_url": base_url, "api_key": api_key})
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([*python_path, env.get("PYTHONPATH", "")]).strip(os.pathsep)
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "trajmesh.rollout.agents.agent_runner", stdin=asyncio.subprocess.PIPE,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE, start_new_session=True, env=env)
    try:
        out, err = await asyncio.wait_for(proc.communicate(payload.encode()), timeout=budget_s)
    except TimeoutError:
        _kill_group(proc.pid)
        await proc.wait()
        return AgentOutcome(trajectory_pb2.WALL_TIMEOUT, "", f"no answer within {budget_s}s")
    except BaseException:  # cancelled (the sample's deadline, the caller gone, a stop): the agent goes too
        _kill_group(proc.pid)
        raise
    if proc.returncode != 0:
        tail = err.decode(errors="replace")[-2000:]
        return AgentOutcome(trajectory_pb2.INFRA_FAILURE, "", f"agent exited {proc.returncode}: {tail}")
    try:
        answer = json.loads(out.decode().strip().splitlines()[-1])["answer"]
    except (ValueError, IndexError, KeyError, TypeError):
        return AgentOutcome(trajectory_pb2.INFRA_FAILURE, "", "agent printed no answer line")
    if answer is None:
        return AgentOutcome(trajectory_pb2.INFRA_FAILURE, "", "agent returned nothing (None)")
    return AgentOutcome(trajectory_pb2.EOS, str(answer))


async def _http(url: str, task: dict[str, Any], base_url: str, api_key: str, budget_s: float) -> AgentOutcome:
    body = {"task": task, "base_url": base_url, "api_key": api_key}
    try:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=budget_s)) as http, \
                http.post(url, json=body) as resp:
            if resp.status // 100 != 2:
                return AgentOutcome(trajectory_pb2.INFRA_FAILURE, "", f"agent HTTP {resp.status}")
            data = await resp.json(content_type=None)
    except TimeoutError:
        return AgentOutcome(trajectory_pb2.WALL_TIMEOUT, "", f"no answer within {budget_s}s")
    except (aiohttp.ClientError, ValueError) as exc:
        return AgentOutcome(trajectory_pb2.INFRA_FAILURE, "", f"agent HTTP error: {exc}")
    if not isinstance(data, dict) or not isinstance(data.get("answer"), str):
        return AgentOutcome(trajectory_pb2.INFRA_FAILURE, "", "agent answered without a string 'answer'")
    return AgentOutcome(trajectory_pb2.EOS, data["answer"])


def _kill_group(pid: int) -> None:
    """The agent process and whatever it started (its own session)."""
    try:
        os.killpg(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def load_entry(entry: str) -> Any:
    """``package.module:function`` -> the function."""
    module, _, name = entry.partition(":")
    if not module or not name:
        raise ValueError(f"agent entry {entry!r} is not 'module:function'")
    return getattr(importlib.import_module(module), name)


def main() -> None:
    """The agent's process: reads {entry, task, base_url, api_key} on stdin, prints {"answer": ...}
    (null when the function returned None: the run is then an INFRA_FAILURE, never graded)."""
    spec = json.loads(sys.stdin.read())
    answer = load_entry(spec["entry"])(spec["task"], spec["base_url"], spec["api_key"])
    print(json.dumps({"answer": None if answer is None else str(answer)}), flush=True)


if __name__ == "__main__":
    main()
