"""The ``verifiers`` source (envs/verifiers_env.py) on the real verifiers 0.4 package, with the
taskset of tests/verifiers_tasksets.py (sums over a local ``datasets.Dataset``, verifiers' own
``@vf.reward`` functions, a rubric that raises on some tasks). verifiers pins openai < 3, so these
run only in a venv that has it (the dev extra's agent frameworks need openai >= 3)."""

from __future__ import annotations

import json
from typing import Any

import pytest

pytest.importorskip("verifiers.v1")
pytest.importorskip("datasets")

from repo_paths import TESTS as TESTS_DIR

from trajmesh.config import load_config  # noqa: E402
from trajmesh.graders import make_grader  # noqa: E402
from trajmesh.graders.base import Sample  # noqa: E402
from trajmesh.tasks import load_split  # noqa: E402

TESTS = str(TESTS_DIR)


def _split() -> tuple[list[Any], list[Any]]:
    src = load_config(None, {"tasks.sources": [{"type": "verifiers", "name": "sums", "taskset": "verifiers_tasksets",
                                                "python_path": [TESTS]}]}).tasks.sources[0]
    return load_split(src, 20, 4)


def _view(t: Any) -> dict[str, Any]:
    return {"prompt": t.prompt, "answer": t.answer, "metadata": t.metadata}


def test_tasks_are_the_tasksets_rows_split_disjoint() -> None:
    from verifiers_tasksets import ROWS

    train, held = _split()
    assert len(train) == 20 and len(held) == 4
    assert not {t.prompt for t in train} & {t.prompt for t in held}
    for t in train + held:  # each task is the taskset's entry at its idx
        assert t.prompt == ROWS[t.metadata["idx"]]["question"] and t.environment == "verifiers"


def _task(boom: bool) -> Any:
    from verifiers_tasksets import ROWS

    train, _ = _split()
    return next(t for t in train if ROWS[t.metadata["idx"]]["boom"] is boom)


def test_rollout_outcome_is_scored_as_the_rubric_recorded() -> None:
    grader = make_grader("verifiers")
    out = {"rewards": {"correct": {"score": 1.0, "weight": 1.0}, "mentions_answer": {"score": 1.0, "weight": 0.5}},
           "errors": [], "reply": "4"}
    g = grader.grade(Sample("4", ["4"], True, [], "EOS", json.dumps(out)), _view(_task(False)))
    assert g.reward == 1.5 and g.components == {"rubric_error": 0.0, "correct": 1.0, "mentions_answer": 1.0}
    failed = {**out, "rewards": {"correct": {"score": 1.0, "weight": 1.0}, "mentions_answer": None},
              "errors": ["TaskError: rubric exploded"]}
    g = grader.grade(Sample("4", ["4"], True, [], "EOS", json.dumps(failed)), _view(_task(False)))
    assert g.reward == 0.0 and g.components["rubric_error"] == 1.0 and "rubric exploded" in g.verifier_output
    timed_out = grader.grade(Sample("4", ["4"], False, [], "WALL_TIMEOUT", ""), _view(_task(False)))
    assert timed_out.reward == 0.0


def test_an_episode_without_the_rubrics_outcome_is_never_rewarded() -> None:
    """A timed-out episode scores 0 however right its reply (the grader service hands it over with
    no final answer), and one that ended EOS with no outcome recorded is a rubric error."""
    from verifiers_tasksets import ROWS

    grader = make_grader("verifiers")
    task = _task(False)
    answer = ROWS[task.metadata["idx"]]["answer"]
    timed_out = grader.grade(Sample(answer, [answer], True, [], "WALL_TIMEOUT", None), _view(task))
    assert timed_out.reward == 0.0 and "WALL_TIMEOUT" in timed_out.verifier_output
    silent = grader.grade(Sample(answer, [answer], True, [], "EOS", None), _view(task))
    assert silent.reward == 0.0 and silent.components["rubric_error"] == 1.0
