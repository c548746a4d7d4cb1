"""Invalid configs fail fast with a message naming the key and the fix (no process is started)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from trajmesh.config import ConfigError, load_config
from trajmesh.infra import free_port
from trajmesh.run.launcher import preflight

CASES = [
    # (overrides, words the message must contain)
    ({"learnr": {}}, ["learnr", "remove it or check its spelling"]),
    ({"learner.lrr": 1e-4}, ["learner.lrr", "remove it or check its spelling"]),
    ({"gate.eta": "two"}, ["gate.eta", "'two'"]),
    ({"gate.eta": -1}, ["gate.eta", "greater than or equal to 0"]),
    ({"tasks.group_size": 1}, ["group_size >= 2", "scale_by_std: false"]),
    ({"tasks.group_size": 0}, ["tasks.group_size"]),
    ({"learner.lr": 0}, ["learner.lr", "greater than 0"]),
    ({"tasks.sampling.temperature": -0.5}, ["tasks.sampling.temperature"]),
    ({"rollout.engine.type": "sglang"}, ["rollout.engine.url", "Field required", "add it"]),
    ({"rollout.engine.synthetic": {}}, ["rollout.engine.synthetic", "'torch' has no such setting", "synthetic"]),
    ({"rollout.engine.type": "tgi"}, ["rollout.engine.type", "'tgi'", "vllm"]),
    ({"learner.objective.mis_low": 3.0}, ["learner.objective.mis_low", "less than 1"]),  # MIS keeps w in [lo < 1 < hi]
    ({"mode": "eventually"}, ["mode", "'eventually'"]),
    ({"learner.engine.zero_stage": 4}, ["learner.engine.zero_stage"]),
    ({"learner.engine.type": "torch", "learner.engine.zero_stage": 2}, ["zero_stage 2", "type: deepspeed"]),
    ({"tasks.sources": [{"type": "nope"}]}, ["tasks.sources"]),
    # GRPO-RoC admits 2 x G a task: with eta 0 a kept group's G can leave less capacity than that
    ({"store.resample_on_correct.enabled": True, "mode": "sync"},
     ["store.resample_on_correct", "eta x learner.batch_groups >= oversample - 1", "sync mode"]),
    ({"store.resample_on_correct.answer_pattern": "(<answer>"}, ["answer_pattern", "not a regular expression"]),
]


@pytest.mark.parametrize("overrides,words", CASES, ids=[next(iter(c[0])) for c in CASES])
def test_invalid_config_names_key_and_fix(overrides: dict, words: list[str]) -> None:
    with pytest.raises(ConfigError) as err:
        load_config(None, overrides)
    for w in words:
        assert w in str(err.value), str(err.value)


def test_missing_file_and_non_mapping(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "nope.yaml")
    bad = tmp_path / "list.yaml"
    bad.write_text("- a\n- b\n")
    with pytest.raises(ConfigError, match="mapping at the top level"):
        load_config(bad)


def test_unreachable_servers_and_missing_model_fail_preflight(tmp_path: Path) -> None:
    closed = free_port()
    with pytest.raises(ConfigError, match=r"infra\.nats_url: cannot reach"):
        preflight(load_config(None, {"infra.nats_url": f"nats://127.0.0.1:{closed}"}))
    with pytest.raises(ConfigError, match=r"infra\.redis_url: cannot reach"):
        preflight(load_config(None, {"infra.redis_url": f"redis://127.0.0.1:{closed}/0"}))
    with pytest.raises(ConfigError, match=r"model\.path: .*\(no config\.json\)"):
        preflight(load_config(None, {"model.path": str(tmp_path)}))


def test_cli_reports_config_errors_with_exit_2(tmp_path: Path) -> None:
    cfg = tmp_path / "c.yaml"
    cfg.write_text("gate:\n  eta: -3\n")
    res = subprocess.run([sys.executable, "-m", "trajmesh.run.cli", "train", str(cfg)], capture_output=True, text=True,
                         timeout=60)
    assert res.returncode == 2 and "gate.eta" in res.stderr
    res = subprocess.run([sys.executable, "-m", "trajmesh.run.cli", "serve", "store", "--config", str(tmp_path / "x.yaml")],
                         capture_output=True, text=True, timeout=60)
    assert res.returncode == 2 and "does not exist" in res.stderr
    empty = tmp_path / "empty.yaml"
    empty.write_text("{}\n")
    res = subprocess.run([sys.executable, "-m", "trajmesh.run.cli", "serve", "grader", "--config", str(empty)],
                         capture_output=True, text=True, timeout=60)
    assert res.returncode == 2 and "infra.nats_url" in res.stderr and "model.path" in res.stderr
    res = subprocess.run([sys.executable, "-m", "trajmesh.run.cli", "train", str(empty), "--set", "noequals"],
                         capture_output=True, text=True, timeout=60)
    assert res.returncode == 2 and "key=value" in res.stderr
