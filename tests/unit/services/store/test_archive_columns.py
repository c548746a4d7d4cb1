"""The Parquet archive keeps a segmented trajectory's sequence starts, and still reads part files
written before that column existed (issue 10 follow-up: the archive lacked `sequence_starts`)."""

from __future__ import annotations

from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

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


def test_parts_written_before_the_column_still_read(tmp_path: Path) -> None:
    old_schema = pa.schema([f for f in SCHEMA if f.name != "sequence_starts"])
    row = {name: None for name in old_schema.names}
    row.update(seq=1, writer="old", trajectory_id="t-old", outcome="trained", token_ids=[7, 8])
    pq.write_table(pa.Table.from_pylist([row], schema=old_schema), tmp_path / "part-old-0-000000.parquet")
    w = ArchiveWriter(tmp_path, writer="new")
    w.append(trajectory_id="t-new", outcome="trained", token_ids=[9], sequence_starts=[0])
    w.close()
    rows = final_outcomes(read_archive(tmp_path))
    assert rows["t-old"]["token_ids"] == [7, 8] and rows["t-old"]["sequence_starts"] is None
    assert rows["t-new"]["sequence_starts"] == [0]
