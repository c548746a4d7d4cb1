"""open_ended source (envs/open_ended.py): prompts with no gold answer and no program verifier.

- its draws are a function of the seed (the built-in generator and a JSONL file alike), the training
  and held-out splits are disjoint, and a prompt keeps its task id whatever the seed;
- the config refuses it unless `judge.sources` names it, and refuses in-process held-out
  evaluation for it (`eval.in_mesh: false`: no judge there);
- its grader kind refuses to score, so a trajectory that reached it anyway is an infrastructure
  failure (`grade_sample` raises: no gold answer to fall back on), never a reward;
- the audit without a judge refuses it, and a pairwise judge with no gold answer reports its tasks
  as not probed (nothing to hold the probes against), never as passed.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from pydantic import ValidationError

from trajmesh.config import ConfigError, load_config
from trajmesh.envs import open_ended
from trajmesh.graders import Sample, grade_sample, grader_kind, make_grader
from trajmesh.tasks import load_split

JUDGE = {"sources": ["notes"], "urls": ["http://127.0.0.1:9"], "revision": "test-judge"}
"""A judge nothing here asks (port 9, discard): the config only needs it named."""


def _cfg(judge: dict[str, Any] | None = JUDGE, **over: Any) -> Any:
    return load_config(None, {"tasks.sources": [{"type": "open_ended", "name": "notes"}],
                              **({"judge": judge} if judge is not None else {}), **over})


def _src(**fields: Any) -> Any:
    return open_ended.OpenEndedSource(name="notes", **fields)


def test_a_draw_is_a_function_of_its_seed() -> None:
    src = _src()
    first, again = open_ended.draw(src, 3, 10, set()), open_ended.draw(src, 3, 10, set())
    assert first == again
    assert [t["prompt"] for t in open_ended.draw(src, 4, 10, set())] != [t["prompt"] for t in first]
    assert len({t["prompt"] for t in first}) == 10
    for t in first:
        assert t["answer"] == "" and t["metadata"]["grader"] == "open_ended"
        assert t["prompt"] == f"Write one short sentence about {open_ended.TOPICS[t['metadata']['index']]}."
        assert t["task_id"] == open_ended.task_id("notes", t["prompt"])  # the prompt is the task, any seed
    other_seed = {t["prompt"]: t["task_id"] for t in open_ended.draw(src, 4, 48, set())}
    assert all(other_seed[t["prompt"]] == t["task_id"] for t in first)
    excluded = {first[0]["prompt"], first[1]["prompt"]}
    assert not {t["prompt"] for t in open_ended.draw(src, 3, 48, excluded)} & excluded
    assert len(open_ended.draw(src, 3, 1000, set())) == 48  # the pool runs out: fewer, never repeats


def test_the_splits_are_disjoint_and_repeat() -> None:
    src = _src(templates=["Describe {topic}.", "Name one thing about {topic}."], topics=["tea", "rain", "glass"])
    train, held = load_split(src, 100, 2)
    assert (train, held) == load_split(src, 100, 2)
    assert len(held) == 2 and len(train) == 4 and not {t.prompt for t in train} & {t.prompt for t in held}
    assert all(t.answer == "" and t.environment == "open_ended" and t.source == "notes" for t in train + held)
    with pytest.raises(ValidationError, match="topic"):
        _src(templates=["Write a poem."])


def test_prompts_from_a_jsonl_file(tmp_path: Path) -> None:
    path = tmp_path / "prompts.jsonl"
    lines = [{"prompt": f"say something about {w}"} for w in ("tea", "rain", "glass", "tea", "snow")]
    path.write_text("\n".join(json.dumps(x) for x in lines) + "\n\n")
    src = _src(prompts_file=str(path))
    assert open_ended.pool(src) == [f"say something about {w}" for w in ("tea", "rain", "glass", "snow")]
    assert open_ended.draw(src, 1, 4, set()) == open_ended.draw(src, 1, 4, set())
    path.write_text(json.dumps({"prompt": "2+2=", "answer": "4"}) + "\n")
    with pytest.raises(ValueError, match="prompt.*nothing else"):  # no gold answers: prompt only
        open_ended.draw(src, 1, 1, set())
    with pytest.raises(ValueError, match="no such file"):
        open_ended.draw(_src(prompts_file=str(tmp_path / "gone.jsonl")), 1, 1, set())


def test_the_config_refuses_it_unless_the_judge_scores_it() -> None:
    with pytest.raises(ConfigError, match=r"\['notes'\]: no program verifier.*judge.sources"):
        _cfg(judge=None)
    with pytest.raises(ConfigError, match=r"\['notes'\]: no program verifier"):
        _cfg(judge={**JUDGE, "sources": []})
    with pytest.raises(ConfigError, match=r"eval.in_mesh: false.*\['notes'\] has none"):
        _cfg(**{"eval.in_mesh": False})
    cfg = _cfg()
    assert [s.name for s in cfg.tasks.sources] == cfg.judge.sources == ["notes"]
    assert _cfg(**{"eval.in_mesh": True}).eval.in_mesh is True


def test_its_grader_kind_never_scores() -> None:
    (task,) = open_ended.draw(_src(), 0, 1, set())
    task = {**task, "source": "notes"}
    grader = make_grader(grader_kind(task))
    with pytest.raises(open_ended.NoProgramVerifier, match="'notes' is open-ended.*judge.sources"):
        grade_sample(grader, Sample("A sentence.", ["A sentence."], True), task)  # no gold answer: raised, not 0


def test_the_audit_refuses_it_without_a_judge_and_reports_pairwise_tasks_unprobed() -> None:
    from trajmesh.run.audit import audit_judged_source, audit_sources

    cfg = _cfg()
    (alone,) = audit_sources(list(cfg.tasks.sources), 4)  # no judge given
    assert alone.refused == ["no program verifier: only a judge scores it (judge.sources)"], alone.as_dict()
    pairwise = cfg.judge.model_copy(update={"mode": "pairwise"})
    audit = audit_judged_source(cfg.tasks.sources[0], pairwise, 4)  # no gold: no request is sent
    assert audit.tasks == audit.gold_missing == audit.unprobed == 4, audit.as_dict()
    assert not audit.refused and audit.problems == [
        "pairwise judge: no gold answer to hold the probes against on 4/4 (not probed)"]
