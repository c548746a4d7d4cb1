"""A scorer that raises on the model's answer scores 0 with a `parse_error` component; a grader that
raises on the gold answer too is broken, and the grader service records an infrastructure failure.

Real reasoning-gym family: `prime_factorization`'s `score_answer` raises ValueError on any
non-numeric answer (issue 25) and scores its gold answers 1. The trajectories go through
GraderService._grade (decode with a real byte-level BPE tokenizer, grade, re-encode) with the task
record the store writes, as the service grades TRAJ_RAW messages.
"""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from grader_checks import grader_with_bpe

from trajmesh.config import load_config
from trajmesh.contract import Trajectory
from trajmesh.graders import PARSE_ERROR, Grade, Sample, UnparseableAnswer, grade_sample, make_grader
from trajmesh.services.grader import GraderService
from trajmesh.tasks import TaskSpec, load_split
from trajmesh.v1 import trajectory_pb2

GARBAGE = "zz-not-an-answer-zz"


@pytest.fixture(scope="module")
def service(tmp_path_factory: pytest.TempPathFactory) -> GraderService:
    """The service with a real byte-level BPE tokenizer (any text round-trips), trained here."""
    return grader_with_bpe(tmp_path_factory.mktemp("tok"), ["the answer is 2 3 5 7 11", GARBAGE])


def _task(family: str = "prime_factorization") -> TaskSpec:
    src = load_config(None, {"tasks.sources": [{"type": "reasoning_gym", "name": family, "family": family}]}
                      ).tasks.sources[0]
    return load_split(src, 1, 1)[1][0]


def _record(spec: TaskSpec) -> dict[str, Any]:
    """The store's task record (services/store/service.py)."""
    return {"source": spec.source, "answer": spec.answer, "prompt": spec.prompt, "metadata": spec.metadata}


def _graded(svc: GraderService, record: dict[str, Any], text: str, task_id: str) -> Trajectory:
    svc.task_cache[task_id] = record
    traj = Trajectory.new(trajectory_pb2.Task(task_id=task_id, group_id="g", source=record["source"]))
    traj.append_prompt(svc.tokenizer.encode(record["prompt"])[:8])
    ids = svc.tokenizer.encode(text) + [svc.tokenizer.eos_token_id]
    traj.append_sampled(ids, [-1.0] * len(ids), 0)
    traj.finish(trajectory_pb2.EOS)
    out, msg_id, _ = asyncio.run(svc._grade(traj.to_bytes()))
    assert msg_id == f"graded-{traj.trajectory_id}"
    return Trajectory.from_bytes(out)


def test_the_scorer_really_raises_on_garbage_and_accepts_gold() -> None:
    """The premise, from the family's own scorer: garbage raises, gold scores 1."""
    spec, grader = _task(), make_grader("reasoning_gym")
    with pytest.raises(ValueError):
        grader.grade(Sample(GARBAGE, [GARBAGE], True), _record(spec))
    assert grader.grade(Sample(spec.answer, [spec.answer], True), _record(spec)).reward == 1.0


def test_garbage_scores_zero_with_a_parse_error_not_an_infra_failure(service: GraderService) -> None:
    spec = _task()
    out = _graded(service, _record(spec), GARBAGE, "pf-garbage")
    assert out.pb.terminal_reason == trajectory_pb2.EOS
    assert out.pb.graded and out.pb.reward == 0.0
    assert dict(out.pb.raw_reward_components) == {PARSE_ERROR: 1.0}
    assert out.pb.verifier_output.startswith("parse error: ValueError"), out.pb.verifier_output
    gold = _graded(service, _record(spec), spec.answer, "pf-gold")
    assert gold.pb.reward == 1.0 and PARSE_ERROR not in gold.pb.raw_reward_components


def test_a_grader_that_raises_on_gold_too_is_an_infra_failure(service: GraderService) -> None:
    """A task whose prompt no longer matches its generator (revision drift): the scorer raises on any
    answer, the gold one included, so the grader is broken and nothing is rewarded."""
    record = _record(_task())
    record["prompt"] = record["prompt"] + " (edited)"
    out = _graded(service, record, GARBAGE, "pf-drift")
    assert out.pb.terminal_reason == trajectory_pb2.INFRA_FAILURE
    assert out.pb.verifier_output.startswith("verifier error: ") and "revision drift" in out.pb.verifier_output


def test_a_task_without_gold_cannot_vouch_for_its_scorer() -> None:
    """No gold answer to check the scorer on: its exception stays an exception (infrastructure)."""
    record = {**_record(_task()), "answer": "None"}
    with pytest.raises(ValueError):
        grade_sample(make_grader("reasoning_gym"), Sample(GARBAGE, [GARBAGE], True), record)


class _Explicit:
    """A grader that says itself that it cannot read the answer (its gold check would fail)."""

    revision = "explicit-v1"

    def grade(self, sample: Sample, task: dict[str, Any]) -> Grade:
        try:
            return Grade(float(int(sample.text) == 4), {"correct": float(int(sample.text) == 4)}, "", self.revision)
        except ValueError as exc:
            raise UnparseableAnswer("not an integer") from exc


def test_unparseable_answer_is_a_parse_error_whatever_the_gold() -> None:
    grade = grade_sample(_Explicit(), Sample("four", ["four"], True), {"answer": ""})
    assert (grade.reward, grade.components) == (0.0, {PARSE_ERROR: 1.0})
    assert grade.verifier_output.startswith("parse error: ValueError: invalid literal"), grade.verifier_output
