"""reasoning-gym source's answer format: the prompt suffix and the answer read travel in the task
metadata; the grader reads the response as the task says and refuses a prompt its generator did not
write. basic_arithmetic's score_answer gives partial credit when the answer is a substring, so an
equation under "exact" earns a fraction, never a pass."""

from __future__ import annotations

import hashlib
import json
from typing import Any

import pytest
from pydantic import ValidationError

from trajmesh.envs import reasoning_gym
from trajmesh.envs.reasoning_gym import ANSWER_SUFFIX, ReasoningGymSource, last_integer
from trajmesh.graders import make_grader

KNOBS = {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 1, "operators": ["+"],
         "allow_parentheses": False, "allow_negation": False}
SUFFIX = " Write the equation with its result."


def _tasks(answer: reasoning_gym.AnswerRead, suffix: str = SUFFIX, n: int = 16) -> list[dict[str, Any]]:
    return reasoning_gym.make_tasks("basic_arithmetic", 7, n, KNOBS, source="arith", prompt_suffix=suffix,
                                    answer=answer)


def _task_with_answer(answer: reasoning_gym.AnswerRead, gold: int) -> dict[str, Any]:
    return next(t for t in _tasks(answer, n=64) if t["answer"] == str(gold))


def _equation(task: dict[str, Any]) -> str:
    """'Calculate 3 + 4. ...' → '3 + 4 = 7'."""
    expr = task["prompt"].removeprefix("Calculate ").split(".")[0]
    return f"{expr} = {task['answer']}"


def test_the_equation_passes_under_last_integer_not_under_exact() -> None:
    for read, want in (("last_integer", 1.0), ("exact", None)):
        for t in _tasks(read):  # type: ignore[arg-type]
            got = reasoning_gym.score(_equation(t), t)
            if want is None:
                assert got < 1.0  # the family's partial credit for the answer's digits, not a pass
            else:
                assert got == want
    t = _task_with_answer("exact", 7)
    assert reasoning_gym.score("3 + 4 = 7", t) == pytest.approx(1 / len("3 + 4 = 7"))
    assert reasoning_gym.score("7", t) == 1.0


def test_last_integer_scores_the_last_number_only() -> None:
    t = _task_with_answer("last_integer", 8)
    assert reasoning_gym.score("7 ... 8", t) == 1.0
    assert reasoning_gym.score("8 ... 7", t) == 0.0
    assert reasoning_gym.score("It is 8.", t) == 1.0
    assert reasoning_gym.score("no number here", t) == 0.0
    assert reasoning_gym.score("", t) == 0.0


def test_last_integer_reads_signs_not_operators() -> None:
    assert last_integer("2 - 5 = -3") == "-3"
    assert last_integer("2-3") == "3" and last_integer("(4) -3") == "3"
    assert last_integer("= 007.") == "7" and last_integer("x") is None


def test_format_travels_in_metadata_and_the_grader_uses_it() -> None:
    src = ReasoningGymSource(name="arith", family="basic_arithmetic", knobs=KNOBS, prompt_suffix=SUFFIX,
                             answer="last_integer")
    t = reasoning_gym.draw(src, 7, 4, set())[0]
    assert t["prompt"].endswith(SUFFIX)
    assert t["metadata"]["prompt_suffix"] == SUFFIX and t["metadata"]["answer_read"] == "last_integer"
    grade = make_grader("reasoning_gym").grade(_equation(t), t, ended_with_eos=True)
    assert grade.reward == 1.0


def test_a_prompt_with_another_suffix_than_the_metadata_is_refused() -> None:
    t = _tasks("last_integer")[0]
    wrong = {**t, "prompt": t["prompt"].removesuffix(SUFFIX) + ANSWER_SUFFIX}
    with pytest.raises(ValueError, match="no longer matches its generator"):
        reasoning_gym.score(t["answer"], wrong)
    with pytest.raises(ValueError, match="no longer matches its generator"):
        reasoning_gym.score(t["answer"], {**t, "metadata": {**t["metadata"], "prompt_suffix": ANSWER_SUFFIX}})


def test_default_format_and_old_tasks_are_unchanged() -> None:
    """The defaults keep the prompt, the task id and exact scoring; a task written before the keys
    existed scores as before."""
    new = reasoning_gym.make_tasks("basic_arithmetic", 7, 4, KNOBS, source="arith")
    custom = _tasks("exact", n=4)
    assert all(t["prompt"].endswith(ANSWER_SUFFIX) for t in new)
    key = f"arith|basic_arithmetic|7|{new[0]['metadata']['index']}|{json.dumps(KNOBS, sort_keys=True)}"
    assert new[0]["task_id"] == hashlib.sha256(key.encode()).hexdigest()[:16]
    assert [t["task_id"] for t in new] != [t["task_id"] for t in custom]
    old = {**new[0], "metadata": {k: v for k, v in new[0]["metadata"].items()
                                  if k not in ("prompt_suffix", "answer_read")}}
    assert reasoning_gym.score(old["answer"], old) == 1.0
    assert reasoning_gym.score(f"x = {old['answer']}", old) < 1.0


def test_chain_sum_keeps_its_compact_format() -> None:
    with pytest.raises(ValidationError, match="chain_sum keeps its compact demo format"):
        ReasoningGymSource(family="chain_sum", answer="last_integer")
