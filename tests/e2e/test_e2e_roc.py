"""GRPO-RoC through the real mesh (NATS, Redis, every service a process): the store admits
``oversample × G`` samples a task and keeps G of each complete group by the rule of
services/store/roc.py, and the archive shows every decision.

A short asynchronous run with the demo model (G = 4, oversample 2: 8 samples a task). Checked, from
the archive alone: every task was sampled 8 times and each of its samples ends as exactly one final
outcome; in each group RoC decided, the kept counts follow the rule — incorrect ones up to
⌊G/2⌋, correct ones the rest, more incorrect ones where correct ones ran short — and each row's
reason names its side (reward above ``correct_above`` or not); each decided row's two scores are
what the test recomputes from the row's own tokens (no tool calls in this source: 0.5; the format
score from the answer tags in its decoded sampled text, one turn); only kept samples are trained,
at most G a group; the gate's counters agree with the archive (a kept group counts G accepted
and frees its other G); nothing stale. The preference for clean correct samples is a statistical
property checked in tests/unit/services/store/test_roc.py over thousands of draws.
"""

from __future__ import annotations

import re
from collections import Counter, defaultdict
from pathlib import Path
from typing import Any

import pytest
from mesh_checks import train_to_end

from trajmesh.config import load_config
from trajmesh.tokenizer import load_tokenizer

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(400)]

G, OVERSAMPLE, STEPS = 4, 2, 2
ANSWER = r"\d+"
"""An answer tag of this source: a number (the demo model answers a sum with one)."""


def _expected_kept(correct: int, incorrect: int) -> tuple[int, int]:
    """The rule, as survey §5.2 states it: incorrect samples up to half of G, correct ones fill the
    rest, and incorrect ones fill what too few correct ones leave."""
    neg = min(incorrect, G // 2)
    pos = min(correct, G - neg)
    return pos, min(incorrect, G - pos)


def test_roc_keeps_g_of_each_oversampled_group_by_its_rule(tmp_path: Path, tiny_model_dir: str) -> None:
    cfg = load_config(None, {
        "run_dir": str(tmp_path / "run"), "model.path": tiny_model_dir, "gate.eta": 1,
        "tasks.group_size": G, "tasks.heldout_size": 8, "tasks.train_size": 200,
        "tasks.sampling.max_new_tokens": 6,
        "store.resample_on_correct": {"enabled": True, "oversample": OVERSAMPLE, "answer_pattern": ANSWER},
        "rollout.replicas": 1, "rollout.concurrent_tasks": 4, "grader.replicas": 1,
        "learner.engine.type": "torch", "learner.batch_groups": 2, "learner.max_steps": STEPS,
        "learner.checkpoint_every": STEPS,
    })
    cfg, _, rows = train_to_end(cfg)

    final: dict[str, dict[str, Any]] = {}
    for r in rows:  # sorted by seq: the last non-accepted row is the final one
        if r["trajectory_id"] and r["outcome"] not in ("accepted", "duplicate"):
            final[r["trajectory_id"]] = r
    # (an end-of-run row has no task id: the task is the id's head, rollout names sample k "<task>-k")
    per_task = Counter(tid.rpartition("-")[0] for tid in final)
    assert per_task and set(per_task.values()) == {G * OVERSAMPLE}, per_task  # 8 samples a task, each once

    # One decision a sample. A store restarted after the decision (its stop or a crash) gets the
    # kept samples back and records them kept again: the same decision, never another one.
    decided: dict[str, list[dict[str, Any]]] = defaultdict(list)
    first: dict[str, dict[str, Any]] = {}
    for r in rows:
        if (r["reason"] or "").startswith("roc_"):
            seen = first.setdefault(r["trajectory_id"], r)
            if seen is r:
                decided[r["group_id"]].append(r)
            else:
                assert (r["outcome"], r["reason"]) == (seen["outcome"], seen["reason"]) == ("accepted", r["reason"]), \
                    (seen, r)
    assert len(decided) >= STEPS * 2, f"RoC decided {len(decided)} groups, the learner trained {STEPS * 2}"
    tok = load_tokenizer(tiny_model_dir)
    correct_above = cfg.store.resample_on_correct.correct_above
    for gid, group in decided.items():
        correct = [r for r in group if r["reward"] > correct_above]
        kept = [r for r in group if r["outcome"] == "accepted"]
        assert (sum(r["reward"] > correct_above for r in kept), sum(r["reward"] <= correct_above for r in kept)) \
            == _expected_kept(len(correct), len(group) - len(correct)), gid
        for r in group:
            side = "correct" if r["reward"] > correct_above else "incorrect"
            want = f"roc_kept_{side}" if r["outcome"] == "accepted" else f"roc_{side}_not_drawn"
            assert r["reason"] == want and r["outcome"] in ("accepted", "filtered"), (gid, r["reason"], r["outcome"])
            text = tok.decode([t for t, m in zip(r["token_ids"], r["loss_mask"], strict=True) if m])
            answers = len(re.findall(ANSWER, text))
            assert r["roc_tool_error_score"] == 0.5, r["trajectory_id"]  # no tool call
            assert r["roc_format_score"] == (1.0 if answers == 0 else min(1.0, answers - 1.0)), (text, r)
    dropped = {r["trajectory_id"] for g in decided.values() for r in g if r["outcome"] == "filtered"}
    assert dropped, "RoC dropped nothing"
    trained = [r for r in final.values() if r["outcome"] == "trained"]
    assert trained and not {r["trajectory_id"] for r in trained} & dropped
    assert max(Counter(r["trajectory_id"].rpartition("-")[0] for r in trained).values()) <= G
