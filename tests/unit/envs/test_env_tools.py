"""Math-with-Python and search environments, BM25, and the graders' components and audits."""

from __future__ import annotations

import pytest

from trajmesh import sandbox
from trajmesh.envs.math_tool import MathToolEnv
from trajmesh.envs.math_tool import make_tasks as math_tasks
from trajmesh.envs.search import BM25, SearchEnv
from trajmesh.envs.search import make_tasks as search_tasks
from trajmesh.graders import Sample, make_grader


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


# --------------------------------------------------------------------------- native tool calls

def _call(name: str, **arguments: object) -> str:
    import json

    return f"Thinking.\n<tool_call>\n{json.dumps({'name': name, 'arguments': arguments})}\n</tool_call>"


def test_native_prompts_declare_the_tools_as_json_schemas() -> None:
    task = math_tasks(0, 1, tool_format="native")[0]
    assert task["prompt"].startswith('Tools: python(code). Call <tool_call>{"name": ..., "arguments": {...}}'
                                     "</tool_call>; reply <answer>x</answer>.\n")
    assert task["metadata"]["tools"] == [{"type": "function", "function": {
        "name": "python", "description": "Run a Python program in a sandbox; returns what it prints (stdout, or the error).",
        "parameters": {"type": "object", "required": ["code"],
                       "properties": {"code": {"type": "string", "description": "The program."}}}}}]
    tags = math_tasks(0, 1)[0]
    assert tags["prompt"].startswith("Run python with <code>") and "tools" not in tags["metadata"]
    assert search_tasks(0, 1, tool_format="native")[0]["prompt"].startswith("Tools: search(query). Call <tool_call>")


def test_search_env_native_call_answers_with_plain_passages() -> None:
    task = search_tasks(0, 1, search={"max_searches": 1, "corpus_size": 20}, tool_format="native")[0]
    env = SearchEnv()
    env.reset(task, 0)
    step = env.step(_call("search", query=task["metadata"]["question"]))
    info = step.info or {}
    assert not step.done and step.observation.startswith("[1] ") and task["answer"] in step.observation
    assert "<information>" not in step.observation and step.observation == info["tool_call"]["response"]
    assert info["tool_call"]["native"] is True and info["tool_call"]["request"] == task["metadata"]["question"]
    over = env.step(_call("search", query="again"))
    assert over.observation == "search budget exhausted" and (over.info or {})["invalid_action"] == "search_budget"


def test_search_env_native_errors_are_answered_not_raised() -> None:
    task = search_tasks(0, 1, search={"corpus_size": 20})[0]
    env = SearchEnv()
    env.reset(task, 0)
    bad = env.step("<tool_call>{query: nile}</tool_call>")
    assert bad.observation == 'error: 1 malformed <tool_call> block(s): expected {"name": ..., "arguments": {...}}'
    assert not bad.done and (bad.info or {})["parser_error"] is True
    wrong = env.step(_call("lookup", query="x"))
    assert wrong.observation == "error: the only tool is search with one string argument \"query\"; got 'lookup'"
    assert (wrong.info or {})["invalid_action"] == "schema" and env.calls == 0
    assert env.step("<answer>x</answer>").done  # the old tags still work in the same episode


@pytest.mark.skipif(not sandbox.available(), reason="sandbox needs root")
def test_math_tool_native_python_call_runs_in_the_sandbox() -> None:
    task = math_tasks(0, 1, tool={"max_tool_calls": 2, "call_timeout_s": 3.0}, tool_format="native")[0]
    env = MathToolEnv()
    env.reset(task, 0)
    step = env.step(_call("python", code="print(6*7)"))
    info = step.info or {}
    assert not step.done and step.observation == "42"
    assert info["action_type"] == "CODE" and info["tool_call"]["status"] == "ok" and info["tool_call"]["native"]
    assert info["tool_call"]["request"] == "print(6*7)"
    legacy = env.step("<code>print(1+1)</code>")  # the demo model's tags, same episode
    assert legacy.observation == "<output>\n2\n\n</output>\n"
    assert env.step(_call("python", code="print(3)")).observation == "tool budget exhausted"


def test_math_tool_native_schema_mismatch_does_not_run() -> None:
    task = math_tasks(0, 1, tool_format="native")[0]
    env = MathToolEnv()
    env.reset(task, 0)
    wrong = env.step(_call("python", source="print(1)"))
    assert wrong.observation == "error: the only tool is python with one string argument \"code\"; got 'python'"
    assert (wrong.info or {})["invalid_action"] == "schema" and env.calls == 0 and not wrong.done
    bad = env.step('<tool_call>{"arguments": {"code": "print(1)"}}</tool_call>')
    assert (bad.info or {})["parser_error"] is True and env.calls == 0


def test_math_grader_counts_native_python_calls_as_tool_calls() -> None:
    text = (_call("python", code="print(1)") + "\n<code>print(2)</code>\n" + _call("search", query="x")
            + "<tool_call>{bad</tool_call><answer>3</answer>")
    g = make_grader("math").grade(Sample(text), {"answer": "3"})
    assert g.components["tool_calls"] == 2.0 and g.reward == 1.0  # one native python call + one <code>


def test_math_tool_sandbox_setup_failure_ends_the_episode_as_infra_failure() -> None:
    """A sandbox that cannot be set up is infrastructure, not the policy's doing: INFRA_FAILURE
    (dropped from training, counted apart in evaluation), not SANDBOX_ERROR; the service's
    `inject_sandbox_failure` knob fails the setup the same way (`sandbox.injected_setup_failure`)."""
    task = math_tasks(0, 1, tool={"max_tool_calls": 1, "call_timeout_s": 3.0})[0]
    env = MathToolEnv()
    env.reset(task, 0)
    with sandbox.injected_setup_failure("test"):
        step = env.step("<code>print(6*7)</code>")
    info = step.info or {}
    assert step.done and info["terminal_reason"] == "INFRA_FAILURE" and info["sandbox_error"] == "setup"
    assert "injected: test" in step.observation and info["tool_call"]["status"] == "sandbox_violation"
