"""The environments people already have train through the real mesh (NATS, Redis, every service a
process), all adapters as the sources of one run: a SkyRL-Gym environment
(``gsm8k_multi_turn``, per-turn rewards, rows built here) and a TextArena game (TicTacToe against
the fixed ``random`` opponent), with the tiny ChatML model of tests/chatml_model.py.

Checked: exact accounting (every admitted trajectory ends as exactly one final outcome, lag within
η, the gate's counters reconcile); every trajectory's tokens are the engine's (sampled tokens carry
a version and a log-prob, the rest mask 0 and version -1); each SkyRL trajectory's reward is the
environment's own return, recomputed here by stepping a fresh instance of the package's environment
with the trajectory's turns (not through the adapter), each game's is its outcome (1, 0, -1);
each trajectory's raw reward components are in the archive (each step's reward and their return);
and the held-out evaluation of each source (what `trajmesh train` writes to summary.json) runs
through its own environment, with the package's version in the recorded revision. The verifiers
adapter has its own run, in the venv that has verifiers (tests/e2e/test_e2e_verifiers.py).
"""

from __future__ import annotations

import importlib.metadata
from pathlib import Path
from typing import Any

import pytest
from mesh_checks import check_engine_tokens, engine_answers, sampled_turns, tid_of, train_and_evaluate

from trajmesh.config import load_config
from trajmesh.rollout.engines.engine_client import ANSWER_LOG_ENV
from trajmesh.tasks import load_split

# slow: about 100 s on the 2 loaded cores of the dev machine (mesh start, 3 steps, held-out
# evaluation), past the default suite's budget for one test.
pytestmark = [pytest.mark.e2e, pytest.mark.slow, pytest.mark.timeout(400)]
pytest.importorskip("skyrl_gym")
pytest.importorskip("textarena")

ROWS = [{"prompt": [{"role": "user", "content": f"{i} + {i} = ? End with #### N."}],
         "reward_spec": {"ground_truth": str(2 * i)}, "max_turns": 2} for i in range(30)]
SOURCES: list[dict[str, Any]] = [
    {"type": "gym", "name": "skyrl", "env": "gsm8k_multi_turn", "rows": ROWS},
    {"type": "gym", "name": "tictactoe", "env": "textarena:TicTacToe-v0"},
]
STEPS = 3

NAMES = [src["name"] for src in SOURCES]


@pytest.fixture(scope="module")
def chat_model_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    from chatml_model import build_chatml_model

    cfg = load_config(None, {"tasks.sources": SOURCES})
    texts = [t.prompt for src in cfg.tasks.sources for t in load_split(src, 10, 2)[0]]
    texts += ["#### 4", "[4]", "[0]", "12", "7"] * 20
    return str(build_chatml_model(tmp_path_factory.mktemp("gym-model") / "model", texts, max_positions=2048))


def _env_return(row: dict[str, Any], turns: list[str]) -> float:
    """The episode's return straight from the package (no adapter): a fresh SkyRL environment
    stepped with the turns."""
    import skyrl_gym

    env = skyrl_gym.make("gsm8k_multi_turn", env_config={}, extras=row)
    env.init(row["prompt"])
    rewards = []
    for turn in turns:
        out = env.step(turn)
        rewards.append(float(out["reward"]))
        if out["done"]:
            break
    return sum(rewards)


def test_gym_adapters_train_through_one_mesh(tmp_path: Path, chat_model_dir: str, monkeypatch: pytest.MonkeyPatch) -> None:
    from trajmesh.learner.evaluate import heldout_tasks
    from trajmesh.run.train import evaluation_protocol
    from trajmesh.tokenizer import load_tokenizer

    cfg = load_config(None, {
        "run_dir": str(tmp_path / "run"), "model.path": chat_model_dir, "gate.eta": 1,
        "tasks.sources": SOURCES, "tasks.group_size": 2, "tasks.train_size": 20, "tasks.heldout_size": 2,
        "tasks.sampling.max_new_tokens": 6, "tasks.sampling.max_turns": 3,
        "rollout.replicas": 1, "rollout.concurrent_tasks": 4, "grader.replicas": 1,
        "rollout.agent_endpoint.max_tokens": 6,
        "store.drop_zero_variance_groups": False,
        "learner.engine.type": "torch", "learner.batch_groups": 2, "learner.max_steps": STEPS,
        "learner.checkpoint_every": STEPS,
    })
    answers_dir = tmp_path / "engine-answers"  # every answer the torch engines give, for check_engine_tokens
    answers_dir.mkdir()
    monkeypatch.setenv(ANSWER_LOG_ENV, str(answers_dir))
    rows, _ = train_and_evaluate(cfg, STEPS, timeout_s=240)
    answers = engine_answers(answers_dir)
    assert evaluation_protocol(cfg, heldout_tasks(cfg))["sources"]["tictactoe"]["environments"] == {
        "textarena": f"textarena-adapter-v1+textarena-{importlib.metadata.version('textarena')}"}

    tok = load_tokenizer(chat_model_dir)
    accepted = [r for r in rows if r["outcome"] == "accepted"]
    by_source = {name: [r for r in accepted if r["task_source"] == name] for name in NAMES}
    assert all(by_source.values()), {k: len(v) for k, v in by_source.items()}
    tasks = {t.task_id: t for src in cfg.tasks.sources for t in load_split(src, 20, 2)[0]}
    for r in accepted:
        ids, mask = check_engine_tokens(r, answers)
        turns = sampled_turns(ids, mask, tok)
        if r["terminal_reason"] == "MAX_TOKENS":  # the last turn was cut: the environment never saw it
            turns = turns[:-1]
        components = dict(r["reward_components"])  # archived with the trajectory, as graded
        if r["task_source"] in ("skyrl", "tictactoe"):  # the adapter's: each step's reward, their sum
            steps = int(components["steps"])
            assert set(components) == {"return", "steps", *(f"step_{k}" for k in range(1, steps + 1))}, components
            assert components["return"] == pytest.approx(sum(components[f"step_{k}"] for k in range(1, steps + 1)))
        if r["task_source"] == "skyrl":  # the package's own rewards for the trajectory's turns
            row = tasks[tid_of(r["task_id"], tasks)].metadata["row"]
            assert r["reward"] == pytest.approx(_env_return(row, turns)), (r["trajectory_id"], turns)
        else:  # the game's outcome for the policy's seat
            assert r["reward"] in (-1.0, 0.0, 1.0)
