"""`trajmesh train`'s held-out side: per-source evaluation of a real (tiny) model dir, the
held-out regression stop and the best-checkpoint choice."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from trajmesh.config import load_config
from trajmesh.run.train import (
    HeldoutTracker,
    _record_eval,
    _replay_evals,
    evaluate_dir,
    evaluation_protocol,
    heldout_tasks,
)

GCD = {"type": "reasoning_gym", "name": "gcd", "family": "gcd", "answer": "last_integer"}


def test_evaluate_dir_reports_each_source_with_its_own_grader(tiny_model_dir: str, tmp_path: Path) -> None:
    cfg = load_config(None, {
        "run_dir": str(tmp_path / "run"), "model.path": tiny_model_dir, "tasks.heldout_size": 6,
        "tasks.sources": [{"type": "reasoning_gym"}, GCD],
        "tasks.sampling.max_new_tokens": 6, "tasks.sampling.max_turns": 2, "eval.samples": 2})
    held = heldout_tasks(cfg)
    assert sorted(held) == ["chain_sum", "gcd"] and all(len(t) == 6 for t in held.values())
    res = evaluate_dir(tiny_model_dir, held, cfg, samples=2, noise_seeds=2)
    per = res["heldout"]
    assert sorted(per) == ["chain_sum", "gcd"]
    for r in per.values():
        assert r["n_tasks"] == 6 and r["samples"] == 2 and 0.0 <= r["sampled_accuracy"] <= 1.0
        assert set(r) >= {"greedy_accuracy", "sampled_pass_at_1", "sampled_pass_at_2", "terminal_reasons"}
        assert len(r["sampled_accuracy_seeds"]) == 2
    # Pooled headline = problem-weighted mean (6 + 6 problems); the score = mean over sources.
    g = [per[s]["greedy_accuracy"] for s in ("chain_sum", "gcd")]
    assert res["greedy_accuracy"] == pytest.approx((6 * g[0] + 6 * g[1]) / 12)
    sa = [per[s]["sampled_accuracy"] for s in ("chain_sum", "gcd")]
    assert res["score"] == pytest.approx(sum(sa) / 2)
    assert evaluate_dir(tiny_model_dir, held, cfg, samples=2) ["heldout"]["chain_sum"]["sampled_accuracy"] == \
        per["chain_sum"]["sampled_accuracy"]  # deterministic given the run seed
    protocol = evaluation_protocol(cfg, held)
    assert protocol["sampled"]["samples_per_problem"] == 2 and protocol["max_turns"] == 2
    assert protocol["sources"]["gcd"]["environments"] == {"reasoning_gym": "single_answer-v1"}
    assert protocol["sources"]["chain_sum"]["environments"] == {"chain_sum": "single_answer-v1"}


def test_in_process_evaluation_refuses_what_the_environment_service_plays(tmp_path: Path,
                                                                          capsys: pytest.CaptureFixture[str]) -> None:
    """A tool environment (search) and a sandboxed grader (math_tool's code tool runs in its
    environment; code graders in the sandbox) are never evaluated in the launcher's process:
    `evaluate_dir` raises before it loads a model, and `trajmesh train` with `eval.in_mesh: false`
    exits 2 before the run dir exists."""
    from trajmesh.run.cli import main
    from trajmesh.run.train import InProcessEvaluationRefused

    cfg = load_config(None, {"run_dir": str(tmp_path / "run"), "tasks.heldout_size": 3,
                             "tasks.sources": [{"type": "reasoning_gym"}, {"type": "search", "corpus_size": 20},
                                               {"type": "math_tool"}]})
    held = heldout_tasks(cfg)
    with pytest.raises(InProcessEvaluationRefused) as err:
        evaluate_dir(str(tmp_path / "no-model-here"), held, cfg)
    assert "search: environment search keeps state" in str(err.value)
    assert "math_tool: environment math_tool keeps state" in str(err.value)
    assert "chain_sum" not in str(err.value)
    config = tmp_path / "run.yaml"
    config.write_text(json.dumps({"run_dir": str(tmp_path / "run"), "tasks": {"heldout_size": 3, "sources": [
        {"type": "search", "corpus_size": 20}]}, "eval": {"in_mesh": False}}))
    capsys.readouterr()
    assert main(["train", str(config)]) == 2
    assert "error: eval.in_mesh: false evaluates held-out episodes in the launcher's process" in capsys.readouterr().err
    assert not (tmp_path / "run").exists()
    assert main(["sweep", str(config), "--seeds", "1", "--out", str(tmp_path / "sweep")]) == 2  # each cell trains
    assert "search: environment search keeps state" in capsys.readouterr().err


def test_regression_needs_two_consecutive_evaluations_below_best_minus_margin() -> None:
    t = HeldoutTracker(margin=0.05, confirmations=2)
    assert t.observe(0, 0.40) == (True, False)
    assert t.observe(1, 0.50) == (True, False)
    assert t.observe(2, 0.44) == (False, False)   # 0.06 below: one strike
    assert t.observe(3, 0.46) == (False, False)   # only 0.04 below: the count resets
    assert t.observe(4, 0.44) == (False, False)
    assert t.observe(5, 0.30) == (False, True)    # second consecutive strike: stop
    assert t.best == {"version": 1, "score": 0.50}


def test_no_margin_never_stops_and_a_new_best_resets_the_count() -> None:
    off = HeldoutTracker(margin=None, confirmations=1)
    off.observe(0, 0.9)
    assert [off.observe(v, 0.0)[1] for v in range(1, 6)] == [False] * 5
    t = HeldoutTracker(margin=0.1, confirmations=2)
    t.observe(0, 0.5)
    t.observe(1, 0.3)
    assert t.observe(2, 0.6) == (True, False) and t.below == 0
    assert t.observe(3, 0.45) == (False, False)


def _weights(root: Path, name: str, payload: str) -> Path:
    d = root / "weights" / name
    d.mkdir(parents=True)
    (d / "model.safetensors").write_text(payload)
    return d


def test_best_weights_are_kept_and_survive_resume(tmp_path: Path) -> None:
    run = tmp_path / "run"
    run.mkdir()
    t = HeldoutTracker(margin=0.1, confirmations=2)
    rec = {"kind": "eval", "rl_seconds": 1.0}
    assert not _record_eval(run, t, {**rec, "phase": "before", "version": 0, "score": 0.2}, tmp_path / "base")
    assert t.best is not None and t.best["path"] == str(tmp_path / "base")  # the base model, not copied
    w5 = _weights(run, "v000005", "five")
    assert not _record_eval(run, t, {**rec, "phase": "during", "version": 5, "score": 0.5}, w5)
    w9 = _weights(run, "v000009", "nine")
    assert not _record_eval(run, t, {**rec, "phase": "during", "version": 9, "score": 0.3}, w9)
    shutil.rmtree(w5)  # the learner prunes old versions: the snapshot must not depend on them
    assert (run / "best" / "model.safetensors").read_text() == "five"
    assert t.best["version"] == 5 and t.best["path"] == str(run / "best")
    w12 = _weights(run, "v000012", "twelve")
    assert _record_eval(run, t, {**rec, "phase": "during", "version": 12, "score": 0.35}, w12)  # 2nd strike
    evals = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [e.get("best", False) for e in evals] == [True, True, False, False]
    again = HeldoutTracker(margin=0.1, confirmations=2)
    _replay_evals(run, again, str(tmp_path / "base"))
    assert again.best is not None and (again.best["version"], again.best["path"]) == (5, str(run / "best"))
