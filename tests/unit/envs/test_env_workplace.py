"""The stateful environment: deterministic reset, replay reproduces the state hash at every step."""

from __future__ import annotations

import json

from trajmesh.envs.workplace import WorkplaceEnv, expected_state_hash, make_tasks
from trajmesh.graders import Sample, make_grader


def _actions(task: dict) -> list[str]:
    calls = [f"<tool>{json.dumps({'name': n, 'arguments': a})}</tool>" for n, a in task["metadata"]["solution"]]
    return ['<tool>{"name":"list_tasks","arguments":{"status":"open"}}</tool>', "<tool>{bad json</tool>",
            '<tool>{"name":"update_task","arguments":{"task_id":"x"}}</tool>', *calls, "<done/>"]


def test_replay_reproduces_state_hash_at_every_step() -> None:
    for task in make_tasks(3, 6):
        actions = _actions(task)
        runs = []
        for seed in (0, 1):  # the reset seed never changes the state (GiGPO anchors match across a group)
            env = WorkplaceEnv()
            _, h = env.reset(task, seed)
            hashes = [h] + [env.step(a).state_hash for a in actions]
            runs.append(hashes)
        assert runs[0] == runs[1]
        assert runs[0][-1] == expected_state_hash(task["metadata"]) == task["answer"]


def test_invalid_actions_are_answered_not_applied() -> None:
    task = make_tasks(5, 1)[0]
    env = WorkplaceEnv()
    _, h0 = env.reset(task, 0)
    bad = env.step("<tool>{oops</tool>")
    assert not bad.done and bad.observation.startswith("<error>") and (bad.info or {}).get("parser_error")
    wrong = env.step('<tool>{"name":"create_task","arguments":{"title":3}}</tool>')
    assert wrong.state_hash == h0 and (wrong.info or {}).get("invalid_action") == "schema"


def test_grader_replays_the_action_log() -> None:
    task = make_tasks(7, 1)[0]
    actions = _actions(task)
    g = make_grader("workplace").grade(Sample("".join(actions), actions), task)
    assert g.reward == 1.0 and g.components["invalid_actions"] == 2.0
    g0 = make_grader("workplace").grade(Sample("<done/>", ["<done/>"]), task)
    assert g0.reward == 0.0


def test_a_session_may_step_on_another_thread_than_it_reset_on() -> None:
    """The environment service runs blocking steps with asyncio.to_thread (any worker thread)."""
    from concurrent.futures import ThreadPoolExecutor

    task = make_tasks(0, 1)[0]
    env = WorkplaceEnv()
    with ThreadPoolExecutor(max_workers=1) as a, ThreadPoolExecutor(max_workers=1) as b:
        a.submit(env.reset, task, 0).result()
        name, args = task["metadata"]["solution"][0]
        res = b.submit(env.step, f"<tool>{json.dumps({'name': name, 'arguments': args})}</tool>").result()
    assert "<result>" in res.observation and not res.done


# --------------------------------------------------------------------------- native tool calls

def _native(name: str, args: dict) -> str:
    return f"<tool_call>\n{json.dumps({'name': name, 'arguments': args})}\n</tool_call>"


def test_native_calls_execute_and_answer_with_plain_json() -> None:
    task = make_tasks(5, 1, tool_format="native")[0]
    assert task["prompt"].startswith("Tools: find_employee(name); list_tasks(assignee_id, status); ")
    assert [t["function"]["name"] for t in task["metadata"]["tools"]] == [
        "find_employee", "list_tasks", "update_task", "create_task", "schedule_meeting"]
    env = WorkplaceEnv()
    _, h0 = env.reset(task, 0)
    made = env.step(_native("create_task", {"title": "demo prep", "assignee_id": 1}))
    assert made.observation == '{"task_id": 9}'  # 8 tasks in a default database
    assert made.state_hash != h0 and (made.info or {})["tool_call"]["native"] is True
    done = env.step(_native("update_task", {"task_id": 9, "status": "done"}))
    assert done.observation == '{"ok": true}' and (done.info or {})["tool_call"]["status"] == "ok"
    h1 = done.state_hash
    wrong = env.step(_native("create_task", {"title": 3, "assignee_id": 1}))
    assert wrong.observation == '{"error": "create_task: title must be string"}' and wrong.state_hash == h1
    assert (wrong.info or {})["invalid_action"] == "schema"
    bad = env.step("<tool_call>{oops</tool_call>")
    assert bad.observation.startswith("error: parse: 1 malformed <tool_call> block") and (bad.info or {})["parser_error"]
    assert env.step("<done/>").done


def test_grader_replays_a_native_action_log() -> None:
    task = make_tasks(7, 1, tool_format="native")[0]
    actions = ["<tool_call>{not json</tool_call>",
               *[_native(n, a) for n, a in task["metadata"]["solution"]], "<done/>"]
    g = make_grader("workplace").grade(Sample("".join(actions), actions), task)
    assert g.reward == 1.0 and g.components["invalid_actions"] == 1.0
