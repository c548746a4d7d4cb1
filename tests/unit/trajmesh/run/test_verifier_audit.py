"""The verifier audit (trajmesh/run/audit.py) on real reasoning-gym families whose scorers are known
to misbehave (issue 25, read from the reasoning-gym package, not from the audit):
`game_of_life_halting` rewards any answer that is not the other verdict, `prime_factorization`'s
scorer raises on a non-numeric answer, `propositional_logic` has no gold answer (None); a sound
family (`word_sorting`) passes. `trajmesh train` refuses a refused source before anything starts.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from trajmesh.config import load_config
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
