"""Fuzzing the store's intake: hostile bytes are refused with a named reason and never crash it.

`make test` runs a few hundred cases per strategy; the slow suite runs ≥ 10,000 in total.
"""

from __future__ import annotations

import math
import os

import pytest
from contract_layouts import old_layout
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from trajmesh.contract import VIOLATION_NAMES, Trajectory
from trajmesh.services.store.intake import INFRA_REASONS, OUTCOME_VALID, judge
from trajmesh.v1 import trajectory_pb2

VOCAB = 50
TASK = {"group_id": "g1", "group_size": 4}
INTAKE_REASONS = {"not_a_trajectory", "unknown_task_id", "group_mismatch", "not_graded", *INFRA_REASONS}
FAST = int(os.environ.get("TRAJMESH_FUZZ_EXAMPLES", "150"))


def _build_valid(n_prompt: int, n_action: int, reward: float = 1.0) -> Trajectory:
    t = Trajectory.new(trajectory_id="t-0")
    t.pb.task_id, t.pb.group_id = "task", "g1"
    t.append_prompt([1] + [5] * (n_prompt - 1))
    t.append_sampled([6] * (n_action - 1) + [2], [-0.5] * n_action, 0)
    t.finish(trajectory_pb2.EOS)
    t.set_reward(reward)
    return t


def _check(data: bytes, task: dict | None = TASK) -> None:
    v = judge(data, task, vocab_size=VOCAB, learner_version=3)
    assert v.outcome in {OUTCOME_VALID, "quarantined", "failed_infra"}
    if v.outcome == OUTCOME_VALID:
        assert v.reason == "" and v.trajectory is not None
        assert v.trajectory.validate(vocab_size=VOCAB, learner_version=3) == []
        assert math.isfinite(v.trajectory.reward) and v.trajectory.graded and v.member
    else:
        names = set(v.reason.split(","))
        assert v.reason and names <= set(VIOLATION_NAMES) | INTAKE_REASONS, v.reason


def _fuzz(n: int):  # type: ignore[no-untyped-def]
    return settings(max_examples=n, deadline=None, suppress_health_check=list(HealthCheck))


@_fuzz(FAST)
@given(st.binary(max_size=4096))
def test_random_bytes(data: bytes) -> None:
    _check(data)


@_fuzz(FAST)
@given(st.integers(1, 40), st.integers(1, 40), st.data())
def test_truncated_and_extended_messages(n_prompt: int, n_action: int, data: st.DataObject) -> None:
    raw = _build_valid(n_prompt, n_action).to_bytes()
    cut = data.draw(st.integers(0, len(raw)))
    _check(raw[:cut])
    _check(raw + data.draw(st.binary(max_size=64)))


_EXTREMES = {"token_ids": st.sampled_from([VOCAB, 2**32 - 1]), "loss_mask": st.sampled_from([2, 255]),
             "behavior_logprobs": st.sampled_from([math.nan, math.inf, -math.inf, 1e30, 3.0]),
             "behavior_versions": st.sampled_from([-(2**63), -5, 2**63 - 1, 10**9])}


@_fuzz(FAST)
@given(st.integers(1, 20), st.integers(1, 20), st.data())
def test_inconsistent_arrays_and_extreme_values(n_prompt: int, n_action: int, data: st.DataObject) -> None:
    """In the token block: an extreme value in one column, or the block's bytes cut, grown or
    flipped; in the layout before the block (repeated fields): a column one longer or shorter too."""
    t = _build_valid(n_prompt, n_action)
    field = data.draw(st.sampled_from(sorted(_EXTREMES)))
    action = data.draw(st.sampled_from(["extreme", "cut", "grow", "flip", "old_append", "old_drop", "old_extreme"]))
    if action == "extreme":
        values = getattr(t, f"{field}_T").tolist()
        values[data.draw(st.integers(0, len(values) - 1))] = data.draw(_EXTREMES[field])
        t.replace_token_arrays(**{field: values})
    elif action in ("cut", "grow", "flip"):
        block = bytearray(t.token_block)
        if action == "cut":
            del block[data.draw(st.integers(0, len(block) - 1)):]
        elif action == "grow":
            block += data.draw(st.binary(min_size=1, max_size=64))
        else:
            block[data.draw(st.integers(0, len(block) - 1))] ^= 1 << data.draw(st.integers(0, 7))
        t.pb.token_block = bytes(block)
    else:
        t = old_layout(t)
        arr = getattr(t.pb, field)
        if action == "old_append":
            arr.append(data.draw({"token_ids": st.integers(0, 2**32 - 1), "loss_mask": st.integers(0, 2**32 - 1),
                                  "behavior_logprobs": st.floats(width=32),
                                  "behavior_versions": st.integers(-(2**63), 2**63 - 1)}[field]))
        elif action == "old_drop":
            del arr[-1]
        else:
            arr[data.draw(st.integers(0, len(arr) - 1))] = data.draw(
                st.sampled_from([2**32 - 1]) if field == "loss_mask" else _EXTREMES[field])
    t.pb.reward = data.draw(st.sampled_from([1.0, math.nan, math.inf, -1e308]))
    _check(t.to_bytes())


@_fuzz(FAST)
@given(st.sampled_from([trajectory_pb2.Task(task_id="x", prompt="1+1="), trajectory_pb2.RunManifest(manifest_id="m"),
                        trajectory_pb2.WeightsAnnouncement(version=3, path="/p")]))
def test_other_message_types(msg: object) -> None:
    _check(msg.SerializeToString())  # type: ignore[attr-defined]


def test_known_verdicts() -> None:
    good = _build_valid(3, 2)
    assert judge(good.to_bytes(), TASK, vocab_size=VOCAB, learner_version=3).outcome == OUTCOME_VALID
    assert judge(good.to_bytes(), None, vocab_size=VOCAB, learner_version=3).reason == "unknown_task_id"
    assert judge(good.to_bytes(), {"group_id": "g2"}, vocab_size=VOCAB, learner_version=3).reason == "group_mismatch"
    assert judge(b"\xff\xff", TASK, vocab_size=VOCAB, learner_version=3).reason == "not_a_trajectory"
    future = _build_valid(3, 2)
    future.replace_token_arrays(behavior_versions=[-1, -1, -1, 0, 9])
    assert "version_from_future" in judge(future.to_bytes(), TASK, vocab_size=VOCAB, learner_version=3).reason


@pytest.mark.slow
@_fuzz(10_000)
@given(st.binary(max_size=8192))
def test_random_bytes_slow(data: bytes) -> None:
    _check(data)


@pytest.mark.slow
@_fuzz(5_000)
@given(st.integers(1, 40), st.integers(1, 40), st.data())
def test_truncated_messages_slow(n_prompt: int, n_action: int, data: st.DataObject) -> None:
    raw = _build_valid(n_prompt, n_action).to_bytes()
    _check(raw[: data.draw(st.integers(0, len(raw)))])
