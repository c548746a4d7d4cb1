"""A rollout cuts a trajectory short once it could only be trained stale (issue 16): between turns,
if the loaded weights are more than η versions newer than its oldest sampled token (the learner is
at least that far on), it stops generating, closes the environment session and ends STALE
(truncated), instead of generating the remaining turns to be thrown away. Within η it goes on."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace
from typing import Any

import pytest

pytest.importorskip("torch")

from trajmesh.config import load_config  # noqa: E402
from trajmesh.services.rollout import RolloutService  # noqa: E402
from trajmesh.v1 import trajectory_pb2  # noqa: E402

ETA = 1
TURNS = 4


class _Env:
    """An environment that never ends the episode; records its calls."""

    def __init__(self) -> None:
        self.steps = 0
        self.closed = False

    async def Step(self, request: Any, timeout: float) -> Any:  # noqa: N802 - the gRPC stub's name
        self.steps += 1
        return SimpleNamespace(info_json="{}", state_hash="h", done=False, observation="go on", reward=0.0)

    async def Close(self, request: Any, timeout: float) -> Any:  # noqa: N802
        self.closed = True


def _episode(new_version_after_turn_0: int) -> tuple[Any, _Env, int]:
    """One 4-turn episode; after its first turn the rollout loads weights `new_version_after_turn_0`."""
    service = RolloutService(load_config(None, {"gate.eta": ETA, "tasks.sampling.max_turns": TURNS}))
    service.version = 0  # set in setup(): the base model
    env = _Env()
    generated = []

    async def reset(task: Any, tid: str, seed: int) -> Any:
        return env, SimpleNamespace(state_hash="h0", environment_revision="r", observation="start")

    async def generate(context: list[int], sp: Any, seed: int) -> Any:
        generated.append(service.version)
        ids = [7, 8]
        out = ids, [-0.5, -0.5], [service.version] * len(ids), "stop"
        service.version = new_version_after_turn_0  # a weight update lands while the turn ends
        return out

    service._reset = reset  # type: ignore[method-assign]
    service._generate = generate  # type: ignore[method-assign]
    service._prompt_ids = lambda observation, tools=None: [1, 2, 3]  # type: ignore[method-assign]
    service._observation_ids = lambda text, kind, ids: [4]  # type: ignore[method-assign]
    service.tokenizer = SimpleNamespace(decode=lambda ids: "x")
    # a multi-turn tool environment: its session is the service's (`_reset`, replaced above)
    task = trajectory_pb2.Task(task_id="t", group_id="g", source="math_tool", group_size=1, environment="math_tool")
    task.sampling.max_turns = TURNS
    task.sampling.max_new_tokens = 2
    traj = asyncio.run(service.run_episode(task, 0))
    return traj, env, len(generated)


def test_a_trajectory_that_can_only_be_trained_stale_is_cut_short() -> None:
    traj, env, turns = _episode(new_version_after_turn_0=ETA + 1)  # its v0 tokens lag v2 by 2 > η
    assert turns == 1  # nothing generated after the cut
    assert traj.terminal_reason == trajectory_pb2.STALE and traj.truncated
    assert env.closed  # the environment session is not left open


def test_a_trajectory_within_eta_runs_all_its_turns() -> None:
    traj, env, turns = _episode(new_version_after_turn_0=ETA)  # lag 1 = η: still trainable
    assert turns == TURNS
    assert traj.terminal_reason == trajectory_pb2.MAX_TURNS
