"""Provenance: the environment's own revision reaches the Reset reply (and so every trajectory), and
the manifest records framework versions, a dirty-tree flag, the truncation policy and the
evaluation protocol, all part of its content hash."""

from __future__ import annotations

import asyncio
import os
import subprocess
from importlib.metadata import version
from pathlib import Path

import grpc
import pytest

from trajmesh.config import load_config
from trajmesh.envs.math_tool import MathToolEnv
from trajmesh.envs.workplace import WorkplaceEnv
from trajmesh.envs.workplace import make_tasks as workplace_tasks
from trajmesh.run.manifest import build_manifest, framework_versions, tree_is_dirty, truncation_policy
from trajmesh.services.environment import EnvironmentService
from trajmesh.v1 import services_pb2, services_pb2_grpc, trajectory_pb2


def test_reset_reply_carries_the_serving_environments_revision(tmp_path: Path) -> None:
    task = workplace_tasks(0, 1)[0]

    async def body() -> tuple[str, str]:
        svc = EnvironmentService(load_config(None, {"run_dir": str(tmp_path / "run")}))
        await svc.setup()
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{svc.grpc_port}") as ch:
                stub = services_pb2_grpc.EnvironmentStub(ch)
                import json

                wp = trajectory_pb2.Task(task_id="w", environment="workplace", prompt=task["prompt"],
                                         metadata_json=json.dumps(task["metadata"]))
                mt = trajectory_pb2.Task(task_id="m", environment="math_tool", prompt="1+1?", answer="2")
                a = await stub.Reset(services_pb2.ResetRequest(session_id="a", task=wp, seed=0))
                b = await stub.Reset(services_pb2.ResetRequest(session_id="b", task=mt, seed=0))
                return a.environment_revision, b.environment_revision
        finally:
            await svc.stop()

    assert asyncio.run(body()) == ("workplace-v1", "math_tool-v1")
    assert (WorkplaceEnv.revision, MathToolEnv.revision) == ("workplace-v1", "math_tool-v1")


def test_framework_versions_lists_installed_distributions_only() -> None:
    found = framework_versions(("pytest", "pydantic", "no-such-distribution-trajmesh"))
    assert found == {"pytest": pytest.__version__, "pydantic": version("pydantic")}


def _git(repo: Path, *args: str) -> None:
    env = {**os.environ, "GIT_CONFIG_GLOBAL": os.devnull, "GIT_CONFIG_NOSYSTEM": "1"}
    subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@example.invalid", *args], cwd=repo, env=env,
                   check=True, capture_output=True)


def test_dirty_tree_flag_follows_tracked_changes(tmp_path: Path) -> None:
    assert tree_is_dirty(tmp_path) is False  # not a checkout
    _git(tmp_path, "init", "-q")
    (tmp_path / "a.py").write_text("x = 1\n")
    _git(tmp_path, "add", "a.py")
    _git(tmp_path, "commit", "-q", "-m", "a")
    assert tree_is_dirty(tmp_path) is False
    (tmp_path / "untracked.txt").write_text("notes")
    assert tree_is_dirty(tmp_path) is False  # untracked files do not change what runs
    (tmp_path / "a.py").write_text("x = 2\n")
    assert tree_is_dirty(tmp_path) is True


def _settings(**over: object) -> dict[str, object]:
    base: dict[str, object] = dict(code_commit="c", config={"seed": 0}, model_revision="m", tokenizer_revision="t",
                                   chat_template="", environment_revisions={"workplace": "workplace-v1"},
                                   grader_revisions={"workplace": "workplace-final-state-v1"}, algorithm={"eta": 1},
                                   framework_versions={"torch": "2.5.0"}, dirty_tree=False,
                                   truncation_policy={"policy": "grader_reward"},
                                   evaluation_protocol={"sampled": {"samples_per_problem": 4}},
                                   created_unix_seconds=1.0)
    base.update(over)
    return base


@pytest.mark.parametrize("override", [
    {"framework_versions": {"torch": "2.6.0"}},
    {"dirty_tree": True},
    {"truncation_policy": {"policy": "mask"}},
    {"evaluation_protocol": {"sampled": {"samples_per_problem": 8}}},
], ids=lambda o: next(iter(o)))
def test_new_provenance_fields_are_hashed(override: dict[str, object]) -> None:
    first = build_manifest(**_settings())  # type: ignore[arg-type]
    assert first.framework_versions["torch"] == "2.5.0" and first.dirty_tree is False
    assert build_manifest(**_settings(**override)).manifest_id != first.manifest_id  # type: ignore[arg-type]


def test_truncation_policy_records_the_budgets() -> None:
    cfg = load_config(None, {"tasks.sampling.max_new_tokens": 7, "tasks.sampling.max_turns": 3})
    policy = truncation_policy(cfg)
    assert policy["max_new_tokens_per_turn"] == 7 and policy["max_turns"] == 3
    assert policy["truncated_terminal_reasons"] == ["MAX_TOKENS", "MAX_TURNS"]


def test_engine_server_version_is_read_from_a_real_engine(tiny_model_dir: str, tmp_path: Path) -> None:
    """The manifest records the SGLang server's own version (`/get_server_info`); here the torch
    engine, which serves the same endpoint."""
    import signal
    import sys
    import time

    from trajmesh.infra import free_port
    from trajmesh.run.manifest import engine_server_version

    port = free_port()
    log = open(tmp_path / "engine.log", "w")  # noqa: SIM115
    proc = subprocess.Popen([sys.executable, "-m", "trajmesh.rollout.engines.engine_server", "--model", tiny_model_dir,
                             "--port", str(port), "--host", "127.0.0.1", "--version", "0", "--threads", "1"],
                            stdout=subprocess.DEVNULL, stderr=log)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        version = "unreachable"
        while version == "unreachable" and time.monotonic() < deadline and proc.poll() is None:
            version = engine_server_version(url, timeout_s=2.0)
            if version == "unreachable":
                time.sleep(0.2)  # the server is still importing torch; nothing to subscribe to
        assert version == "trajmesh-torch-engine", (tmp_path / "engine.log").read_text()[-2000:]
    finally:
        os.kill(proc.pid, signal.SIGTERM)
        proc.wait(timeout=30)
        log.close()
    assert engine_server_version(url, timeout_s=2.0) == "unreachable"  # the server is gone
