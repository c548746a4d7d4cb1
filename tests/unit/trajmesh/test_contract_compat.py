"""Records written before the token block still read, validate, train and archive (the contract's
version rule, docs/DESIGN.md §2): bytes and a Parquet part the code at 0fc7a69 wrote
(tests/fixtures/contract_v1/, with the script that wrote them), read by today's code beside the same
trajectories built today, in the block."""

from __future__ import annotations

import importlib.util
import shutil
from pathlib import Path

import numpy as np
import pytest
from repo_paths import REPO

from trajmesh.contract import Trajectory
from trajmesh.services.store.archive import ArchiveWriter, final_outcomes, read_archive
from trajmesh.services.store.intake import OUTCOME_VALID, judge
from trajmesh.v1 import services_pb2

FIXTURES = REPO / "tests" / "fixtures" / "contract_v1"


def _generator():  # type: ignore[no-untyped-def]
    spec = importlib.util.spec_from_file_location("contract_v1_generate", FIXTURES / "generate.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _old() -> list[Trajectory]:
    resp = services_pb2.NextBatchResponse.FromString((FIXTURES / "trajectories.bin").read_bytes())
    return [Trajectory(pb) for pb in resp.trajectories]


def _new() -> list[Trajectory]:
    """The same trajectories built by today's code (their arrays in the block)."""
    return [Trajectory.from_bytes(t.to_bytes()) for t in _generator().build()]


def test_old_records_have_no_block_and_new_ones_only_the_block() -> None:
    for old, new in zip(_old(), _new(), strict=True):
        assert not old.pb.token_block and len(old.pb.token_ids) == len(old) > 0
        assert new.pb.token_block and not new.pb.token_ids and not new.pb.teacher_logprobs


def test_old_records_read_as_the_same_arrays() -> None:
    for old, new in zip(_old(), _new(), strict=True):
        assert len(old) == len(new)
        for name in ("token_ids_T", "loss_mask_T", "behavior_versions_T"):
            np.testing.assert_array_equal(getattr(old, name), getattr(new, name))
        np.testing.assert_array_equal(old.behavior_logprobs_T.view(np.uint32), new.behavior_logprobs_T.view(np.uint32))
        if new.teacher_logprobs_T is None:
            assert old.teacher_logprobs_T is None
        else:
            np.testing.assert_array_equal(old.teacher_logprobs_T, new.teacher_logprobs_T)
        assert list(old.spans) == list(new.spans) and old.segment_bounds() == new.segment_bounds()
        assert old.pb.prompt_length == new.pb.prompt_length and old.reward == new.reward


def test_old_records_validate_and_pass_intake() -> None:
    for old in _old():
        assert old.validate(vocab_size=1000, learner_version=5) == []
        verdict = judge(old.to_bytes(), {"group_id": old.group_id}, vocab_size=1000, learner_version=5)
        assert (verdict.outcome, verdict.reason) == (OUTCOME_VALID, "")


def test_old_records_train_as_the_new_ones_do() -> None:
    pytest.importorskip("torch")
    import torch

    from trajmesh.learner.advantages import teacher_logprobs_BT
    from trajmesh.learner.step import build_batch

    old, new = _old(), _new()
    a, b = build_batch(old, pad_id=0), build_batch(new, pad_id=0)
    for field in ("input_ids_BT", "attention_BT", "mask_BT", "behavior_logp_BT", "versions_BT", "reward_B",
                  "action_type_BT"):
        assert torch.equal(getattr(a, field), getattr(b, field)), field
    assert int(a.mask_BT.sum()) == sum(int((t.loss_mask_T == 1).sum()) for t in old)
    for x, y in zip(teacher_logprobs_BT(a, old), teacher_logprobs_BT(b, new), strict=True):
        assert torch.equal(x, y)


def test_an_archive_written_before_the_block_reads_beside_a_new_one(tmp_path: Path) -> None:
    shutil.copytree(FIXTURES / "archive", tmp_path, dirs_exist_ok=True)
    new = {t.trajectory_id: t for t in _new()}
    writer = ArchiveWriter(tmp_path, "new")
    for t in new.values():
        writer.append(trajectory_id=t.trajectory_id + "-new", outcome="trained", learner_version=5,
                      token_block=t.token_block, num_tokens=len(t), sequence_starts=[], step_rewards=[])
    writer.close()
    rows = final_outcomes(read_archive(tmp_path))
    assert len(rows) == 2 * len(new)
    for tid, t in new.items():
        old_row, new_row = rows[tid], rows[tid + "-new"]
        assert old_row["token_block"] is None and new_row["token_block"] == t.token_block
        for column in ("token_ids", "loss_mask", "behavior_versions", "behavior_logprobs", "teacher_logprobs"):
            assert old_row[column] == new_row[column], column
        assert new_row["token_ids"] == t.token_ids_T.tolist()
