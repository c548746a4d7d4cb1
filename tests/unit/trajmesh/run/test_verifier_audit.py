"""The verifier audit (trajmesh/run/audit.py) on real reasoning-gym families whose scorers are known
to misbehave (issue 25, read from the reasoning-gym package, not from the audit):
`game_of_life_halting` rewards any answer that is not the other verdict, `prime_factorization`'s
scorer raises on a non-numeric answer, `propositional_logic` has no gold answer (None); a sound
family (`word_sorting`) passes. `trajmesh train` refuses a refused source before anything starts.

Environment-reward sources (issue 44; `SourcePlugin.reward_from`) are probed with actions, not a gold
answer: `gym` sources over Gymnasium-API classes written here (one sound, one that rewards any
action, one that crashes on an empty action) and a TextArena game played to its end with its
scripted legal move. A reference-answer source whose gold answer its grader scores below 1 (a
test-only source registered here, graded against ``#### N`` while its answer is ``N``, the SkyRL
gsm8k mismatch) is reported as a problem, not as ok.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Literal

import pytest
import yaml

from trajmesh import plugins
from trajmesh.config import SourceConfig, load_config
from trajmesh.envs.base import SingleAnswerEnv
from trajmesh.graders import Grade, Sample
from trajmesh.run import audit


def _source(family: str):  # type: ignore[no-untyped-def]
    return load_config(None, {"tasks.sources": [{"type": "reasoning_gym", "name": family, "family": family}]}
                       ).tasks.sources[0]


def test_a_family_that_rewards_garbage_is_refused() -> None:
    a = audit.audit_source(_source("game_of_life_halting"), 4)
    assert a.tasks == 4 and a.accepted["garbage"] == 4 and a.accepted["empty"] == 0
    assert any(r.startswith("accepts garbage on 4/4") for r in a.refused), a.refused


def test_a_scorer_that_raises_on_model_output_is_reported() -> None:
    a = audit.audit_source(_source("prime_factorization"), 4)
    assert "ValueError" in a.raised["garbage"], a.raised
    assert a.gold_rejected == 0  # its gold answers score 1


def test_a_family_without_gold_answers_is_refused() -> None:
    a = audit.audit_source(_source("propositional_logic"), 4)
    assert a.gold_missing == 4
    assert "no gold answer on 4/4" in a.refused


def test_a_sound_family_passes_and_the_table_says_so() -> None:
    good = audit.audit_source(_source("word_sorting"), 4)
    assert good.refused == [] and good.raised == {} and good.gold_rejected == 0
    bad = audit.audit_source(_source("propositional_logic"), 4)
    table = audit.format_table([good, bad]).splitlines()
    assert table[1].startswith("word_sorting") and table[1].endswith("ok")
    assert "refused: " in table[2] and table[-1] == "2 sources, 1 refused: propositional_logic"


def test_train_refuses_a_refused_source_before_anything_starts(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    config = tmp_path / "run.yaml"
    config.write_text(yaml.safe_dump({
        "run_dir": str(run_dir), "tasks": {"verifier_audit_tasks": 2, "sources": [
            {"type": "reasoning_gym", "name": "gol", "family": "game_of_life_halting"}]}}))
    proc = subprocess.run([sys.executable, "-m", "trajmesh.run.cli", "train", str(config)],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "verifier audit refused gol (accepts garbage on 2/2" in proc.stderr, proc.stderr
    record = json.loads((run_dir / "verifier_audit.json").read_text())
    assert record["mode"] == "refuse" and record["sources"][0]["refused"]
    assert sorted(p.name for p in run_dir.iterdir()) == ["verifier_audit.json"]  # no model, no mesh


@pytest.mark.parametrize("mode", ["warn", "off"])
def test_warn_and_off_let_the_run_start(tmp_path: Path, mode: str) -> None:
    cfg = load_config(None, {"tasks.verifier_audit": mode, "tasks.verifier_audit_tasks": 2, "tasks.sources": [
        {"type": "reasoning_gym", "name": "gol", "family": "game_of_life_halting"}]})
    audits = audit.audit_run(cfg, tmp_path)
    assert (tmp_path / "verifier_audit.json").exists() == (mode == "warn")
    assert [a.source for a in audits if a.refused] == (["gol"] if mode == "warn" else [])


def test_the_demo_source_passes() -> None:
    """The default source (chain_sum, the demo's) is not refused: the demo still starts."""
    a = audit.audit_source(load_config(None, {}).tasks.sources[0], 8)
    assert a.refused == [] and a.gold_rejected == 0


# --------------------------------------------------------------------------- environment-reward sources


class Guess:
    """A Gymnasium-API environment: guess the row's secret in one action; reward 1 when right."""

    def reset(self, seed: int | None = None, options: dict[str, Any] | None = None) -> tuple[str, dict[str, Any]]:
        self.secret = str((options or {})["secret"])
        return "Guess the secret word.", {}

    def step(self, action: str) -> tuple[str, float, bool, bool, dict[str, Any]]:
        return "", float(action.strip() == self.secret), True, False, {}

    def close(self) -> None:
        pass


class Anything(Guess):
    """Rewards any non-empty action: garbage earns the success reward."""

    def step(self, action: str) -> tuple[str, float, bool, bool, dict[str, Any]]:
        return "", float(bool(action)), True, False, {}


class Fragile(Guess):
    """Reads the action's first word: an empty action crashes it (IndexError)."""

    def step(self, action: str) -> tuple[str, float, bool, bool, dict[str, Any]]:
        return "", float(action.split()[0] == self.secret), True, False, {}


def _gym(env: str) -> dict[str, Any]:
    rows = [{"prompt": f"Guess {i}.", "secret": f"word{i}"} for i in range(6)]  # no gold answer
    return {"type": "gym", "name": env.lower(), "env": f"{__name__}:{env}", "rows": rows}


def _source_cfg(entry: dict[str, Any]) -> Any:
    return load_config(None, {"tasks.sources": [entry]}).tasks.sources[0]


def test_an_environment_reward_source_passes_the_default_audit(tmp_path: Path) -> None:
    cfg = load_config(None, {"tasks.verifier_audit_tasks": 2, "tasks.sources": [_gym("Guess")]})
    assert cfg.tasks.verifier_audit == "refuse"
    (a,) = audit.audit_run(cfg, tmp_path)  # no VerifierAuditRefused
    assert a.reward_from == "environment" and a.tasks == 2 and a.refused == [] and a.problems == []
    assert a.accepted == {"empty": 0, "garbage": 0} and a.raised == {} and a.gold_missing == 0
    line = audit.format_table([a]).splitlines()[1]
    assert line.split()[2:4] == ["-", "-"]  # no gold answer graded
    assert line.endswith("ok (environment reward, no scripted play)")


def test_garbage_rewarded_by_an_environment_is_refused() -> None:
    a = audit.audit_source(_source_cfg(_gym("Anything")), 2)
    assert a.accepted == {"empty": 0, "garbage": 2}
    assert a.refused == ["accepts garbage on 2/2"]


def test_an_environment_grader_that_crashes_on_an_empty_action_is_refused() -> None:
    a = audit.audit_source(_source_cfg(_gym("Fragile")), 2)
    assert a.raised.keys() == {"empty"} and "IndexError" in a.raised["empty"]
    assert a.refused == [f"grader raises on empty: {a.raised['empty']}"]


def test_a_game_is_played_with_its_scripted_legal_move() -> None:
    pytest.importorskip("textarena")
    a = audit.audit_source(_source_cfg({"type": "gym", "name": "tictactoe", "env": "textarena:TicTacToe-v0"}), 3)
    assert a.reward_from == "environment" and a.played == 3 and a.raised == {}
    assert a.refused == [] and a.accepted == {"empty": 0, "garbage": 0}
    assert audit.format_table([a]).splitlines()[1].endswith("ok (environment reward, scripted play on 3/3)")


# --------------------------------------------------------------------------- a gold answer scored below 1


class HashSource(SourceConfig):
    """A test-only reference-answer source: "a+b=" sums whose answer is the sum."""

    type: Literal["hash_sum"] = "hash_sum"
    """Selects this source."""
    name: str = "hash_sum"
    """Source name recorded on every task."""


class HashGrader:
    """Full credit only for ``#### <answer>``: the task's own answer, ``N``, scores 0."""

    revision = "hash-grader-v1"
    components = ("correct",)

    def grade(self, sample: Sample, task: dict[str, Any]) -> Grade:
        ok = float(sample.text.strip() == f"#### {task['answer']}")
        return Grade(ok, {"correct": ok}, sample.text, self.revision)


def _draw_sums(src: HashSource, seed: int, n: int, exclude: set[str]) -> list[dict[str, Any]]:
    return [{"prompt": f"{seed % 89 + i}+{i}=", "answer": str(seed % 89 + 2 * i), "task_id": f"hash-{seed}-{i}",
             "metadata": {"source": src.name, "grader": "hash_sum", "environment": "hash_env"}}
            for i in range(n) if f"{seed % 89 + i}+{i}=" not in exclude]


@pytest.fixture
def hash_sum() -> Iterator[None]:
    plugins.register_source(plugins.SourcePlugin(type="hash_sum", config=HashSource, draw=_draw_sums,
                                                 environments={"hash_env": SingleAnswerEnv},
                                                 graders={"hash_sum": HashGrader}))
    yield
    plugins.unregister_source("hash_sum")


@pytest.mark.usefixtures("hash_sum")
def test_a_gold_answer_scored_below_1_is_a_problem_not_ok(tmp_path: Path) -> None:
    cfg = load_config(None, {"tasks.verifier_audit_tasks": 3, "tasks.sources": [{"type": "hash_sum"}]})
    (a,) = audit.audit_run(cfg, tmp_path)  # a problem, not a refusal: the run may start
    assert a.reward_from == "reference" and a.gold_rejected == 3 and a.refused == []
    assert a.problems == ["gold answer scores below 1 on 3/3"]
    table = audit.format_table([a]).splitlines()
    assert table[1].endswith("problem: gold answer scores below 1 on 3/3") and " ok" not in table[1]
    assert table[-1] == "1 sources, 0 refused; 1 with problems: hash_sum"
    record = json.loads((tmp_path / "verifier_audit.json").read_text())
    assert record["sources"][0]["problems"] == ["gold answer scores below 1 on 3/3"]
