"""`trajmesh train` with `eval.in_mesh`: summary.json's held-out figures and best checkpoint come
from the evaluator's records in metrics.jsonl (no evaluation in the launcher), and the launcher
waits for the record of the last version."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from trajmesh.config import load_config
from trajmesh.learner.evaluate import HeldoutTracker
from trajmesh.run.launcher import Mesh
from trajmesh.run.train import _summarize, wait_final_eval

ACCT: dict[str, Any] = {"admitted": 0, "outcomes": {}, "by_reason": {}, "unparseable_quarantined": 0}


def _eval(phase: str, version: int, greedy: float, sampled: float) -> dict[str, Any]:
    figures = {"greedy_accuracy": greedy, "sampled_accuracy": sampled, "n_tasks": 4, "samples": 2,
               "sampled_pass_at_1": sampled, "sampled_pass_at_2": min(1.0, sampled + 0.25)}
    return {"kind": "eval", "phase": phase, "version": version, "rl_seconds": float(version), "source": "evaluator",
            "heldout": {"chain_sum": figures}, "greedy_accuracy": greedy, "sampled_accuracy": sampled,
            "score": sampled}


def _run(tmp_path: Path, records: list[dict[str, Any]]) -> Any:
    cfg = load_config(None, {"run_dir": str(tmp_path / "run"), "model.path": str(tmp_path / "base"),
                             "eval.in_mesh": True, "tasks.heldout_size": 4})
    run_dir = Path(cfg.run_dir)
    run_dir.mkdir(parents=True)
    steps = [{"kind": "learner_step", "step": v, "version": v, "rl_seconds": float(v)} for v in (1, 2, 3)]
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in [*steps, *records]))
    return cfg


def test_summary_takes_before_after_and_best_from_the_evaluators_records(tmp_path: Path) -> None:
    cfg = _run(tmp_path, [_eval("before", 0, 0.50, 0.25), _eval("during", 2, 0.75, 0.50),
                          _eval("after", 3, 0.50, 0.375)])
    held = {"chain_sum": [{"task_id": str(i)} for i in range(4)]}  # never evaluated here
    summary = _summarize(cfg, held, ACCT, HeldoutTracker(None, 2))
    per = summary["heldout"]["chain_sum"]
    assert per["before"]["greedy_accuracy"] == 0.50 and per["before"]["sampled_accuracy"] == 0.25
    assert per["after"]["greedy_accuracy"] == 0.50 and per["after"]["sampled_accuracy"] == 0.375
    assert per["after"]["sampled_pass_at_2"] == 0.625
    assert summary["heldout_accuracy_before_rl"] == 0.25 and summary["heldout_accuracy_after_rl"] == 0.375
    best = summary["best_checkpoint"]
    assert best["version"] == 2 and best["score"] == 0.50 and best["path"] == str(Path(cfg.run_dir) / "best")
    on_disk = json.loads((Path(cfg.run_dir) / "summary.json").read_text())
    assert on_disk["heldout"] == summary["heldout"]
    evals = [json.loads(line) for line in (Path(cfg.run_dir) / "metrics.jsonl").read_text().splitlines()]
    assert [r["phase"] for r in evals if r["kind"] == "eval"] == ["before", "during", "after"]  # none added


def test_the_launcher_waits_for_the_last_versions_record(tmp_path: Path) -> None:
    cfg = _run(tmp_path, [_eval("before", 0, 0.5, 0.25), _eval("during", 2, 0.5, 0.25)])
    mesh = Mesh(cfg, Path(cfg.run_dir) / "config.resolved.yaml")
    assert wait_final_eval(mesh, timeout_s=0.0) is None  # the last version is 3: no record of it yet
    with open(Path(cfg.run_dir) / "metrics.jsonl", "a") as fh:  # a record of an earlier run segment's end
        fh.write(json.dumps(_eval("after", 2, 0.5, 0.25)) + "\n")
    assert wait_final_eval(mesh, timeout_s=0.0) is None
    with open(Path(cfg.run_dir) / "metrics.jsonl", "a") as fh:
        fh.write(json.dumps(_eval("after", 3, 0.5, 0.5)) + "\n")
    record = wait_final_eval(mesh, timeout_s=0.0)
    assert record is not None and record["version"] == 3 and record["phase"] == "after"
