"""The packed columnar token block: a trajectory's per-token arrays as one bytes value
(`Trajectory.token_block`, field 34 of `trajmesh.v1.Trajectory`; docs/DESIGN.md §2).

The rollout packs the engine's arrays once; the grader and the store pass the bytes through; the
store checks the header and checksum and archives the block as it came; the learner's batch is
filled from numpy views of it (`np.frombuffer`: no copy, no Python object per token).

Layout (little-endian throughout)::

    header (16 bytes)   magic b"TMTB" | format u8 | columns u8 | mask itemsize u8 | versions itemsize u8 |
                        T u32 | crc32 u32
    columns, in order   behavior_versions int32[T] or int64[T] | behavior_logprobs float32[T] |
                        teacher_logprobs float32[T] (when its bit is set) | token_ids uint32[T] | loss_mask uint8[T]

`columns` is a bit set (`COLUMN_BITS`); the four per-token arrays every trajectory has are always
present, the teacher's log-probs only when a teacher scored it. The versions are int32 when every
one fits (policy versions are step counts: always, in practice), else int64, as the header says:
13 bytes a token, so a 64k-token trajectory stays under NATS's default 1 MiB payload. The crc32
(zlib's) covers every column byte after the header. Widest first, so each column starts aligned
to its element size when the block does. A new format (another dtype, another column) takes a new `FORMAT`; readers
refuse a format they do not know (`token_block_malformed`), so old readers never misread a block.

This module must import without torch (STYLE.md habit 6).
"""

from __future__ import annotations

import struct
import zlib
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt

MAGIC = b"TMTB"
FORMAT = 1
"""The layout above. A reader refuses any other (a writer that changes the layout raises it)."""

HEADER = struct.Struct("<4sBBBBII")
"""magic, format, columns, mask itemsize, versions itemsize, T, crc32: 16 bytes."""

COLUMN_BITS: dict[str, int] = {
    "token_ids": 1, "loss_mask": 2, "behavior_logprobs": 4, "behavior_versions": 8, "teacher_logprobs": 16,
}
REQUIRED_COLUMNS = 1 | 2 | 4 | 8
_ORDER: tuple[tuple[str, np.dtype[Any]], ...] = (
    ("behavior_versions", np.dtype("<i8")),  # or <i4 (the header's versions itemsize)
    ("behavior_logprobs", np.dtype("<f4")),
    ("teacher_logprobs", np.dtype("<f4")),
    ("token_ids", np.dtype("<u4")),
    ("loss_mask", np.dtype("u1")),
)
"""The columns in block order, each with its dtype (widest first)."""

# The names `Trajectory.validate` reports for a block it cannot read (trajmesh/contract.py VIOLATION_NAMES).
MALFORMED = "token_block_malformed"
"""Shorter than its header, another magic or format, a required column missing, an unknown one."""
LENGTH = "token_block_length"
"""Its byte length is not the header's plus T elements of every column present (truncated, bad T)."""
CHECKSUM = "token_block_checksum"
"""The column bytes do not match the header's crc32."""


class BlockError(ValueError):
    """A block that cannot be read; `name` is one of MALFORMED, LENGTH, CHECKSUM."""

    def __init__(self, name: str, detail: str) -> None:
        super().__init__(f"{name}: {detail}")
        self.name = name
        self.detail = detail


@dataclass(frozen=True)
class TokenColumns:
    """A trajectory's per-token arrays. From a block they are read-only views of its bytes; from a
    record without one (the repeated fields), copies, whose lengths may disagree."""

    token_ids_T: npt.NDArray[Any]
    loss_mask_T: npt.NDArray[Any]
    behavior_logprobs_T: npt.NDArray[np.float32]
    behavior_versions_T: npt.NDArray[np.signedinteger[Any]]
    teacher_logprobs_T: npt.NDArray[np.float32] | None = None

    @property
    def num_tokens(self) -> int:
        return int(self.token_ids_T.size)


def empty_columns() -> TokenColumns:
    return TokenColumns(np.zeros(0, np.uint32), np.zeros(0, np.uint8), np.zeros(0, np.float32),
                        np.zeros(0, np.int64))


def concat_columns(parts: list[TokenColumns]) -> TokenColumns:
    """The columns of `parts` one after another (a trajectory's turns); a teacher column only
    when every part has one."""
    if len(parts) == 1:
        return parts[0]
    teachers = [p.teacher_logprobs_T for p in parts]
    return TokenColumns(
        np.concatenate([p.token_ids_T for p in parts]).astype(np.uint32, copy=False),
        np.concatenate([p.loss_mask_T for p in parts]),
        np.concatenate([p.behavior_logprobs_T for p in parts]).astype(np.float32, copy=False),
        np.concatenate([p.behavior_versions_T for p in parts]).astype(np.int64, copy=False),
        None if any(t is None for t in teachers) else np.concatenate(teachers).astype(np.float32, copy=False),  # type: ignore[arg-type]
    )


def encode(columns: TokenColumns) -> bytes:
    """The block of `columns` (all of one length T < 2**32; mask values must fit uint8)."""
    n = columns.num_tokens
    arrays = {"token_ids": columns.token_ids_T, "loss_mask": columns.loss_mask_T,
              "behavior_logprobs": columns.behavior_logprobs_T, "behavior_versions": columns.behavior_versions_T,
              "teacher_logprobs": columns.teacher_logprobs_T}
    bits, parts = 0, []
    versions_T = columns.behavior_versions_T
    narrow = not versions_T.size or (int(versions_T.min()) >= -(2**31) and int(versions_T.max()) < 2**31)
    for name, dtype in _ORDER:
        values = arrays[name]
        if values is None:
            continue
        if name == "behavior_versions" and narrow:
            dtype = np.dtype("<i4")
        if values.size != n:
            raise ValueError(f"token block: {name} has {values.size} values, token_ids {n}")
        if dtype.kind == "u" and values.dtype != dtype and values.size:
            lo, hi = int(values.min()), int(values.max())
            if lo < 0 or hi > np.iinfo(dtype).max:
                raise ValueError(f"token block: {name} values [{lo}, {hi}] do not fit {dtype.name}")
        bits |= COLUMN_BITS[name]
        parts.append(np.ascontiguousarray(values, dtype=dtype).reshape(-1))
    if n > 0xFFFF_FFFF:
        raise ValueError(f"token block: {n} tokens do not fit its uint32 T")
    crc = 0
    for p in parts:
        crc = zlib.crc32(p.data, crc)
    return b"".join([HEADER.pack(MAGIC, FORMAT, bits, 1, 4 if narrow else 8, n, crc), *(p.data for p in parts)])


def decode(block: bytes, *, check_crc: bool = True) -> TokenColumns:
    """Read-only numpy views of `block`'s columns (no copy); raises BlockError when it cannot be
    read. `check_crc=False` skips the checksum (a block this process encoded itself)."""
    if len(block) < HEADER.size:
        raise BlockError(MALFORMED, f"{len(block)} byte(s), shorter than the {HEADER.size}-byte header")
    magic, fmt, bits, mask_size, versions_size, n, crc = HEADER.unpack_from(block)
    if magic != MAGIC or fmt != FORMAT:
        raise BlockError(MALFORMED, f"magic {magic!r} format {fmt}: not a format-{FORMAT} token block")
    if bits & REQUIRED_COLUMNS != REQUIRED_COLUMNS or bits & ~0x1F or mask_size != 1 or versions_size not in (4, 8):
        raise BlockError(MALFORMED, f"columns {bits:#x}, mask itemsize {mask_size}, versions itemsize "
                                    f"{versions_size}: not a layout this reader knows")
    present = [(name, np.dtype(f"<i{versions_size}") if name == "behavior_versions" else dtype)
               for name, dtype in _ORDER if bits & COLUMN_BITS[name]]
    want = HEADER.size + n * sum(dtype.itemsize for _, dtype in present)
    if len(block) != want:
        raise BlockError(LENGTH, f"{len(block)} byte(s) for T={n}, which takes {want}")
    if check_crc and zlib.crc32(memoryview(block)[HEADER.size:]) != crc:
        raise BlockError(CHECKSUM, f"crc32 of the columns is not the header's {crc:#010x}")
    views: dict[str, Any] = {}
    offset = HEADER.size
    for name, dtype in present:
        views[name] = np.frombuffer(block, dtype=dtype, count=n, offset=offset)
        offset += n * dtype.itemsize
    return TokenColumns(views["token_ids"], views["loss_mask"], views["behavior_logprobs"],
                        views["behavior_versions"], views.get("teacher_logprobs"))
