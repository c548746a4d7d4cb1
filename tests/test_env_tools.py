"""Math-with-Python and search environments, BM25, and the graders' components and audits."""

from __future__ import annotations

import pytest
from trajmesh.envs.math_tool import MathToolEnv
from trajmesh.envs.math_tool import make_tasks as math_tasks
from trajmesh.envs.search import BM25, SearchEnv
from trajmesh.envs.search import make_tasks as search_tasks
from trajmesh.graders import Sample, make_grader

from trajmesh import sandbox


def test_bm25_ranks_the_matching_passage_first() -> None:
    idx = BM25(["the cat sat on the mat", "dogs chase cats", "a river runs through velmora"])
    assert idx.search("velmora river", 2)[0] == 2
    assert idx.search("zzz", 3) == []


def test_search_env_returns_passages_and_enforces_budget() -> None:
    task = search_tasks(0, 1, search={"max_searches": 1, "corpus_size": 20})[0]
    env = SearchEnv()
    env.reset(task, 0)
    first = env.step(f"<search>{task['metadata']['question']}</search>")
    assert first.observation.startswith("<information>") and task["answer"] in first.observation
    over = env.step("<search>again</search>")
    assert (over.info or {}).get("invalid_action") == "search_budget"
    assert env.step(f"<answer>{task['answer']}</answer>").done
    g = make_grader("search").grade(Sample(f"<answer> {task['answer'].upper()}. </answer>"), task)
    assert g.reward == 1.0 and g.audit == {"search_rename_invariant": 1.0}


@pytest.mark.skipif(not sandbox.available(), reason="sandbox needs root")
def test_math_tool_runs_code_in_the_sandbox() -> None:
    task = math_tasks(0, 1, tool={"max_tool_calls": 1, "call_timeout_s": 3.0})[0]
    env = MathToolEnv()
    env.reset(task, 0)
    step = env.step("<code>print(6*7)</code>")
    assert not step.done and "42" in step.observation and (step.info or {})["tool_call"]["status"] == "ok"
    assert (env.step("<code>print(1)</code>").info or {}).get("invalid_action") == "tool_budget"
    env.reset(task, 0)
    bad = env.step("<code>import socket; socket.create_connection(('127.0.0.1', 4222))</code>")
    assert bad.done and (bad.info or {})["terminal_reason"] == "SANDBOX_ERROR"
    assert env.step.__self__ is env  # the environment object is still usable
    g = make_grader("math").grade(Sample(f"<code>x</code><answer>{task['answer']}</answer>"), task)
    assert g.reward == 1.0 and g.components["tool_calls"] == 1.0 and "math_rename_invariant" in g.audit


def test_math_grader_equivalence_and_audit() -> None:
    g = make_grader("math").grade(Sample("<answer>\\frac{1}{2}</answer>"), {"answer": "0.5"})
    assert g.reward == 1.0
    assert make_grader("math").grade(Sample("no answer"), {"answer": "3"}).components["format_answer"] == 0.0
