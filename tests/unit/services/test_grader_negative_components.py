"""A raw reward component below 0 (a TextArena game lost: ``return`` -1) is graded and counted, not
a grader crash: prometheus counters only grow, so the grader service adds a negative value's
magnitude to ``trajmesh_grader_raw_reward_component_negative_total`` (services/grader.py
``count_component``). Before, ``Counter.inc(-1)`` raised in the grade loop and the grader process
restarted on every lost game (a TicTacToe run through `trajmesh train`, examples/adapters/).

Real game: TextArena's TicTacToe-v0 against the fixed ``first`` opponent, the policy playing
[8], [7], [5] while the opponent fills 0, 1, 2 and wins. The trajectory goes through
GraderService._grade (decode with a real byte-level BPE tokenizer, replay on the real game) with
the task record the store writes.
"""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from grader_checks import grader_with_bpe
from prometheus_client import REGISTRY

from trajmesh.config import load_config
from trajmesh.contract import Trajectory
from trajmesh.services.grader import GraderService
from trajmesh.tasks import load_split
from trajmesh.v1 import trajectory_pb2

pytest.importorskip("textarena")

MOVES = ["[8]", "[7]", "[5]"]


@pytest.fixture(scope="module")
def service(tmp_path_factory: pytest.TempPathFactory) -> GraderService:
    """The service with a real byte-level BPE tokenizer (any text round-trips), trained here."""
    return grader_with_bpe(tmp_path_factory.mktemp("tok"), [" ".join(MOVES), "Current Board"])


def _record() -> dict[str, Any]:
    src = load_config(None, {"tasks.sources": [
        {"type": "gym", "name": "ttt", "env": "textarena:TicTacToe-v0", "opponent": "first"}]}).tasks.sources[0]
    spec = load_split(src, 1, 1)[1][0]
    return {"source": spec.source, "answer": spec.answer, "prompt": spec.prompt, "metadata": spec.metadata}


def _value(name: str, component: str) -> float:
    value = REGISTRY.get_sample_value(name, {"grader": "gym", "component": component})
    return 0.0 if value is None else value


def test_a_lost_game_is_graded_minus_one_and_counted(service: GraderService) -> None:
    record = _record()
    service.task_cache["ttt-lost"] = record
    traj = Trajectory.new(trajectory_pb2.Task(task_id="ttt-lost", group_id="g", source=record["source"]))
    traj.append_prompt(service.tokenizer.encode("Current Board")[:4])
    for turn, move in enumerate(MOVES):
        ids = service.tokenizer.encode(move) + [service.tokenizer.eos_token_id]
        traj.append_sampled(ids, [-1.0] * len(ids), 0, turn_index=turn)
        if turn < len(MOVES) - 1:
            traj.append_observation(service.tokenizer.encode("Current Board"))
    traj.finish(trajectory_pb2.ENV_DONE)
    before = {(metric, comp): _value(metric, comp)
              for metric in ("trajmesh_grader_raw_reward_component_total",
                             "trajmesh_grader_raw_reward_component_negative_total")
              for comp in ("return", "steps", "step_3")}

    out, msg_id, _ = asyncio.run(service._grade(traj.to_bytes()))

    graded = Trajectory.from_bytes(out)
    assert msg_id == f"graded-{traj.trajectory_id}"
    assert graded.pb.graded and graded.pb.reward == -1.0, graded.pb.verifier_output
    assert dict(graded.pb.raw_reward_components) == {
        "return": -1.0, "steps": 3.0, "step_1": 0.0, "step_2": 0.0, "step_3": -1.0}
    negative, positive = ("trajmesh_grader_raw_reward_component_negative_total",
                          "trajmesh_grader_raw_reward_component_total")
    assert _value(negative, "return") - before[(negative, "return")] == 1.0
    assert _value(negative, "step_3") - before[(negative, "step_3")] == 1.0
    assert _value(positive, "return") == before[(positive, "return")]
    assert _value(positive, "steps") - before[(positive, "steps")] == 3.0
    assert _value(negative, "steps") == before[(negative, "steps")]
