"""GiGPO trains a multi-turn source through the real mesh (NATS, Redis, every service a process):
the workplace environment with native tool calls, `learner.advantage.type: gigpo`, a tiny ChatML
model warm-started to emit a tool call (as tests/e2e/test_e2e_envs.py builds it). The archive carries
each trajectory's per-step environment rewards (`step_rewards`, one per environment step, from
`StepResponse.reward`), some trained trajectories have several turns, and the manifest records the
estimator. Slow: ~3–5 min here (the model's SFT and the mesh)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from mesh_checks import write_manifest

from trajmesh.config import load_config
from trajmesh.run.launcher import start_mesh
from trajmesh.run.train import read_metrics
from trajmesh.services.store.archive import read_archive
from trajmesh.tasks import load_split
from trajmesh.tool_calls import ToolCall, render_tool_calls

pytestmark = [pytest.mark.e2e, pytest.mark.slow, pytest.mark.timeout(900)]

SOURCE = {"type": "workplace", "pool_size": 50, "tool_format": "native"}
FIRST_ACTION = render_tool_calls([ToolCall("call_0", "list_tasks", {})])
STEPS = 4


@pytest.fixture(scope="module")
def workplace_model_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    from chatml_model import build_chatml_model

    from trajmesh.learner.models import sft
    from trajmesh.rollout.chat_format import ChatFormat

    root = tmp_path_factory.mktemp("workplace-model")
    cfg = load_config(None, {"tasks.sources": [SOURCE]})
    train = load_split(cfg.tasks.sources[0], 30, 5)[0]
    build_chatml_model(root / "init", [t.prompt for t in train] + [FIRST_ACTION] * 30, max_positions=1024)
    chat = ChatFormat.load(root / "init")
    assert chat is not None
    data = [{"prompt": chat.prompt(t.prompt), "answer": FIRST_ACTION} for t in train]
    sft(root / "init", data, steps=120, batch_size=16, lr=1e-2, out_dir=root / "sft", warmup_steps=5)
    return str(root / "sft")


def test_gigpo_trains_the_workplace_source_through_the_mesh(tmp_path: Path, workplace_model_dir: str) -> None:
    cfg = load_config(None, {
        "run_dir": str(tmp_path / "run"), "model.path": workplace_model_dir, "gate.eta": 1,
        "tasks.sources": [SOURCE], "tasks.group_size": 4, "tasks.train_size": 40, "tasks.heldout_size": 5,
        "tasks.sampling.max_new_tokens": 56, "tasks.sampling.max_turns": 3, "tasks.sampling.temperature": 0.25,
        "rollout.replicas": 1, "rollout.concurrent_tasks": 4, "grader.replicas": 1,
        "store.drop_zero_variance_groups": False,
        "learner.engine.type": "torch", "learner.batch_groups": 2, "learner.max_steps": STEPS,
        "learner.checkpoint_every": STEPS, "learner.advantage.type": "gigpo",
    })
    Path(cfg.run_dir).mkdir(parents=True)
    write_manifest(cfg)
    mesh = start_mesh(cfg)
    try:
        learner = next(p for p in mesh.procs if p.name == "learner")
        assert learner.popen.wait(timeout=600) == 0, learner.log_path.read_text()[-3000:]
    finally:
        mesh.stop_services()
        mesh.stop_infra()
    run_dir = Path(cfg.run_dir)
    steps = [m for m in read_metrics(run_dir) if m.get("kind") == "learner_step"]
    assert [m["version"] for m in steps] == list(range(1, STEPS + 1))
    assert sum(m.get("trajectories_trained", 0) for m in steps) > 0
    algorithm = json.loads(json.loads((run_dir / "manifest.json").read_text())["algorithm_json"])
    assert algorithm["learner"]["advantage"]["type"] == "gigpo"
    archive = read_archive(run_dir / "archive").to_pylist()
    trained = {r["trajectory_id"] for r in archive if r["outcome"] == "trained"}
    accepted = [r for r in archive if r["outcome"] == "accepted" and r["trajectory_id"] in trained]
    assert accepted
    # One environment reward per step the environment took: a sampled run (turn) each, but the
    # last turn of a trajectory cut by the token budget, which no environment saw.
    multi = 0
    for r in accepted:
        mask = list(r["loss_mask"])
        turns = sum(1 for i, m in enumerate(mask) if m == 1 and (i == 0 or mask[i - 1] == 0))
        rewards = r["step_rewards"]
        assert rewards is not None and turns - 1 <= len(rewards) <= turns, (turns, rewards)
        assert all(x == 0.0 for x in rewards)  # the workplace environment's steps earn 0 (its grader scores)
        multi += turns > 1
    assert multi > 0, "no trained trajectory had more than one turn"
