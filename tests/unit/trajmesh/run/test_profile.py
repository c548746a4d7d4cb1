"""`trajmesh profile`: each training task's pass rate under the starting policy (trajmesh/run/profile.py).

The demo's shipped warm start (examples/demo-start) plays chain_sum tasks through the rollout's
episode path and the tasks' own grader. The counts are checked against the held-out evaluator's
independent path (learner/evaluate.py `evaluate_tasks`: same policy seed, same tasks, its own
grading loop), and a curriculum built on the written profile drops exactly the tasks it says fail.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from repo_paths import REPO

from trajmesh.config import load_config
from trajmesh.run.cli import main
from trajmesh.tasks import TaskSampler, load_split, profile_key, read_profile

N_TASKS, K = 6, 4

pytestmark = pytest.mark.timeout(300)


def test_profile_counts_match_the_evaluator_and_feed_the_curriculum(tmp_path: Path,
                                                                    capsys: pytest.CaptureFixture[str]) -> None:
    config = str(REPO / "examples" / "demo.yaml")
    run_dir = tmp_path / "run"
    over = ["--set", f"run_dir={run_dir}", "--set", "tasks.train_size=50", "--set", "tasks.heldout_size=10"]
    assert main(["profile", config, "--samples", str(K), "--tasks", str(N_TASKS), *over]) == 0
    out = tmp_path / "run.task_profile.json"  # beside the run dir: `trajmesh train` needs it empty
    assert not run_dir.exists()
    body = json.loads(out.read_text())
    assert body["samples"] == K and body["policy_version"] == 0
    cfg = load_config(config, {"run_dir": str(run_dir), "tasks.train_size": 50, "tasks.heldout_size": 10})
    src = cfg.tasks.sources[0]
    train, _ = load_split(src, 50, 10)
    counts = read_profile(out)
    assert sorted(counts) == sorted(profile_key(src.name, t.task_id) for t in train[:N_TASKS])
    assert all(m == K and 0 <= n <= K for n, m in counts.values())
    printed = capsys.readouterr().out
    assert f"{src.name}" in printed and str(out) in printed

    # The evaluator's path: same model dir, policy seed, tasks, samples and sampling settings.
    from trajmesh.learner.evaluate import evaluate
    from trajmesh.learner.models import load_model
    from trajmesh.run.launcher import prepare_model

    model_dir = prepare_model(cfg).model.path
    assert model_dir is not None
    model, _ = load_model(model_dir)
    tasks = [{"prompt": t.prompt, "answer": t.answer, "task_id": t.task_id, "source": t.source,
              "environment": t.environment, "metadata": t.metadata} for t in train[:N_TASKS]]
    sp = cfg.tasks.sampling
    ev = evaluate(model, model_dir, tasks, temperature=sp.temperature, top_p=sp.top_p, samples=K,
                  max_new_tokens=sp.max_new_tokens, max_turns=sp.max_turns, seed=cfg.seed)
    passes = sum(n for n, _ in counts.values())
    assert ev["pass_at_k"][1] == pytest.approx(passes / (N_TASKS * K))
    assert 0 < passes < N_TASKS * K, counts  # the warm start solves some samples, not all: a real profile

    # A curriculum on it: dropping all-fail tasks removes exactly those with 0 passes.
    cur = load_config(config, {"run_dir": str(run_dir), "tasks.train_size": 50, "tasks.heldout_size": 10,
                               "tasks.sources": [{**src.model_dump(), "curriculum": {"drop": ["all_fail"]}}]})
    sampler = TaskSampler(cur.tasks, seed=0, profile_in=out)
    failing = {t.task_id for t in train[:N_TASKS] if counts[profile_key(src.name, t.task_id)][0] == 0}
    assert {t.task_id for t in sampler.kept(0)} == {t.task_id for t in train} - failing
