"""The trajectory contract: construction, exact round trips, and one test per named violation."""

from __future__ import annotations

import hashlib
import math
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
from contract_layouts import old_layout
from hypothesis import given, settings
from hypothesis import strategies as st

from trajmesh.contract import VIOLATION_NAMES, ContractError, Trajectory, Violation
from trajmesh.v1 import trajectory_pb2 as pb

VOCAB_SIZE = 1000
SAMPLED_TYPES = [pb.TEXT, pb.TOOL_CALL, pb.CODE]
VALID_ENDS = [r for r in pb.TerminalReason.values() if r != pb.TERMINAL_REASON_UNSPECIFIED]


def _build_task() -> pb.Task:
    return pb.Task(
        task_id="task-1",
        group_id="group-1",
        source="reasoning_gym/chain_sum",
        revision="r3",
        seed=7,
        manifest_id="m-1",
    )


def _build_valid() -> Trajectory:
    """Two turns: prompt, sampled text, tool output, sampled tool call. Token layout:
    [0,3) prompt | [3,5) text v4 | [5,7) observation | [7,9) tool call v5."""
    traj = Trajectory.new(_build_task(), trajectory_id="traj-1")
    traj.append_prompt([11, 12, 13])
    traj.append_sampled([21, 22], [-0.5, -1.25], 4)
    traj.append_observation([31, 32])
    traj.append_sampled([41, 42], [-0.125, -2.0], [5, 5], action_type=pb.TOOL_CALL, turn_index=1)
    traj.add_tool_call("python", "print(1)", "1\n", latency_seconds=0.25)
    traj.finish(pb.EOS)
    traj.set_reward(1.0, components={"correct": 1.0})
    return traj


def _names(violations: list[Violation]) -> list[str]:
    return [v.name for v in violations]


# ---------------------------------------------------------------- random multi-turn trajectories

_token_lists = st.lists(st.integers(0, VOCAB_SIZE - 1), min_size=1, max_size=12)
_finite_logprobs = st.floats(max_value=0.0, allow_nan=False, allow_infinity=False, width=32)
_any_float32 = st.floats(width=32)


@st.composite
def _trajectories(draw: st.DrawFn, logprob: st.SearchStrategy[float] = _finite_logprobs) -> Trajectory:
    traj = Trajectory.new(_build_task(), manifest_id=draw(st.text(max_size=8)))
    traj.append_prompt(draw(_token_lists))
    version = draw(st.integers(0, 1000))
    num_turns = draw(st.integers(1, 5))
    for turn in range(num_turns):
        for _ in range(draw(st.integers(1, 3))):  # a turn may hold several sampled segments
            tokens = draw(_token_lists)
            logprobs = draw(st.lists(logprob, min_size=len(tokens), max_size=len(tokens)))
            versions: int | list[int] = (
                version if draw(st.booleans()) else [version + draw(st.integers(0, 2)) for _ in tokens]
            )
            action_type = draw(st.sampled_from(SAMPLED_TYPES))
            traj.append_sampled(tokens, logprobs, versions, action_type=action_type, turn_index=turn)
            if action_type == pb.TOOL_CALL:
                traj.add_tool_call("tool", draw(st.text(max_size=10)), draw(st.binary(max_size=10)))
        if turn < num_turns - 1 or draw(st.booleans()):
            traj.append_observation(draw(_token_lists), turn_index=turn)
        version += draw(st.integers(0, 3))
    traj.finish(draw(st.sampled_from(VALID_ENDS)))
    traj.set_reward(
        draw(st.floats(allow_nan=False, allow_infinity=False)),
        components=draw(st.dictionaries(st.text(max_size=5), st.floats(-1e6, 1e6), max_size=3)),
    )
    return traj


def _assert_same(a: Trajectory, b: Trajectory) -> None:
    assert a.to_bytes() == b.to_bytes()
    np.testing.assert_array_equal(a.token_ids_T, b.token_ids_T)
    np.testing.assert_array_equal(a.loss_mask_T, b.loss_mask_T)
    np.testing.assert_array_equal(a.behavior_versions_T, b.behavior_versions_T)
    # Bit-for-bit, so -0.0, subnormals and NaN payloads count.
    np.testing.assert_array_equal(
        a.behavior_logprobs_T.view(np.uint32), b.behavior_logprobs_T.view(np.uint32)
    )


@settings(max_examples=200, deadline=None)
@given(_trajectories())
def test_random_trajectory_round_trips_exactly_and_is_valid(traj: Trajectory) -> None:
    back = Trajectory.from_bytes(traj.to_bytes())
    _assert_same(traj, back)
    learner_version = int(traj.behavior_versions_T.max())
    assert traj.validate(vocab_size=VOCAB_SIZE, learner_version=learner_version) == []
    assert back.validate(vocab_size=VOCAB_SIZE, learner_version=learner_version) == []


@settings(max_examples=200, deadline=None)
@given(_trajectories(logprob=_any_float32))
def test_any_float32_logprobs_round_trip_bit_exact(traj: Trajectory) -> None:
    _assert_same(traj, Trajectory.from_bytes(traj.to_bytes()))


@settings(max_examples=100, deadline=None)
@given(_trajectories())
def test_spans_tile_the_tokens_and_agree_with_the_mask(traj: Trajectory) -> None:
    spans = list(traj.spans)
    assert spans[0].token_start == 0 and spans[-1].token_end == len(traj)
    assert all(a.token_end == b.token_start for a, b in zip(spans[:-1], spans[1:], strict=True))
    assert len({s.span_id for s in spans}) == len(spans)
    mask_T = traj.loss_mask_T
    for s in spans:
        expected = 1 if s.action_type in SAMPLED_TYPES else 0
        assert (mask_T[s.token_start : s.token_end] == expected).all()
    assert traj.prompt_length == spans[0].token_end


# ---------------------------------------------------------------- construction


def test_new_copies_task_fields() -> None:
    traj = Trajectory.new(_build_task())
    assert len(traj.trajectory_id) == 32 and int(traj.trajectory_id, 16) >= 0
    assert (traj.task_id, traj.group_id, traj.pb.task_source, traj.pb.task_revision, traj.pb.reset_seed) == (
        "task-1",
        "group-1",
        "reasoning_gym/chain_sum",
        "r3",
        7,
    )
    assert traj.manifest_id == "m-1"
    assert Trajectory.new(_build_task(), manifest_id="m-2").manifest_id == "m-2"
    assert Trajectory.new().trajectory_id != Trajectory.new().trajectory_id


def test_builders_fill_arrays_spans_and_tool_calls() -> None:
    traj = _build_valid()
    assert traj.token_ids_T.tolist() == [11, 12, 13, 21, 22, 31, 32, 41, 42]
    assert traj.loss_mask_T.tolist() == [0, 0, 0, 1, 1, 0, 0, 1, 1]
    assert traj.behavior_versions_T.tolist() == [-1, -1, -1, 4, 4, -1, -1, 5, 5]
    assert traj.behavior_logprobs_T.tolist() == [0, 0, 0, -0.5, -1.25, 0, 0, -0.125, -2.0]
    assert traj.behavior_logprobs_T.dtype == np.float32 and traj.behavior_versions_T.dtype in (np.int32, np.int64)
    assert traj.prompt_length == 3 and traj.num_turns == 2
    prompt, text, obs, call = traj.spans
    assert [(s.action_type, s.turn_index, s.token_start, s.token_end) for s in traj.spans] == [
        (pb.PROMPT, 0, 0, 3),
        (pb.TEXT, 0, 3, 5),
        (pb.OBSERVATION, 0, 5, 7),
        (pb.TOOL_CALL, 1, 7, 9),
    ]
    # Turn roots chain; the other spans of a turn hang off its root.
    assert prompt.parent_span_id == ""
    assert text.parent_span_id == obs.parent_span_id == prompt.span_id
    assert call.parent_span_id == prompt.span_id
    (tool_call,) = traj.tool_calls
    assert tool_call.span_id == call.span_id
    assert tool_call.response_sha256 == hashlib.sha256(b"1\n").hexdigest()
    assert tool_call.status == pb.TOOL_OK
    assert traj.graded and traj.reward == 1.0 and not traj.truncated


def test_prompt_length_counts_all_leading_unsampled_tokens() -> None:
    traj = Trajectory.new(_build_task())
    traj.append_prompt([1, 2])
    traj.append_prompt([3])
    traj.append_sampled([4], [-1.0], 0)
    traj.append_observation([5, 6])
    assert traj.prompt_length == 3


def test_finish_marks_budget_ends_truncated() -> None:
    traj = _build_valid()
    traj.finish(pb.MAX_TOKENS)
    assert traj.truncated and traj.terminal_reason == pb.MAX_TOKENS
    traj.finish(pb.ENV_DONE)
    assert not traj.truncated


@pytest.mark.parametrize(
    "call",
    [
        lambda t: t.append_sampled([1, 2], [-1.0], 0),
        lambda t: t.append_sampled([1, 2], [-1.0, -1.0], [0]),
        lambda t: t.append_sampled([1], [-1.0], 0, action_type=pb.OBSERVATION),
        lambda t: t.append_prompt([-1]),
        lambda t: t.add_tool_call("tool", "request"),
    ],
    ids=["logprobs_length", "versions_length", "unsampled_type", "negative_token", "no_tool_span"],
)
def test_builders_reject_bad_input(call: Callable[[Trajectory], Any]) -> None:
    with pytest.raises(ContractError):
        call(Trajectory.new(_build_task()))


@settings(max_examples=200, deadline=None)
@given(
    st.lists(st.integers(0, 2**32 - 1), max_size=150),
    st.lists(st.tuples(st.integers(0, 2**32 - 1), _any_float32, st.integers(-(2**63), 2**63 - 1)), min_size=1,
             max_size=150),
    st.sampled_from(["list", "numpy", "one_version"]),
)
def test_builders_write_every_value_exactly(
    prompt: list[int], sampled: list[tuple[int, float, int]], form: str
) -> None:
    """The builders pack what they are given into the token block: every uint32 id, float32
    log-prob (bit for bit) and int64 version, from lists or arrays, and the views read them back
    from the block's bytes (read-only, no copy)."""
    ids, logprobs, versions = (list(x) for x in zip(*sampled, strict=True))
    one = versions[0] if form == "one_version" else None
    traj = Trajectory.new(trajectory_id="t")
    if form == "numpy":
        traj.append_prompt(np.array(prompt, dtype=np.int64))
        traj.append_sampled(np.array(ids, dtype=np.uint32), np.array(logprobs, dtype=np.float32),
                            np.array(versions, dtype=np.int64))
    else:
        traj.append_prompt(prompt)
        traj.append_sampled(ids, logprobs, one if one is not None else versions)
    back = Trajectory.from_bytes(traj.to_bytes())
    assert not back.pb.token_ids and back.pb.token_block == traj.token_block
    np.testing.assert_array_equal(back.token_ids_T, np.array(prompt + ids, dtype=np.uint32))
    np.testing.assert_array_equal(back.loss_mask_T, [0] * len(prompt) + [1] * len(ids))
    np.testing.assert_array_equal(back.behavior_logprobs_T.view(np.uint32),
                                  np.array([0.0] * len(prompt) + logprobs, dtype=np.float32).view(np.uint32))
    np.testing.assert_array_equal(back.behavior_versions_T,
                                  [-1] * len(prompt) + ([one] * len(ids) if one is not None else versions))
    assert [(sp.token_start, sp.token_end) for sp in back.spans] == [(0, len(prompt)), (len(prompt), len(prompt) + len(ids))]
    assert back.pb.prompt_length == len(prompt) and not back.behavior_logprobs_T.flags.writeable


# ---------------------------------------------------------------- wire format


def test_nan_payloads_survive_the_wire_bit_for_bit() -> None:
    bits = np.array([0x7FC12345, 0x7F812345, 0xFFC00001, 0x00000001, 0x80000000, 0xFF800000], dtype=np.uint32)
    traj = Trajectory.new(_build_task())
    traj.append_sampled(np.arange(bits.size), np.zeros(bits.size, dtype=np.float32), 0)
    # Raw float32 bits into the block's log-prob column, bypassing Python floats entirely.
    traj.replace_token_arrays(behavior_logprobs=bits.view(np.float32))
    packed = bits.astype("<u4").tobytes()
    data = traj.to_bytes()
    assert packed in data
    assert Trajectory.from_bytes(data).to_bytes() == data
    quiet = np.array([0x7FC12345, 0xFFC00001, 0x00000001, 0x80000000, 0xFF800000], dtype=np.uint32)
    view_bits = Trajectory.from_bytes(data).behavior_logprobs_T.view(np.uint32)
    np.testing.assert_array_equal(view_bits[[0, 2, 3, 4, 5]], quiet)  # quiet NaNs and the rest exact


@pytest.mark.parametrize(
    "data", [b"", b"\xff\xff\xff", b"\x0a\x05ab", pb.Timing(rollout_seconds=1.0).SerializeToString()]
)
def test_from_bytes_rejects_non_trajectories(data: bytes) -> None:
    with pytest.raises(ContractError, match="not a trajectory"):
        Trajectory.from_bytes(data)


def test_from_bytes_accepts_memoryview() -> None:
    traj = _build_valid()
    _assert_same(traj, Trajectory.from_bytes(memoryview(traj.to_bytes())))


# ---------------------------------------------------------------- violations, one per name


def _set(field: str, index: int, value: Any) -> Callable[[Trajectory], None]:
    def mutate(traj: Trajectory) -> None:
        values = getattr(traj, f"{field}_T").astype(np.float64 if "logprobs" in field else np.int64)
        values[index] = value
        traj.replace_token_arrays(**{field: values})

    return mutate


def _block_edit(edit: Callable[[bytearray], bytes]) -> Callable[[Trajectory], Trajectory]:
    """A mutation that rewrites the token block's bytes (read again by a new Trajectory)."""
    def mutate(traj: Trajectory) -> Trajectory:
        traj.pb.token_block = edit(bytearray(traj.token_block))
        return Trajectory(traj.pb)

    return mutate


def _flip_last_byte(block: bytearray) -> bytes:
    block[-1] ^= 1
    return bytes(block)


def _old_layout_one_more_logprob(traj: Trajectory) -> Trajectory:
    old = old_layout(traj)
    old.pb.behavior_logprobs.append(-1.0)
    return Trajectory(old.pb)


def _only_prompt_and_observation(traj: Trajectory) -> Trajectory:
    traj = Trajectory.new(_build_task(), trajectory_id="traj-2")
    traj.append_prompt([1, 2])
    traj.append_observation([3])
    traj.finish(pb.ENV_DONE)
    return traj


def _clear_tokens(traj: Trajectory) -> Trajectory:
    for field in ("token_block", "spans"):
        traj.pb.ClearField(field)  # type: ignore[arg-type]
    return Trajectory(traj.pb)


# name -> (mutation of _build_valid(), returning the trajectory to check when it makes a new one;
# validate() keyword arguments)
VIOLATION_CASES: dict[str, tuple[Callable[[Trajectory], Trajectory | None], dict[str, int]]] = {
    "missing_trajectory_id": (lambda t: t.pb.ClearField("trajectory_id"), {}),
    "missing_task_id": (lambda t: t.pb.ClearField("task_id"), {}),
    "token_block_mixed": (lambda t: t.pb.behavior_logprobs.append(-1.0), {}),
    "token_block_malformed": (_block_edit(lambda b: b"XXXX" + b[4:]), {}),
    "token_block_length": (_block_edit(lambda b: bytes(b[:-1])), {}),
    "token_block_checksum": (_block_edit(_flip_last_byte), {}),
    "length_mismatch": (_old_layout_one_more_logprob, {}),
    "empty_tokens": (_clear_tokens, {}),
    "token_out_of_vocab": (_set("token_ids", 4, VOCAB_SIZE), {"vocab_size": VOCAB_SIZE}),
    "mask_not_binary": (_set("loss_mask", 3, 2), {}),
    "no_action_tokens": (_only_prompt_and_observation, {}),
    "logprob_not_finite": (_set("behavior_logprobs", 3, math.nan), {}),
    "logprob_positive": (_set("behavior_logprobs", 8, 0.5), {}),
    "action_version_negative": (_set("behavior_versions", 7, -3), {}),
    "masked_version_not_minus_one": (_set("behavior_versions", 0, 0), {}),
    "teacher_logprob_invalid": (lambda t: t.set_teacher_logprobs([0.0] * 8 + [0.25], "t@1"), {}),  # 8 is sampled
    "version_from_future": (lambda t: None, {"learner_version": 4}),
    "terminal_reason_unspecified": (lambda t: t.pb.ClearField("terminal_reason"), {}),
    "span_out_of_range": (lambda t: setattr(t.pb.spans[3], "token_end", 10), {}),
    "span_mask_mismatch": (lambda t: setattr(t.pb.spans[2], "action_type", pb.CODE), {}),
    "reward_not_finite": (lambda t: setattr(t.pb, "reward", math.inf), {}),
    "sequence_starts_invalid": (lambda t: t.pb.sequence_starts.extend([0, 3]), {}),  # 3 is sampled
}


def test_every_violation_name_has_a_case() -> None:
    assert sorted(VIOLATION_CASES) == sorted(VIOLATION_NAMES)


def test_valid_trajectory_has_no_violations() -> None:
    assert _build_valid().validate(vocab_size=VOCAB_SIZE, learner_version=5) == []


@pytest.mark.parametrize("name", list(VIOLATION_CASES))
def test_violation_is_reported_by_name(name: str) -> None:
    mutate, kwargs = VIOLATION_CASES[name]
    traj = _build_valid()
    changed = mutate(traj)
    traj = traj if changed is None else changed
    violations = traj.validate(**kwargs)
    assert name in _names(violations), violations
    assert all(v.detail for v in violations)


def test_an_infra_failure_without_tokens_is_valid_for_intake() -> None:
    # A rollout whose environment never answered Reset publishes an INFRA_FAILURE with no tokens:
    # an infrastructure outcome (failed_infra), not malformed input (quarantined).
    traj = _clear_tokens(_build_valid())
    traj.finish(pb.INFRA_FAILURE)
    assert traj.validate(vocab_size=VOCAB_SIZE, learner_version=5) == []
    from trajmesh.services.store.intake import judge

    task = {"group_id": traj.pb.group_id, "group_size": 4}
    verdict = judge(traj.to_bytes(), task, vocab_size=VOCAB_SIZE, learner_version=5)
    assert (verdict.outcome, verdict.reason, verdict.member) == ("failed_infra", "infra_failure", True)


def test_two_problems_are_both_reported() -> None:
    traj = _build_valid()
    traj.pb.ClearField("task_id")
    _set("behavior_logprobs", 4, 0.5)(traj)
    assert sorted(_names(traj.validate())) == ["logprob_positive", "missing_task_id"]


def test_length_mismatch_does_not_hide_per_token_problems() -> None:
    traj = old_layout(_build_valid())
    traj.pb.behavior_versions.append(-1)
    traj.pb.behavior_logprobs[3] = math.inf
    traj = Trajectory(traj.pb)
    assert sorted(_names(traj.validate())) == ["length_mismatch", "logprob_not_finite"]


def test_infra_failure_may_have_no_action_tokens() -> None:
    traj = Trajectory.new(_build_task())
    traj.append_prompt([1, 2])
    traj.finish(pb.INFRA_FAILURE)
    assert traj.validate() == []


def test_non_finite_reward_component_is_reported() -> None:
    traj = _build_valid()
    traj.pb.raw_reward_components["format"] = math.nan
    (violation,) = traj.validate()
    assert violation.name == "reward_not_finite" and "format" in violation.detail


def test_unknown_terminal_reason_is_reported() -> None:
    traj = _build_valid()
    traj.pb.MergeFromString(bytes([0xA0, 0x01, 42]))  # field 20 (varint tag 160) = 42, an unknown enum value
    assert "terminal_reason_unspecified" in _names(traj.validate())
