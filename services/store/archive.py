"""Append-only Parquet archive of every trajectory record the store sees.

Parquet files are immutable, so "append" means: rows are buffered and written as a new part file
(`part-<worker>-<seq>.parquet`, written to a temp name then renamed) every `flush_rows` rows, every
`flush_seconds`, and on close. A record is one row; a trajectory may have several rows over its
life (``accepted`` at intake, then ``trained`` or ``quarantined`` once the learner reports) and its
final outcome is its last row by `seq`. Readers use `read_archive` / `final_outcomes`.

A trajectory's per-token arrays are archived as its token block, as it came (one binary column,
`token_block`: no Python object per token); `read_archive` unpacks each block into the per-token
list columns, so a reader sees the same columns for parts written before the block (which hold the
lists themselves) and after.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from trajmesh import token_block

OUTCOMES = ("accepted", "trained", "filtered", "quarantined", "failed_infra", "in_flight_at_stop", "duplicate")
"""accepted is intermediate; the others are final (duplicate rows are not admissions;
in_flight_at_stop: admitted, still in flight when a finished run stopped)."""

SCHEMA = pa.schema(
    [
        ("seq", pa.int64()),
        ("written_unix_seconds", pa.float64()),
        ("writer", pa.string()),
        ("trajectory_id", pa.string()),
        ("task_id", pa.string()),
        ("group_id", pa.string()),
        ("task_source", pa.string()),
        ("manifest_id", pa.string()),
        ("outcome", pa.string()),
        ("reason", pa.string()),
        ("reward", pa.float64()),
        ("terminal_reason", pa.string()),
        ("learner_version", pa.int64()),
        ("num_tokens", pa.int64()),
        ("num_action_tokens", pa.int64()),
        ("token_ids", pa.list_(pa.uint32())),
        ("loss_mask", pa.list_(pa.uint8())),
        ("behavior_versions", pa.list_(pa.int64())),
        ("behavior_logprobs", pa.list_(pa.float32())),
        ("sequence_starts", pa.list_(pa.int64())),
        ("step_rewards", pa.list_(pa.float64())),
        ("teacher_logprobs", pa.list_(pa.float32())),
        ("teacher", pa.string()),
        ("reward_components", pa.map_(pa.string(), pa.float64())),
        ("grader_revision", pa.string()),
        ("verifier_output", pa.string()),
        ("roc_tool_error_score", pa.float64()),
        ("roc_format_score", pa.float64()),
        ("payload_sha256", pa.string()),
        ("token_block", pa.binary()),
    ]
)


class ArchiveWriter:
    """Buffers rows and writes them as Parquet part files under `directory`."""

    def __init__(self, directory: str | Path, writer: str, *, flush_rows: int = 256, flush_seconds: float = 2.0):
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        self.writer = writer
        self.flush_rows = flush_rows
        self.flush_seconds = flush_seconds
        self._rows: list[dict[str, Any]] = []
        self._part = 0
        self._seq = time.time_ns()  # monotone across restarts of the writer
        self._started_ns = self._seq
        self._last_flush = time.monotonic()

    def append(self, **row: Any) -> None:
        self._seq += 1
        full: dict[str, Any] = {name: None for name in SCHEMA.names}
        full.update(row)
        full["seq"] = self._seq
        full["written_unix_seconds"] = time.time()
        full["writer"] = self.writer
        if full["outcome"] not in OUTCOMES:
            raise ValueError(f"unknown archive outcome {full['outcome']!r}")
        for name, dtype in _LIST_COLUMNS.items():
            if full[name] is not None:
                full[name] = np.asarray(full[name], dtype=dtype)
        self._rows.append(full)
        if len(self._rows) >= self.flush_rows or time.monotonic() - self._last_flush > self.flush_seconds:
            self.flush()

    def flush(self) -> None:
        self._last_flush = time.monotonic()
        if not self._rows:
            return
        table = _to_table(self._rows)
        # The start stamp keeps a restarted writer (same name) from overwriting its predecessor's parts.
        name = f"part-{self.writer}-{self._started_ns}-{self._part:06d}.parquet"
        tmp = self.directory / f".{name}.tmp"
        pq.write_table(table, tmp)
        os.replace(tmp, self.directory / name)
        self._part += 1
        self._rows = []

    def close(self) -> None:
        self.flush()


_LIST_COLUMNS: dict[str, Any] = {
    "token_ids": np.uint32, "loss_mask": np.uint8, "behavior_versions": np.int64, "behavior_logprobs": np.float32,
    "sequence_starts": np.int64, "step_rewards": np.float64, "teacher_logprobs": np.float32,
}
"""``sequence_starts``: where each of a segmented trajectory's sequences starts in ``token_ids``
(an agent's calls that do not extend one another, one training row each); empty for one sequence.
``step_rewards``: the environment's reward of each step, in turn order (empty: none stepped).
``teacher_logprobs`` / ``teacher``: on-policy distillation's teacher log-prob of each token and the
teacher's ``name@revision`` (empty / empty string: no teacher scored it).
``reward_components`` (a map column beside these): the grader's raw reward components, by name (a
rubric's functions, ``correct`` / ``format_eos``, a game's ``step_<k>``), with ``grader_revision``
and ``verifier_output`` (the grader's raw output: a judge's JSON verdict with its raw answer,
graders/judge.py; ``judge_error: …`` on an INFRA_FAILURE the judge caused).
``roc_tool_error_score`` / ``roc_format_score``: the two scores GRPO-RoC selected a member of its
group by (services/store/roc.py; null where RoC did not decide), on its ``accepted`` or
``filtered`` row, whose reason says the decision. Parts written before a column existed read it as null."""


_PER_TOKEN_COLUMNS = ("token_ids", "loss_mask", "behavior_versions", "behavior_logprobs", "teacher_logprobs")
"""The list columns a row's token block unpacks into (`read_archive`)."""


def _list_array(values: list[Any], dtype: Any) -> pa.Array:
    """A list column from one numpy array (or None) per row, as offsets + values."""
    lengths = np.array([0 if v is None else len(v) for v in values], dtype=np.int64)
    offsets = np.zeros(len(values) + 1, dtype=np.int32)
    np.cumsum(lengths, out=offsets[1:])
    flat = np.concatenate([v for v in values if v is not None] or [np.zeros(0, dtype=dtype)])
    mask = pa.array([v is None for v in values])
    return pa.ListArray.from_arrays(pa.array(offsets), pa.array(flat.astype(dtype, copy=False)), mask=mask)


def _to_table(rows: list[dict[str, Any]]) -> pa.Table:
    """Columns built from numpy (list columns as offsets + values): ~100x faster than from_pylist
    for 4k-token trajectories."""
    columns = []
    for field in SCHEMA:
        values = [r[field.name] for r in rows]
        if field.name in _LIST_COLUMNS:
            columns.append(_list_array(values, _LIST_COLUMNS[field.name]))
        else:
            columns.append(pa.array(values, type=field.type))
    return pa.Table.from_arrays(columns, schema=SCHEMA)


def read_archive(directory: str | Path) -> pa.Table:
    """All rows of all part files, sorted by seq, each row's token block unpacked into the
    per-token list columns."""
    files = sorted(Path(directory).glob("part-*.parquet"))
    if not files:
        return SCHEMA.empty_table()
    table = pa.concat_tables([pq.read_table(f, schema=SCHEMA) for f in files])
    return unpack_blocks(table.sort_by("seq"))


def unpack_blocks(table: pa.Table) -> pa.Table:
    """`table` with the per-token list columns of every row that has a token block filled from
    it (rows without one, written before the block, keep their lists). A block that does not
    read (a quarantined record's) leaves that row's lists null."""
    blocks = table.column("token_block").to_pylist()
    if not any(blocks):
        return table
    unpacked: list[token_block.TokenColumns | None] = []
    for block in blocks:
        try:
            unpacked.append(token_block.decode(block) if block else None)
        except token_block.BlockError:
            unpacked.append(None)
    for name in _PER_TOKEN_COLUMNS:
        old = table.column(name).combine_chunks()
        values: list[Any] = []
        for i, (block, cols) in enumerate(zip(blocks, unpacked, strict=True)):
            if not block:
                values.append(None if not old[i].is_valid else old[i].values.to_numpy(zero_copy_only=False))
            elif cols is None:
                values.append(None)
            else:
                array = getattr(cols, f"{name}_T")
                values.append(np.zeros(0, _LIST_COLUMNS[name]) if array is None else array)
        table = table.set_column(table.schema.get_field_index(name), name, _list_array(values, _LIST_COLUMNS[name]))
    return table


def final_outcomes(table: pa.Table) -> dict[str, dict[str, Any]]:
    """trajectory_id → its last non-duplicate row (as a dict)."""
    out: dict[str, dict[str, Any]] = {}
    for row in table.to_pylist():
        if row["outcome"] == "duplicate" or not row["trajectory_id"]:
            continue
        out[row["trajectory_id"]] = row
    return out
