"""The grader attaches its verdict without touching the token block (services/grader.py `_grade`):
the block it publishes is byte for byte the one it received, and grading a message again (a
redelivery, or a message graded before) gives the message that grading it once gives."""

from __future__ import annotations

import asyncio

import pytest
from grader_checks import grader_with_bpe

from trajmesh.config import load_config
from trajmesh.contract import Trajectory
from trajmesh.services.grader import GraderService
from trajmesh.tasks import load_split
from trajmesh.v1 import trajectory_pb2


@pytest.fixture(scope="module")
def service(tmp_path_factory: pytest.TempPathFactory) -> GraderService:
    """The service with a small byte-level BPE tokenizer trained here (any text round-trips)."""
    return grader_with_bpe(tmp_path_factory.mktemp("tok"), ["the answer is 12 + 30 = 42"], vocab_size=300)


def _raw(svc: GraderService, answer: str, *, filler: int = 4000) -> bytes:
    """A chain_sum trajectory as the rollout publishes it: ~4k sampled tokens ending in `answer`."""
    src = load_config(None, {}).tasks.sources[0]
    spec = load_split(src, 1, 1)[1][0]
    task_id = "block-task"
    svc.task_cache[task_id] = {"source": spec.source, "answer": spec.answer, "prompt": spec.prompt,
                               "metadata": spec.metadata}
    traj = Trajectory.new(trajectory_pb2.Task(task_id=task_id, group_id="g", source=spec.source),
                          trajectory_id=f"{task_id}-0")
    traj.append_prompt(svc.tokenizer.encode(spec.prompt)[:8])
    ids = [svc.tokenizer.encode(" ")[0]] * filler + svc.tokenizer.encode(answer) + [svc.tokenizer.eos_token_id]
    traj.append_sampled(ids, [-0.5] * len(ids), 3)
    traj.finish(trajectory_pb2.EOS)
    return traj.to_bytes()


def _grade(svc: GraderService, data: bytes) -> Trajectory:
    out, msg_id, _ = asyncio.run(svc._grade(data))
    assert msg_id is not None
    return Trajectory.from_bytes(out)


def _without_timing(traj: Trajectory) -> bytes:
    msg = trajectory_pb2.Trajectory()
    msg.CopyFrom(traj.pb)
    msg.timing.grading_seconds = 0.0  # the one field a second grading may set differently
    return msg.SerializeToString(deterministic=True)


def test_the_published_block_is_the_received_one(service: GraderService) -> None:
    raw = Trajectory.from_bytes(_raw(service, "42"))
    graded = _grade(service, raw.to_bytes())
    assert graded.graded and graded.pb.grader_revision and dict(graded.pb.raw_reward_components)
    assert len(graded) > 4000 and graded.token_block == raw.token_block
    assert not graded.pb.token_ids  # no per-token field written beside it


def test_grading_again_gives_what_grading_once_gives(service: GraderService) -> None:
    once = _grade(service, _raw(service, "42"))
    assert _without_timing(_grade(service, once.to_bytes())) == _without_timing(once)
    # A message that carries another verdict already (a component this grader never gives, an
    # audit note): the new verdict replaces it whole, no map entry or suffix left from before.
    stale = Trajectory.from_bytes(once.to_bytes())
    stale.pb.raw_reward_components["from_an_earlier_verdict"] = 5.0
    stale.pb.verifier_output += " audit={}"
    stale.pb.reward = -3.0
    again = _grade(service, stale.to_bytes())
    assert _without_timing(again) == _without_timing(once)
    assert again.token_block == once.token_block
