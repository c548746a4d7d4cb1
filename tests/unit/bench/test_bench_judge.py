"""The judge-agreement benchmark's answers (bench/bench_judge.py): balanced halves, and labels that
say what the arithmetic says (checked here by hand, not by the verifier the bench asks)."""

from __future__ import annotations

import importlib.util
import random
import re

from repo_paths import REPO

_spec = importlib.util.spec_from_file_location("bench_judge", REPO / "bench" / "bench_judge.py")
assert _spec is not None and _spec.loader is not None
bj = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(bj)


def test_items_are_half_right_and_labelled_by_their_sum() -> None:
    tasks = bj._tasks(40)
    real_tasks, other = tasks[:6], tasks[6:]
    a, b = (int(x) for x in re.findall(r"\d+", real_tasks[0]["prompt"])[:2])
    real = [f"{a} + {b} = {a + b}", "no number here", "I think 99999", "", "1 + 1 = 2", "seven"]
    items = bj.build_items(real_tasks, real, other, 24, random.Random(0))
    assert len(items) == 24 and sum(it["right"] for it in items) == 12
    assert sum(it["kind"] == "real" for it in items) == 6  # every real sample fits its half here
    first = next(it for it in items if it["kind"] == "real" and it["response"] == real[0])
    assert first["right"] is True
    for it in items:
        if it["kind"] == "synthetic":
            x, y, total = (int(v) for v in re.fullmatch(r"(\d+) \+ (\d+) = (\d+)", it["response"]).groups())
            assert (x, y) == tuple(int(v) for v in re.findall(r"\d+", it["task"]["prompt"])[:2])
            assert it["right"] == (total == x + y), it["response"]


def test_a_partial_credit_answer_is_left_out() -> None:
    """reasoning-gym's basic_arithmetic gives 0.5 to an answer that contains the gold digits: neither
    right nor wrong, so not an item."""
    task = next(t for t in bj._tasks(100) if t["answer"] == "7")
    assert bj._label(task, "= 17") is None
    assert bj._label(task, "= 7") is True and bj._label(task, "= 8") is False
