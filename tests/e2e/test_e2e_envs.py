"""Every environment trains through the real mesh (NATS, Redis, every service a process) with a tiny
model in the real chat format, all four as the sources of one run (one mesh, one environment
service and one grader serving every kind); observation tokens (tool output, search results)
carry loss mask 0 in the archive.

The tiny model is a Qwen2-architecture LM with a byte-level BPE tokenizer and a ChatML template
(tests/chatml_model.py), trained locally, then a few SFT steps on one canned first action per
environment after the ChatML prompt, so that it emits tool calls and its end-of-turn token (a
random model rarely ends a turn); rewards are then mostly 0, so zero-variance groups are kept for
these tests. The tool environments run with ``tool_format: native``: the canned action is a tool
call in the model's native Hermes/Qwen2.5 format (``<tool_call>{json}</tool_call>``, written by
``render_tool_calls``), so a tool call by chance is not needed — the SFT warm start teaches the
format, as the demo's warm start does, and the sampling temperature is low. Rollout builds every
prompt with the chat template and appends each observation as a tool message through it (tool
results inside ``<tool_response>``). Each tool environment must show, in the archive, at least one
sampled turn holding a native tool call that parses (`parse_tool_calls`) and that the environment
executed (the next observation is its plain answer, not an error).

The same model trains the workplace source alone with GiGPO (`learner.advantage.type: gigpo`, the
survey's step-level credit): the archive carries each trajectory's per-step environment rewards
(`step_rewards`, one per environment step, from `StepResponse.reward`), some trained trajectories
have several turns, and the manifest records the estimator (its arithmetic on the workplace
environment's real state hashes: tests/unit/learner/test_learner_gigpo.py).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from mesh_checks import write_manifest

from trajmesh.config import load_config
from trajmesh.run.launcher import start_mesh
from trajmesh.run.train import read_metrics
from trajmesh.services.store.archive import read_archive
from trajmesh.tasks import load_split
from trajmesh.tool_calls import ToolCall, parse_tool_calls, render_tool_calls

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(600)]

SOURCES: dict[str, dict[str, Any]] = {
    "reasoning_gym": {"type": "reasoning_gym", "name": "gcd", "family": "gcd", "knobs": {"max_value": 50}},
    "math_tool": {"type": "math_tool", "max_tool_calls": 2, "call_timeout_s": 3.0, "tool_format": "native"},
    "workplace": {"type": "workplace", "pool_size": 50, "tool_format": "native"},
    "search": {"type": "search", "corpus_size": 20, "tool_format": "native"},
}
NATIVE_CALL = {
    "math_tool": ToolCall("call_0", "python", {"code": "print(1)"}),
    "workplace": ToolCall("call_0", "list_tasks", {}),
    "search": ToolCall("call_0", "search", {"query": "town"}),
}
FIRST_ACTION = {"reasoning_gym": "1", **{kind: render_tool_calls([call]) for kind, call in NATIVE_CALL.items()}}
TOOL_NAMES = {"math_tool": {"python"}, "workplace": {"find_employee", "list_tasks", "update_task", "create_task",
                                                     "schedule_meeting"}, "search": {"search"}}


@pytest.fixture(scope="module")
def text_model_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    from chatml_model import build_chatml_model

    from trajmesh.learner.models import sft
    from trajmesh.rollout.agents.chat_format import ChatFormat

    root = tmp_path_factory.mktemp("text-model")
    cfg = load_config(None, {"tasks.sources": list(SOURCES.values())})
    train = {kind: load_split(src, 30, 5)[0] for kind, src in zip(SOURCES, cfg.tasks.sources, strict=True)}
    texts = [t.prompt for tasks in train.values() for t in tasks] + list(FIRST_ACTION.values()) * 30
    build_chatml_model(root / "init", texts, max_positions=1024)
    chat = ChatFormat.load(root / "init")
    assert chat is not None
    data = [{"prompt": chat.prompt(t.prompt), "answer": FIRST_ACTION[kind]}
            for kind, tasks in train.items() for t in tasks]
    sft(root / "init", data, steps=120, batch_size=16, lr=1e-2, out_dir=root / "sft", warmup_steps=5)
    return str(root / "sft")


def test_every_environment_trains_through_one_mesh(tmp_path: Path, text_model_dir: str) -> None:
    cfg = load_config(None, {
        "run_dir": str(tmp_path / "run"), "model.path": text_model_dir, "gate.eta": 1,
        "tasks.sources": list(SOURCES.values()), "tasks.group_size": 2, "tasks.train_size": 40,
        "tasks.heldout_size": 5,
        # T = 0.25: the tiny SFT model then emits its canned tool call in most samples (at T = 1 a
        # run of 18 trajectories sometimes had none, and the observation check had nothing to check).
        "tasks.sampling.max_new_tokens": 56, "tasks.sampling.max_turns": 3, "tasks.sampling.temperature": 0.25,
        "rollout.replicas": 1, "rollout.concurrent_tasks": 4, "grader.replicas": 1,
        "store.drop_zero_variance_groups": False,
        "learner.engine.type": "torch", "learner.batch_groups": 4, "learner.max_steps": STEPS,
        "learner.checkpoint_every": STEPS,
        # Where the host has no working per-call cgroup, math_tool's environment service would
        # refuse to start (this test is about environments, tests/test_sandbox*.py about the sandbox).
        "sandbox.allow_without_cgroup": True,
    })
    kind_of = {src.name: kind for kind, src in zip(SOURCES, cfg.tasks.sources, strict=True)}
    Path(cfg.run_dir).mkdir(parents=True)
    write_manifest(cfg)
    mesh = start_mesh(cfg)
    try:
        learner = next(p for p in mesh.procs if p.name == "learner")
        assert learner.popen.wait(timeout=400) == 0, learner.log_path.read_text()[-3000:]
        mesh.stop_services()
    finally:
        mesh.stop_services()
        mesh.stop_infra()
    run_dir = Path(cfg.run_dir)
    steps = [m for m in read_metrics(run_dir) if m.get("kind") == "learner_step"]
    assert len(steps) == STEPS
    archive = read_archive(run_dir / "archive").to_pylist()
    assert not [r for r in archive if r["outcome"] == "quarantined"]
    rows = [r for r in archive if r["outcome"] == "accepted"]
    by_kind: dict[str, list[dict[str, Any]]] = {kind: [] for kind in SOURCES}
    for r in rows:
        by_kind[kind_of[r["task_source"]]].append(r)
    assert all(by_kind.values()), {kind: len(v) for kind, v in by_kind.items()}  # every source reached the store
    for kind, kind_rows in by_kind.items():
        _check_turns(kind, kind_rows, text_model_dir)


STEPS = 6
"""Learner steps of the run: 4 groups of 2 a step, drawn from the four sources."""


def _check_turns(kind: str, rows: list[dict[str, Any]], text_model_dir: str) -> None:
    """Prompts in the chat template, sampled tokens trained, every observation of a tool
    environment a tool message, and at least one parsed native call the environment executed."""
    from trajmesh.tokenizer import load_tokenizer

    tok = load_tokenizer(text_model_dir)
    end_of_turn = tok.tokenizer.token_to_id("<|im_end|>")
    observed = native = 0
    for r in rows:
        mask, ids = list(r["loss_mask"]), list(r["token_ids"])
        assert mask[0] == 0 and 1 in mask  # prompt masked out, sampled tokens in
        first_sampled = mask.index(1)
        prompt = tok.tokenizer.decode(ids[:first_sampled], skip_special_tokens=False)
        assert prompt.startswith("<|im_start|>system\n") and prompt.endswith("<|im_start|>assistant\n"), prompt
        after = next((i for i in range(first_sampled, len(mask)) if mask[i] == 0), None)
        if after is None:
            continue
        end = next((i for i in range(after, len(mask)) if mask[i] == 1), len(mask))
        text = tok.tokenizer.decode(ids[after:end], skip_special_tokens=False)
        if kind in TOOL_NAMES:  # every masked-out run after an action is a tool message, in the template
            closed = ids[after - 1] == end_of_turn
            head = ("" if closed else "<|im_end|>") + "\n<|im_start|>user\n<tool_response>\n"
            assert text.startswith(head), json.dumps(text)
            if end < len(mask):  # another turn follows: the run ends with the generation prompt
                assert text.endswith("\n</tool_response><|im_end|>\n<|im_start|>assistant\n"), json.dumps(text)
            observed += 1
            payload = text[len(head):].split("\n</tool_response>", 1)[0]
            action = tok.tokenizer.decode(ids[first_sampled:after], skip_special_tokens=False)
            calls = parse_tool_calls(action)[1]
            # a native call the environment parsed and ran: its answer is the plain output, not an error
            if calls and calls[0].name in TOOL_NAMES[kind] and not payload.startswith(("error:", '{"error"')):
                native += 1
    print(f"{kind}: {observed} of {len(rows)} trajectories received an observation, {native} after a native call")
    if kind in TOOL_NAMES:
        assert observed > 0, f"{kind}: no trajectory received an observation"
        assert native > 0, f"{kind}: no parsed native tool call was executed"


GIGPO_STEPS = 4
"""Learner steps of the GiGPO run: 2 workplace groups of 4 a step."""


def test_gigpo_trains_the_workplace_source_through_the_mesh(tmp_path: Path, text_model_dir: str) -> None:
    cfg = load_config(None, {
        "run_dir": str(tmp_path / "run"), "model.path": text_model_dir, "gate.eta": 1,
        "tasks.sources": [SOURCES["workplace"]], "tasks.group_size": 4, "tasks.train_size": 40, "tasks.heldout_size": 5,
        "tasks.sampling.max_new_tokens": 56, "tasks.sampling.max_turns": 3, "tasks.sampling.temperature": 0.25,
        "rollout.replicas": 1, "rollout.concurrent_tasks": 4, "grader.replicas": 1,
        "store.drop_zero_variance_groups": False,
        "learner.engine.type": "torch", "learner.batch_groups": 2, "learner.max_steps": GIGPO_STEPS,
        "learner.checkpoint_every": GIGPO_STEPS, "learner.advantage.type": "gigpo",
        # DAPO's soft length penalty gives the group's rewards a spread even when no episode solves
        # its task (this model rarely does), so GiGPO's step-level credit has returns to compare.
        "learner.truncation.policy": "dapo_soft", "learner.truncation.max_length": 160,
        "learner.truncation.cache_length": 150,
    })
    Path(cfg.run_dir).mkdir(parents=True)
    write_manifest(cfg)
    mesh = start_mesh(cfg)
    try:
        learner = next(p for p in mesh.procs if p.name == "learner")
        assert learner.popen.wait(timeout=400) == 0, learner.log_path.read_text()[-3000:]
    finally:
        mesh.stop_services()
        mesh.stop_infra()
    run_dir = Path(cfg.run_dir)
    steps = [m for m in read_metrics(run_dir) if m.get("kind") == "learner_step"]
    assert [m["version"] for m in steps] == list(range(1, GIGPO_STEPS + 1))
    assert sum(m.get("trajectories_trained", 0) for m in steps) > 0
    algorithm = json.loads(json.loads((run_dir / "manifest.json").read_text())["algorithm_json"])
    assert algorithm["learner"]["advantage"]["type"] == "gigpo"
    # The trained advantages are GiGPO's: step-level anchor groups exist (workplace states repeat
    # across a group's episodes), and the advantages differ from GRPO's on the same batch (a learner
    # that silently used GRPO reports 0; learner/advantages.py `advantage_metrics`).
    assert sum(m["advantage_step_anchor_groups"] for m in steps) > 0, steps
    assert max(m["advantage_minus_grpo_max_abs"] for m in steps) > 1e-3, steps
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
