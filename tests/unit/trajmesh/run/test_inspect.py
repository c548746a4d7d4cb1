"""`trajmesh inspect RUN_DIR` on a run dir written with the real archive writer and manifest builder."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from google.protobuf.json_format import MessageToDict

from trajmesh.run.cli import main
from trajmesh.run.inspect import format_report, inspect_run
from trajmesh.run.manifest import build_manifest
from trajmesh.services.store.archive import ArchiveWriter
from trajmesh.stoprules import RuleBreach, stop_record, write_stop_reason


def _build_run(run: Path) -> str:
    run.mkdir()
    manifest = build_manifest(code_commit="abc123", config={"seed": 0}, model_revision="m1", tokenizer_revision="t1",
                              chat_template="", environment_revisions={"chain_sum": "v1"},
                              grader_revisions={"reasoning_gym": "g1"}, algorithm={"eta": 1})
    (run / "manifest.json").write_text(json.dumps(MessageToDict(manifest, preserving_proto_field_name=True)))
    mid = manifest.manifest_id
    w = ArchiveWriter(run / "archive", writer="store0")

    def intake(tid: str, reward: float, versions: list[int], outcome: str = "accepted", reason: str = "") -> None:
        w.append(trajectory_id=tid, task_id="t", group_id="g", task_source="chain_sum", manifest_id=mid,
                 outcome=outcome, reason=reason, reward=reward, terminal_reason="EOS", learner_version=-1,
                 num_tokens=5, num_action_tokens=2, token_ids=[1, 2, 3, 4, 5], loss_mask=[0, 0, 0, 1, 1],
                 behavior_versions=[-1, -1, -1, *versions], behavior_logprobs=[0, 0, 0, -0.5, -0.1])

    intake("a", 1.0, [0, 0])
    intake("b", 0.0, [0, 0])
    intake("c", 1.0, [0, 1])
    intake("d", 0.0, [0, 0])
    intake("f1", 1.0, [0, 0], "filtered", "zero_variance")
    intake("q1", 0.0, [0, 0], "quarantined", "length_mismatch")
    for tid, v in (("a", 0), ("b", 0), ("c", 1)):
        w.append(trajectory_id=tid, outcome="trained", reason="", learner_version=v)
    w.append(trajectory_id="d", outcome="quarantined", reason="stale", learner_version=2)
    w.append(outcome="quarantined", reason="not_a_trajectory", payload_sha256="00")
    w.close()
    with open(run / "metrics.jsonl", "w") as fh:
        for v in (1, 2):
            fh.write(json.dumps({"kind": "learner_step", "version": v, "step": v,
                                 "trajmesh_learner_effective_sample_size_ratio": 0.9 - 0.1 * v}) + "\n")
    breach = RuleBreach("ess_ratio_min", "trajmesh_learner_effective_sample_size_ratio", 0.7, 0.75, "min")
    write_stop_reason(run, stop_record([breach], step=2, version=2))
    return mid


def test_inspect_counts_outcomes_and_summarizes_versions(tmp_path: Path) -> None:
    run = tmp_path / "run"
    mid = _build_run(run)
    info = inspect_run(run)
    assert info["manifest"]["manifest_id"] == mid and info["archive_manifest_ids"] == [mid]
    assert info["outcomes"] == {"filtered": 1, "quarantined": 2, "trained": 3}
    assert info["by_reason"]["quarantined:stale"] == 1
    assert info["by_reason"]["quarantined:length_mismatch"] == 1
    assert info["by_reason"]["quarantined:not_a_trajectory (no id)"] == 1
    assert info["stop_reason"]["rules"] == ["ess_ratio_min"]
    v = {e["version"]: e for e in info["per_version"]}
    assert v[0]["trained"] == 2 and v[0]["mean_reward"] == pytest.approx(0.5) and v[0]["max_lag"] == 0
    assert v[1]["trained"] == 1 and v[1]["mean_lag"] == pytest.approx(0.5) and v[1]["max_lag"] == 1
    assert v[2]["quarantined"] == 1 and v[2]["trained"] == 0
    assert v[0]["ess_ratio"] == pytest.approx(0.8) and v[1]["ess_ratio"] == pytest.approx(0.7)
    text = format_report(info)
    assert mid in text and "ess_ratio_min" in text and "quarantined:stale" in text


def test_inspect_cli(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    run = tmp_path / "run"
    _build_run(run)
    assert main(["inspect", str(run)]) == 0
    out = capsys.readouterr().out
    assert "manifest" in out and "per learner version" in out and "code_commit: abc123" in out
    assert main(["inspect", str(run), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["outcomes"]["trained"] == 3
    assert main(["inspect", str(tmp_path / "missing")]) == 2


def test_inspect_tolerates_an_empty_run_dir(tmp_path: Path) -> None:
    info = inspect_run(tmp_path)
    assert info["manifest"] is None and info["trajectories"] == 0 and info["per_version"] == []
    assert "no manifest.json" in format_report(info)


def test_inspect_shows_heldout_per_source_before_latest_and_best(tmp_path: Path) -> None:
    def ev(phase: str, version: int, score: float, chain: float, search: float) -> dict:
        return {"kind": "eval", "phase": phase, "version": version, "rl_seconds": float(version), "score": score,
                "heldout": {"chain_sum": {"greedy_accuracy": chain, "sampled_accuracy": chain},
                            "search": {"greedy_accuracy": search, "sampled_accuracy": search}}}

    with open(tmp_path / "metrics.jsonl", "w") as fh:
        for rec in (ev("before", 0, 0.2, 0.3, 0.1), ev("during", 4, 0.5, 0.6, 0.4), ev("during", 8, 0.35, 0.5, 0.2)):
            fh.write(json.dumps(rec) + "\n")
    h = inspect_run(tmp_path)["heldout"]
    assert (h["latest_version"], h["best_version"], h["best_score"]) == (8, 4, 0.5)
    assert h["sources"]["search"]["before"]["sampled_accuracy"] == 0.1
    assert h["sources"]["search"]["latest"]["sampled_accuracy"] == 0.2
    assert h["sources"]["chain_sum"]["best"]["greedy_accuracy"] == 0.6
    text = format_report(inspect_run(tmp_path))
    assert "held-out per source (latest: version 8, best: version 4 score 0.5)" in text
    assert any(line.split()[:2] == ["search", "latest"] for line in text.splitlines())
