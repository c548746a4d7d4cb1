"""A stateless environment's episode costs the environment service no call; a stateful one still does.

The rollout's own `run_episode` plays tasks against a real environment service (in process, real
gRPC), its engine call replaced by a scripted turn. What the service saw is read from its own
metric (`trajmesh_environment_calls_total` by method). A chain_sum task (single_answer: one turn,
`stateless`) makes no Reset, Step or Close on it, whether the turn stops or runs out of tokens (the
case where the rollout closes the session), and its trajectory is byte for byte the one the service
path gives (`rollout.stateless_environments_in_process: false`, which does call the service: the
signal that the calls would be counted). A math_tool task (a tool environment with state) is still
Reset on the service and stepped or closed there, and so is a held-out chain_sum episode (the
evaluator's `evaluation` tasks: every held-out score comes from the environment service).
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import grpc
import pytest

pytest.importorskip("torch")

from prometheus_client import REGISTRY  # noqa: E402

from trajmesh.config import RunConfig, load_config  # noqa: E402
from trajmesh.contract import Trajectory  # noqa: E402
from trajmesh.envs.math_tool import MathToolEnv  # noqa: E402
from trajmesh.learner.models import build_char_tokenizer  # noqa: E402
from trajmesh.rollout.agents.episode import EpisodeFormat  # noqa: E402
from trajmesh.services.environment import EnvironmentService  # noqa: E402
from trajmesh.services.rollout import RolloutService  # noqa: E402
from trajmesh.v1 import services_pb2_grpc, trajectory_pb2  # noqa: E402

METHODS = ("reset", "step", "close")


@pytest.fixture(scope="module")
def char_model(tmp_path_factory: pytest.TempPathFactory) -> str:
    """Only the tokenizer matters (the engine is scripted): the demo's character tokenizer."""
    root = tmp_path_factory.mktemp("char-model")
    build_char_tokenizer(root)
    (root / "config.json").write_text("{}")
    return str(root)


def _cfg(tmp_path: Path, model: str, **over: Any) -> RunConfig:
    return load_config(None, {"run_dir": str(tmp_path / "run"), "model.path": model, **over})


def _task(task_id: str, environment: str, prompt: str, answer: str, max_new_tokens: int) -> trajectory_pb2.Task:
    return trajectory_pb2.Task(
        task_id=task_id, group_id=f"g-{task_id}", source=environment, seed=11, group_size=1,
        environment=environment, prompt=prompt, answer=answer, metadata_json=json.dumps({}),
        sampling=trajectory_pb2.SamplingParams(temperature=1.0, top_p=1.0, max_new_tokens=max_new_tokens,
                                               max_turns=3))


def _calls() -> dict[str, float]:
    """The environment service's answered calls so far, by method (its own metric)."""
    return {m: REGISTRY.get_sample_value("trajmesh_environment_calls_total", {"method": m, "status": "ok"}) or 0.0
            for m in METHODS}


def _play(cfg: RunConfig, tasks: list[tuple[trajectory_pb2.Task, str, str]]) -> tuple[list[Trajectory], dict[str, float]]:
    """Each (task, answer text, finish) as sample 0 by the rollout's `run_episode` against a real
    environment service: the trajectories and the calls the service answered meanwhile."""
    svc = RolloutService(cfg)
    svc.format = EpisodeFormat.load(str(cfg.model.path))  # what setup() loads
    svc.tokenizer, svc.chat, svc.stop_ids = svc.format.tokenizer, svc.format.chat, svc.format.stop_ids
    svc.version = 0
    turns: list[tuple[list[int], str]] = []

    async def generate(context: list[int], sp: Any, seed: int) -> tuple[list[int], list[float], list[int], str]:
        ids, finish = turns.pop(0)
        return ids, [-1.0] * len(ids), [0] * len(ids), finish

    svc._generate = generate  # type: ignore[method-assign]

    async def body() -> tuple[list[Trajectory], dict[str, float]]:
        env_svc = EnvironmentService(cfg)
        await env_svc.setup()
        out = []
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{env_svc.grpc_port}") as ch:
                svc.envs = [services_pb2_grpc.EnvironmentStub(ch)]
                before = _calls()
                for task, text, finish in tasks:
                    turns[:] = [(svc.tokenizer.encode(text)[-len(text):], finish)]
                    out.append(await svc.run_episode(task, 0))
                after = _calls()
        finally:
            await env_svc.stop()
        return out, {m: after[m] - before[m] for m in METHODS}

    return asyncio.run(body())


def _comparable(t: Trajectory) -> bytes:
    """The trajectory without what differs between two plays of it (wall-clock stamps, timings)."""
    pb = trajectory_pb2.Trajectory()
    pb.CopyFrom(t.pb)
    pb.ClearField("timing")
    return pb.SerializeToString(deterministic=True)


def test_a_single_turn_task_makes_no_environment_calls(tmp_path: Path, char_model: str) -> None:
    tasks = [(_task("t1-c0", "chain_sum", "3 + 4 = ?", "7", 8), "7", "stop"),  # the turn ends the episode
             (_task("t2-c1", "chain_sum", "5 + 6 = ?", "11", 2), "12", "length")]  # out of tokens: a Close
    trajs, calls = _play(_cfg(tmp_path / "new", char_model), tasks)
    assert calls == {"reset": 0, "step": 0, "close": 0}, calls
    via_service, service_calls = _play(
        _cfg(tmp_path / "base", char_model, **{"rollout.stateless_environments_in_process": False}), tasks)
    assert service_calls == {"reset": 2, "step": 1, "close": 1}, service_calls
    assert [t.terminal_reason for t in trajs] == [trajectory_pb2.ENV_DONE, trajectory_pb2.MAX_TOKENS]
    assert trajs[0].pb.environment_revision == "single_answer-v1"
    assert [_comparable(t) for t in trajs] == [_comparable(t) for t in via_service]


def test_a_stateful_task_still_resets_and_closes_on_the_service(tmp_path: Path, char_model: str) -> None:
    tasks = [(_task("m1-c0", "math_tool", "1 + 1?", "2", 8), "2", "stop"),  # a final answer: one Step
             (_task("m2-c1", "math_tool", "2 + 2?", "4", 2), "44", "length")]  # out of tokens: a Close
    trajs, calls = _play(_cfg(tmp_path, char_model), tasks)
    assert calls == {"reset": 2, "step": 1, "close": 1}, calls
    assert [t.terminal_reason for t in trajs] == [trajectory_pb2.ENV_DONE, trajectory_pb2.MAX_TOKENS]
    assert {t.pb.environment_revision for t in trajs} == {MathToolEnv.revision}


def test_a_held_out_single_turn_task_is_played_on_the_service(tmp_path: Path, char_model: str) -> None:
    tasks = [(_task("e1-c0", "chain_sum", "3 + 4 = ?", "7", 8), "7", "stop"),
             (_task("e2-c1", "chain_sum", "5 + 6 = ?", "11", 2), "12", "length")]
    for task, _, _ in tasks:
        task.evaluation = True
    trajs, calls = _play(_cfg(tmp_path, char_model), tasks)
    assert calls == {"reset": 2, "step": 1, "close": 1}, calls
    assert [t.terminal_reason for t in trajs] == [trajectory_pb2.ENV_DONE, trajectory_pb2.MAX_TOKENS]
