"""The held-out regression stop on the real mesh: `trajmesh train` evaluates during RL, and two
consecutive evaluations more than the margin below the best stop the learner cleanly (exit 0,
checkpoint, stop_reason.json); summary.json names the best checkpoint. The same run checks
provenance: environment revisions on trajectories and in the manifest.

The held-out scores are scripted (evaluate_dir replaced by a fixed sequence) so the regression
happens by construction; the evaluation itself is tested in test_evaluate_loop/heldout."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from trajmesh.config import load_config
from trajmesh.run import train as train_mod
from trajmesh.v1 import services_pb2

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(600)]


def test_two_evaluations_below_best_minus_margin_stop_the_run(tmp_path: Path, tiny_model_dir: str,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    scores = iter([0.5, 0.3, 0.2])  # before RL, then two evaluations during RL: 0.2 and 0.3 below the best
    evaluated: list[str] = []

    def scripted(model_dir: str, held: dict[str, list[dict[str, Any]]], cfg: Any, samples: int = 4,
                 noise_seeds: int = 0) -> dict[str, Any]:
        evaluated.append(model_dir)
        s = next(scores, 0.25)  # the evaluation after RL
        per = {name: {"greedy_accuracy": s, "sampled_accuracy": s, "n_tasks": len(t), "samples": samples}
               for name, t in held.items()}
        return {"heldout": per, "greedy_accuracy": s, "sampled_accuracy": s, "score": s}

    monkeypatch.setattr(train_mod, "evaluate_dir", scripted)
    cfg = load_config(None, {
        "run_dir": str(tmp_path / "run"), "model.path": tiny_model_dir, "gate.eta": 1,
        "tasks.group_size": 4, "tasks.heldout_size": 10, "tasks.train_size": 300, "tasks.sampling.max_new_tokens": 6,
        "rollout.replicas": 1, "rollout.concurrent_tasks": 2, "grader.replicas": 1,
        "learner.engine.type": "torch", "learner.batch_groups": 2, "learner.max_steps": 500,
        "eval.stop_regression_margin": 0.1, "eval.stop_confirmations": 2, "learner.keep_batches": True,
        "eval.in_mesh": False,  # the launcher's own evaluation loop (the default is the evaluator service)
    })
    summary = train_mod.train(cfg, eval_every_s=0.5)
    run = Path(cfg.run_dir)
    assert summary["stop_reason"]["reason"] == "heldout_regression", summary["stop_reason"]
    assert summary["rl_steps"] < 500 and summary["rl_steps"] == summary["final_version"]
    records = train_mod.read_metrics(run)
    evals = [r for r in records if r.get("kind") == "eval"]
    assert [(e["phase"], e["score"]) for e in evals] == [("before", 0.5), ("during", 0.3), ("during", 0.2),
                                                         ("after", 0.25)]
    assert [r["rules"] for r in records if r.get("kind") == "stop"] == [["heldout_regression"]]
    assert all(Path(p).parent == run / "weights" for p in evaluated[1:3])  # the weights published during RL
    assert summary["best_checkpoint"]["version"] == 0 and summary["best_checkpoint"]["path"] == tiny_model_dir
    assert summary["heldout"]["chain_sum"]["before"]["sampled_accuracy"] == 0.5
    assert summary["heldout"]["chain_sum"]["after"]["sampled_accuracy"] == 0.25
    assert (run / "checkpoints" / "latest").exists()
    assert json.loads((run / "stop_reason.json").read_text())["best"]["version"] == 0
    # Provenance on the same run: every trained trajectory carries the revision its environment
    # reported on Reset, and the manifest names that environment revision and the real frameworks.
    revisions = {t.environment_revision for p in sorted((run / "learner_batches").glob("step-*.pb"))
                 for t in services_pb2.NextBatchResponse.FromString(p.read_bytes()).trajectories}
    assert revisions == {"single_answer-v1"}
    manifest = json.loads((run / "manifest.json").read_text())
    assert manifest["environment_revisions"] == {"chain_sum": "single_answer-v1"}
    assert manifest["grader_revisions"] == {"reasoning_gym": "reasoning_gym-score_answer-v2"}
    assert {"torch", "transformers"} <= set(manifest["framework_versions"])
    assert isinstance(manifest["dirty_tree"], bool)  # written even when false
    protocol = json.loads(manifest["evaluation_protocol_json"])
    assert protocol["sampled"]["samples_per_problem"] == 4 and protocol["max_new_tokens_per_turn"] == 6
