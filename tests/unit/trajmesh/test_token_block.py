"""The packed columnar token block (trajmesh/token_block.py): exact round trips, views without a
copy, and every way a block can be damaged named by `decode` and by `Trajectory.validate`."""

from __future__ import annotations

import struct
import zlib

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from trajmesh import token_block
from trajmesh.contract import ContractError, Trajectory
from trajmesh.token_block import BlockError, TokenColumns
from trajmesh.v1 import trajectory_pb2 as pb


def _build_columns(n: int, *, teacher: bool = False, wide: bool = False) -> TokenColumns:
    rng = np.random.default_rng(n)
    mask_T = (np.arange(n) >= n // 3).astype(np.uint8)
    versions_T = np.where(mask_T == 1, rng.integers(0, 50, n), -1).astype(np.int64)
    if wide and n:
        versions_T[-1] = 2**40
    return TokenColumns(rng.integers(0, 2**32, n, dtype=np.uint64).astype(np.uint32), mask_T,
                        np.where(mask_T == 1, -rng.random(n), 0.0).astype(np.float32), versions_T,
                        rng.random(n).astype(np.float32) if teacher else None)


def _assert_columns_equal(a: TokenColumns, b: TokenColumns) -> None:
    np.testing.assert_array_equal(a.token_ids_T, b.token_ids_T)
    np.testing.assert_array_equal(a.loss_mask_T, b.loss_mask_T)
    np.testing.assert_array_equal(a.behavior_logprobs_T.view(np.uint32), b.behavior_logprobs_T.view(np.uint32))
    np.testing.assert_array_equal(a.behavior_versions_T, b.behavior_versions_T)
    if a.teacher_logprobs_T is None:
        assert b.teacher_logprobs_T is None
    else:
        assert b.teacher_logprobs_T is not None
        np.testing.assert_array_equal(a.teacher_logprobs_T.view(np.uint32), b.teacher_logprobs_T.view(np.uint32))


@settings(max_examples=100, deadline=None)
@given(st.integers(0, 3000), st.booleans(), st.booleans())
def test_round_trip_is_exact(n: int, teacher: bool, wide: bool) -> None:
    cols = _build_columns(n, teacher=teacher, wide=wide)
    block = token_block.encode(cols)
    per_token = (8 if wide and n else 4) + 4 + (4 if teacher else 0) + 4 + 1
    assert len(block) == token_block.HEADER.size + n * per_token
    _assert_columns_equal(cols, token_block.decode(block))


def test_the_bytes_are_the_documented_layout() -> None:
    """The block is a wire format other processes (and archives) read: built here by hand from the
    module docstring's layout, field by field, so a change to the layout fails this test."""
    cols = TokenColumns(np.array([7, 70000], np.uint32), np.array([0, 1], np.uint8),
                        np.array([0.0, -0.5], np.float32), np.array([-1, 3], np.int64), np.array([0.0, -2.0], np.float32))
    body = (struct.pack("<2i", -1, 3) + struct.pack("<2f", 0.0, -0.5) + struct.pack("<2f", 0.0, -2.0)
            + struct.pack("<2I", 7, 70000) + bytes([0, 1]))
    header = b"TMTB" + bytes([1, 0b11111, 1, 4]) + struct.pack("<2I", 2, zlib.crc32(body))
    assert token_block.encode(cols) == header + body


def test_views_read_the_block_without_a_copy() -> None:
    block = token_block.encode(_build_columns(4096, teacher=True))
    back = token_block.decode(block)
    for view in (back.token_ids_T, back.loss_mask_T, back.behavior_logprobs_T, back.behavior_versions_T,
                 back.teacher_logprobs_T):
        assert view is not None and view.base is block and not view.flags.writeable


def test_versions_beyond_int32_keep_int64() -> None:
    narrow, wide = _build_columns(10), _build_columns(10, wide=True)
    assert token_block.decode(token_block.encode(narrow)).behavior_versions_T.dtype == np.int32
    back = token_block.decode(token_block.encode(wide))
    assert back.behavior_versions_T.dtype == np.int64 and int(back.behavior_versions_T[-1]) == 2**40


def test_encode_refuses_values_its_columns_cannot_hold() -> None:
    cols = _build_columns(4)
    with pytest.raises(ValueError, match="loss_mask"):
        token_block.encode(TokenColumns(cols.token_ids_T, np.array([0, 1, 256, 1]), cols.behavior_logprobs_T,
                                        cols.behavior_versions_T))
    with pytest.raises(ValueError, match="token_ids"):
        token_block.encode(TokenColumns(np.array([0, 1, 2, 2**32]), cols.loss_mask_T, cols.behavior_logprobs_T,
                                        cols.behavior_versions_T))
    with pytest.raises(ValueError, match="values"):
        token_block.encode(TokenColumns(cols.token_ids_T, cols.loss_mask_T[:3], cols.behavior_logprobs_T,
                                        cols.behavior_versions_T))


def _header(block: bytes, **fields: int | bytes) -> bytes:
    names = ("magic", "format", "columns", "mask_size", "versions_size", "T", "crc")
    values = dict(zip(names, token_block.HEADER.unpack_from(block), strict=True))
    values.update(fields)
    return token_block.HEADER.pack(*(values[n] for n in names)) + block[token_block.HEADER.size:]


def _flip(block: bytes, at: int) -> bytes:
    out = bytearray(block)
    out[at] ^= 0x40
    return bytes(out)


GOOD = token_block.encode(_build_columns(100, teacher=True))
DAMAGED: dict[str, tuple[bytes, str]] = {
    "a byte of a column flipped": (_flip(GOOD, len(GOOD) - 150), token_block.CHECKSUM),
    "the checksum itself changed": (_header(GOOD, crc=12345), token_block.CHECKSUM),
    "truncated by one byte": (GOOD[:-1], token_block.LENGTH),
    "truncated inside the header": (GOOD[:10], token_block.MALFORMED),
    "empty": (b"", token_block.MALFORMED),
    "one byte too many": (GOOD + b"\0", token_block.LENGTH),
    "T larger than the columns": (_header(GOOD, T=101), token_block.LENGTH),
    "T smaller than the columns": (_header(GOOD, T=99), token_block.LENGTH),
    "T near 2**32": (_header(GOOD, T=2**32 - 1), token_block.LENGTH),
    "another magic": (_header(GOOD, magic=b"TMXX"), token_block.MALFORMED),
    "a newer format": (_header(GOOD, format=token_block.FORMAT + 1), token_block.MALFORMED),
    "a required column missing": (_header(GOOD, columns=0b11110), token_block.MALFORMED),
    "an unknown column": (_header(GOOD, columns=0b111111), token_block.MALFORMED),
    "a 4-byte mask": (_header(GOOD, mask_size=4), token_block.MALFORMED),
    "2-byte versions": (_header(GOOD, versions_size=2), token_block.MALFORMED),
}


@pytest.mark.parametrize("case", sorted(DAMAGED))
def test_a_damaged_block_is_named(case: str) -> None:
    block, name = DAMAGED[case]
    with pytest.raises(BlockError) as err:
        token_block.decode(block)
    assert err.value.name == name and err.value.detail


def _build_trajectory() -> Trajectory:
    traj = Trajectory.new(pb.Task(task_id="task-1", group_id="g"), trajectory_id="t-1")
    traj.append_prompt(list(range(1, 40)))
    traj.append_sampled(list(range(40, 140)), [-0.5] * 100, 3)
    traj.finish(pb.EOS)
    traj.set_reward(1.0)
    return traj


@pytest.mark.parametrize("case", sorted(DAMAGED))
def test_validate_names_a_damaged_block_and_the_views_refuse_it(case: str) -> None:
    block, name = DAMAGED[case]
    traj = _build_trajectory()
    traj.pb.token_block = block
    data = traj.to_bytes()
    back = Trajectory.from_bytes(data) if block else Trajectory(pb.Trajectory.FromString(data))
    names = [v.name for v in back.validate(vocab_size=1000, learner_version=3)]
    if not block:  # no block at all reads as a record without tokens
        assert names == ["empty_tokens", "no_action_tokens", "span_out_of_range"]
        return
    assert names == [name]
    assert len(back) == 0 or name == token_block.CHECKSUM  # len never raises
    if name != token_block.CHECKSUM:  # a sound layout with a bad checksum still has views
        with pytest.raises(ContractError, match=name):
            back.token_ids_T  # noqa: B018


def test_validate_checks_the_checksum_of_the_bytes_it_reads() -> None:
    traj = _build_trajectory()
    data = traj.to_bytes()
    at = data.index(traj.token_block) + len(traj.token_block) - 1  # the last mask byte
    back = Trajectory.from_bytes(_flip(data, at))
    assert [v.name for v in back.validate()] == [token_block.CHECKSUM]
    assert Trajectory.from_bytes(data).validate() == []


def test_appends_are_packed_once_when_the_message_is_read() -> None:
    traj = Trajectory.new(trajectory_id="t")
    traj.append_prompt([1, 2, 3])
    for turn in range(5):
        traj.append_sampled([4, 5], [-1.0, -2.0], turn, turn_index=turn)
        traj.append_observation([6], turn_index=turn)
    assert len(traj) == 3 + 5 * 3 and traj._pending  # nothing packed yet
    block = traj.token_block
    assert not traj._pending
    assert struct.unpack_from("<I", block, 8)[0] == len(traj)
    np.testing.assert_array_equal(traj.behavior_versions_T[traj.loss_mask_T == 1], [0, 0, 1, 1, 2, 2, 3, 3, 4, 4])


def test_tokens_cannot_be_appended_after_a_teacher_scored_them() -> None:
    traj = _build_trajectory()
    traj.set_teacher_logprobs(np.full(len(traj), -0.5), "teacher@1")
    with pytest.raises(ContractError, match="teacher"):
        traj.append_observation([1])
