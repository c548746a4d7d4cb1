"""The Parquet archive keeps a segmented trajectory's sequence starts and a graded trajectory's raw
reward components with its grader's revision, and still reads part files written before those
columns existed (issue 10 follow-up: the archive lacked `sequence_starts`; issue 27: a rubric's
components reached the trajectory but not the archive)."""

from __future__ import annotations

from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from trajmesh.services.store.archive import SCHEMA, ArchiveWriter, final_outcomes, read_archive


def test_sequence_starts_round_trip(tmp_path: Path) -> None:
    w = ArchiveWriter(tmp_path, writer="store0")
    w.append(trajectory_id="seg", outcome="trained", token_ids=[1, 2, 3, 4, 5, 6], sequence_starts=[0, 4])
    w.append(trajectory_id="one", outcome="trained", token_ids=[1, 2], sequence_starts=[])
    w.append(trajectory_id="bare", outcome="filtered")  # a row without token data
    w.close()
    rows = final_outcomes(read_archive(tmp_path))
    assert rows["seg"]["sequence_starts"] == [0, 4]
    assert rows["one"]["sequence_starts"] == []
    assert rows["bare"]["sequence_starts"] is None


def test_reward_components_and_grader_revision_round_trip(tmp_path: Path) -> None:
    w = ArchiveWriter(tmp_path, writer="store0")
    w.append(trajectory_id="rubric", outcome="accepted", reward=1.5, grader_revision="verifiers-v1",
             reward_components={"correct": 1.0, "mentions_answer": 1.0, "rubric_error": 0.0})
    w.append(trajectory_id="none", outcome="accepted", reward=0.0, reward_components={})
    w.append(trajectory_id="bare", outcome="quarantined")  # bytes that never parsed: no grade
    w.close()
    rows = final_outcomes(read_archive(tmp_path))
    assert dict(rows["rubric"]["reward_components"]) == {"correct": 1.0, "mentions_answer": 1.0, "rubric_error": 0.0}
    assert rows["rubric"]["grader_revision"] == "verifiers-v1"
    assert dict(rows["none"]["reward_components"]) == {}
    assert rows["bare"]["reward_components"] is None and rows["bare"]["grader_revision"] is None


NEWER_COLUMNS = {"sequence_starts": ([0], [0]), "reward_components": ({"correct": 1.0}, [("correct", 1.0)]),
                 "grader_revision": ("g-v2", "g-v2"), "roc_tool_error_score": (0.25, 0.25),
                 "roc_format_score": (1.0, 1.0)}
"""Columns added after the first archives: what a new row writes, and what it reads back as."""


@pytest.mark.parametrize("column", sorted(NEWER_COLUMNS))
def test_parts_written_before_the_column_still_read(tmp_path: Path, column: str) -> None:
    old_schema = pa.schema([f for f in SCHEMA if f.name != column])
    row = {name: None for name in old_schema.names}
    row.update(seq=1, writer="old", trajectory_id="t-old", outcome="trained", token_ids=[7, 8])
    pq.write_table(pa.Table.from_pylist([row], schema=old_schema), tmp_path / "part-old-0-000000.parquet")
    written, read_back = NEWER_COLUMNS[column]
    w = ArchiveWriter(tmp_path, writer="new")
    w.append(trajectory_id="t-new", outcome="trained", token_ids=[9], **{column: written})
    w.close()
    rows = final_outcomes(read_archive(tmp_path))
    assert rows["t-old"]["token_ids"] == [7, 8] and rows["t-old"][column] is None
    assert rows["t-new"][column] == read_back
