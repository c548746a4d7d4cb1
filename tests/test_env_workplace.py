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
