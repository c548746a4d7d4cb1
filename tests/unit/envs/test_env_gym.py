"""The ``gym`` source (envs/gym_env.py) on the real packages: a SkyRL-Gym environment (its
``gsm8k_multi_turn``, per-turn rewards), a TextArena game (TicTacToe against the fixed ``first``
opponent), and a class with the Gymnasium API written here (a user's own environment). The grader
(graders/gym.py) replays the turns and scores the environment's own rewards."""

from __future__ import annotations

from typing import Any

import pytest

from trajmesh.config import load_config
from trajmesh.envs.base import make_environment
from trajmesh.graders import make_grader
from trajmesh.graders.base import Sample
from trajmesh.graders.gym import ReplayMismatch
from trajmesh.tasks import load_split

pytest.importorskip("skyrl_gym")
pytest.importorskip("textarena")

ROWS = [{"prompt": [{"role": "user", "content": f"What is {i} + {i}? End with '#### N'."}],
         "reward_spec": {"ground_truth": str(2 * i)}, "max_turns": 2} for i in range(12)]


def _source(**src: Any) -> Any:
    return load_config(None, {"tasks.sources": [src]}).tasks.sources[0]


def _play(task: Any, actions: list[str]) -> tuple[list[Any], list[str]]:
    view = {"prompt": task.prompt, "answer": task.answer, "metadata": task.metadata}
    env = make_environment(task.environment)
    _, h = env.reset(view, 7)
    results, hashes = [], [h]
    for a in actions:
        res = env.step(a)
        results.append(res)
        hashes.append(res.state_hash)
        if res.done:
            break
    return results, hashes


def _grade(task: Any, turns: list[str], hashes: list[str]) -> Any:
    view = {"prompt": task.prompt, "answer": task.answer, "metadata": task.metadata}
    return make_grader("gym").grade(Sample("".join(turns), turns, True, hashes, "EOS"), view)


def test_skyrl_rows_split_and_per_turn_rewards() -> None:
    train, held = load_split(_source(type="gym", name="g8k", env="gsm8k_multi_turn", rows=ROWS), 8, 3)
    assert len(held) == 3 and len(train) == 8
    assert not {t.prompt for t in train} & {t.prompt for t in held}
    task = train[0]
    row = task.metadata["row"]
    assert task.prompt == row["prompt"][0]["content"] and task.answer == row["reward_spec"]["ground_truth"]
    wrong = str(int(task.answer) + 1)
    results, hashes = _play(task, [f"#### {wrong}", f"#### {task.answer}"])
    # gsm8k_multi_turn: a well-formatted wrong answer earns format_score 0.2 / max_turns, the right one 1.0
    assert [r.reward for r in results] == [pytest.approx(0.1), 1.0]
    assert not results[0].done and results[0].observation and results[1].done
    grade = _grade(task, [f"#### {wrong}", f"#### {task.answer}"], hashes)
    assert grade.reward == pytest.approx(1.1)
    assert grade.components == {"return": pytest.approx(1.1), "steps": 2.0, "step_1": pytest.approx(0.1),
                                "step_2": 1.0}
    last = _grade(task.__class__(**{**task.__dict__, "metadata": {**task.metadata, "reward": "last"}}),
                  [f"#### {wrong}", f"#### {task.answer}"], hashes)
    assert last.reward == 1.0


def test_a_replay_that_diverges_is_an_error_not_a_reward() -> None:
    (task, *_), _ = load_split(_source(type="gym", name="g8k", env="gsm8k_multi_turn", rows=ROWS), 4, 2)
    _, hashes = _play(task, ["#### 0", "#### 1"])
    with pytest.raises(ReplayMismatch):
        _grade(task, ["#### 0", "#### 2"], hashes)  # not the turns the environment saw


def test_textarena_game_against_the_fixed_opponent() -> None:
    train, held = load_split(_source(type="gym", name="ttt", env="textarena:TicTacToe-v0", opponent="first"), 3, 2)
    assert {t.metadata["game_seed"] for t in train}.isdisjoint(t.metadata["game_seed"] for t in held)
    task = train[0]
    assert task.environment == "textarena" and "Available Moves" in task.prompt
    # the policy (O, seat 0) plays 0, 4, 8; `first` answers the lowest free cell: 1, then 2
    results, hashes = _play(task, ["[0]", "[4]", "[8]"])
    assert "placed their symbol (X) in cell 1" in results[0].observation
    assert "placed their symbol (X) in cell 2" in results[1].observation
    assert [r.reward for r in results] == [0.0, 0.0, 1.0] and results[-1].done  # the diagonal wins
    assert _grade(task, ["[0]", "[4]", "[8]"], hashes).reward == 1.0
    results, hashes = _play(task, ["[3]", "[5]", "[6]"])  # X takes 0, 1, 2: the top row
    assert results[-1].done and results[-1].reward == -1.0
    assert _grade(task, ["[3]", "[5]", "[6]"], hashes).components["return"] == -1.0


class CountTo:
    """A user's Gymnasium-API environment: say the next number; reward 1 per right number."""

    def __init__(self, target: int = 3) -> None:
        self.target = target

    def reset(self, seed: int | None = None, options: dict[str, Any] | None = None) -> tuple[str, dict[str, Any]]:
        self.n = int((options or {}).get("start", 0))
        return f"Count from {self.n} to {self.target}.", {}

    def step(self, action: str) -> tuple[str, float, bool, bool, dict[str, Any]]:
        right = action.strip() == str(self.n + 1)
        self.n += right
        return f"now at {self.n}", float(right), self.n >= self.target, False, {"right": right}

    def close(self) -> None:
        pass


def test_gymnasium_api_class_by_import_path() -> None:
    rows = [{"prompt": f"Count from {i}.", "start": i} for i in range(4)]
    src = _source(type="gym", name="count", env=f"{__name__}:CountTo", env_config={"target": 5}, rows=rows)
    train, held = load_split(src, 3, 1)
    task = next(t for t in [*train, *held] if t.metadata["row"]["start"] == 3)
    results, hashes = _play(task, ["4", "x", "5"])
    assert [r.reward for r in results] == [1.0, 0.0, 1.0] and results[-1].done
    assert results[0].observation == "now at 4" and results[1].info["env_info"] == {"right": False}
    assert _grade(task, ["4", "x", "5"], hashes).reward == 2.0


def test_a_source_without_tasks_is_rejected() -> None:
    with pytest.raises(ValueError, match="needs rows or rows_file"):
        _source(type="gym", name="g", env="gsm8k")
