"""verifiers tasksets train through the real mesh (NATS, Redis, every service a process): a
single-turn taskset (tests/verifiers_tasksets.py: sums, verifiers' own ``@vf.reward`` functions, a
rubric that raises on some tasks) and a tool taskset (tests/verifiers_tool_tasksets.py: the
``calc_add`` tool in an MCP server verifiers starts per rollout), both over local
``datasets.Dataset`` rows, played by verifiers' ``null`` harness through the rollout's per-session
OpenAI endpoint, with a tiny ChatML model warmed up here to emit the tool call in its native format.

Checked: exact accounting (`train_to_end`); every trajectory's tokens are the engine's (sampled
tokens carry a version and a log-prob, the rest mask 0 and version -1); a rubric exception is reward
0 with a reason, never an infrastructure failure; each trajectory's reward is the rubric's,
recomputed here from its own turns (the sums: exact reply and mention; the tools: a tool result came
back, which is read off the trajectory's tokens, and the reply after it is the sum); the rubric's
components are archived, one per reward function; and the held-out evaluation of both sources
(what `trajmesh train` writes to summary.json) is the evaluator service's: its episodes run as the
rollout's do, through the harness and its tools at the evaluation's sampling, graded by the grader
service, with verifiers' version in the revision.

verifiers 0.4 pins openai < 3, which the dev extra's agent frameworks cannot share a venv with: this
runs where verifiers is installed, skipped elsewhere. ``make test`` (through
tests/unit/envs/test_verifiers_venv.py; also ``make test-verifiers`` and ``make test-all``) runs it in
``.venv-verifiers`` with torch and the learner (``make setup-verifiers-mesh``).
"""

from __future__ import annotations

import importlib.metadata
import urllib.request
from pathlib import Path
from typing import Any

import pytest
from mesh_checks import check_engine_tokens, engine_answers, sampled_turns, tid_of, train_and_evaluate
from repo_paths import TESTS as TESTS_DIR

from trajmesh.config import load_config
from trajmesh.rollout.engines.engine_client import ANSWER_LOG_ENV
from trajmesh.tasks import load_split

pytestmark = [pytest.mark.timeout(600)]
pytest.importorskip("verifiers.v1")
pytest.importorskip("datasets")

TESTS = str(TESTS_DIR)
SOURCES: list[dict[str, Any]] = [
    {"type": "verifiers", "name": "sums", "taskset": "verifiers_tasksets", "python_path": [TESTS], "budget_s": 240},
    {"type": "verifiers", "name": "tools", "taskset": "verifiers_tool_tasksets", "python_path": [TESTS],
     "budget_s": 240},
]
NAMES = [src["name"] for src in SOURCES]
STEPS = 3
CALL = {"a": 1, "b": 2}
"""The tool call the warm start teaches (its arguments fixed: a 1-layer model does not read the
question's numbers); the tool's answer, 3, is what it then learns to reply."""
TOOLS = [{"type": "function", "function": {
    "name": "calc_add", "description": "Add two integers and return their sum.",
    "parameters": {"type": "object", "properties": {"a": {"title": "A", "type": "integer"},
                                                    "b": {"title": "B", "type": "integer"}},
                   "required": ["a", "b"], "title": "addArguments"}}}]
"""The tool as verifiers' harness offers it (the MCP server's schema, read off a run's prompt): the
warm start's prompts are the endpoint's rendering of the same request."""


@pytest.fixture(scope="module")
def chat_model_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    """The ChatML model, then a short SFT: after a tool question, the native ``calc_add`` call;
    after the tool's response, its number; after a sum, a number."""
    from chatml_model import build_chatml_model
    from verifiers_tool_tasksets import TOOL_NAME

    from trajmesh.learner.models import sft
    from trajmesh.rollout.agents.agent_endpoint import render_messages
    from trajmesh.rollout.agents.chat_format import ChatFormat
    from trajmesh.tool_calls import ToolCall, render_tool_calls

    root = tmp_path_factory.mktemp("verifiers-model")
    cfg = load_config(None, {"tasks.sources": SOURCES})
    train = {src.name: load_split(src, 20, 2)[0] for src in cfg.tasks.sources}
    call = render_tool_calls([ToolCall("call_0", TOOL_NAME, CALL)])
    texts = [t.prompt for tasks in train.values() for t in tasks] + [call, TOOL_NAME, "3", "12", "7"] * 30
    build_chatml_model(root / "init", texts, max_positions=2048)
    chat = ChatFormat.load(root / "init")
    assert chat is not None

    def prompt(messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None) -> str:
        return render_messages(chat, messages, tools, True)  # as the endpoint prompts the model

    data = []
    for t in train["tools"]:
        user = {"role": "user", "content": t.prompt}
        data.append({"prompt": prompt([user], TOOLS), "answer": call})
        after = [user, {"role": "assistant", "content": "", "tool_calls": [{"name": TOOL_NAME, "arguments": CALL}]},
                 {"role": "tool", "content": "3"}]
        data.append({"prompt": prompt(after, TOOLS), "answer": "3"})
    data += [{"prompt": prompt([{"role": "user", "content": t.prompt}]), "answer": "3"} for t in train["sums"]]
    sft(root / "init", data, steps=150, batch_size=16, lr=1e-2, out_dir=root / "sft", warmup_steps=5)
    return str(root / "sft")


def test_verifiers_tasksets_train_through_the_mesh(tmp_path: Path, chat_model_dir: str, monkeypatch: pytest.MonkeyPatch) -> None:
    from verifiers_tasksets import ROWS as SUM_ROWS
    from verifiers_tool_tasksets import ROWS as TOOL_ROWS

    from trajmesh.learner.evaluate import heldout_tasks
    from trajmesh.run.train import evaluation_protocol
    from trajmesh.tokenizer import load_tokenizer

    cfg = load_config(None, {
        "run_dir": str(tmp_path / "run"), "model.path": chat_model_dir, "gate.eta": 1,
        "tasks.sources": SOURCES, "tasks.group_size": 2, "tasks.train_size": 20, "tasks.heldout_size": 2,
        "tasks.sampling.max_new_tokens": 48, "tasks.sampling.max_turns": 3,
        "rollout.replicas": 1, "rollout.concurrent_tasks": 4, "grader.replicas": 1,
        "rollout.agent_endpoint.max_tokens": 48,
        "store.drop_zero_variance_groups": False,
        "learner.engine.type": "torch", "learner.batch_groups": 2, "learner.max_steps": STEPS,
        "learner.checkpoint_every": STEPS,
        "eval.in_mesh": True, "eval.samples": 1, "eval.noise_seeds": 0, "eval.every_versions": STEPS,
    })
    answers_dir = tmp_path / "engine-answers"  # every answer the torch engines give, for check_engine_tokens
    answers_dir.mkdir()
    monkeypatch.setenv(ANSWER_LOG_ENV, str(answers_dir))
    agent_runs: list[float] = []

    def count_agent_runs(mesh: Any) -> None:  # the environment service's RunAgent runs, however they ended
        from prometheus_client.parser import text_string_to_metric_families

        (env,) = [p for p in mesh.procs if p.name == "environment"]
        with urllib.request.urlopen(f"http://127.0.0.1:{env.metrics_port}/metrics", timeout=10) as resp:
            families = text_string_to_metric_families(resp.read().decode())
        agent_runs.append(sum(s.value for f in families for s in f.samples if s.name == "trajmesh_environment_calls_total"
                              and s.labels["method"] == "run_agent" and s.labels["status"] != "invalid"))

    rows, result = train_and_evaluate(cfg, STEPS, timeout_s=420, before_end=count_agent_runs)
    answers = engine_answers(answers_dir)
    # every harness ran in the environment service (RunAgent): each trained sample and each held-out
    # episode of the evaluator (2 sources x 2 tasks, greedy and sampled, before and after)
    assert agent_runs[0] >= len([r for r in rows if r["outcome"] == "accepted"]) + 8, agent_runs
    # held-out by the evaluator service through the harness and its tools (agent_episodes.py
    # run_episode, as in training): the greedy policy's tool call is answered, which the rubric's
    # tool_answered (1) credits; a reply scored without the harness could earn at most `correct` (1)
    # on a sum that happens to be 3
    assert result["heldout"]["tools"]["greedy_accuracy"] >= 1.0, result["heldout"]["tools"]
    assert result["greedy_infra_failures"] == 0 and result["sampled_infra_failures"] == 0, result
    assert evaluation_protocol(cfg, heldout_tasks(cfg))["sources"]["tools"]["environments"] == {
        "verifiers": f"verifiers-adapter-v1+verifiers-{importlib.metadata.version('verifiers')}"}

    # a rubric exception is reward 0 with a reason, never an infrastructure failure
    assert not [r for r in rows if r["outcome"] == "failed_infra"], [r["trajectory_id"] for r in rows]
    tok = load_tokenizer(chat_model_dir)
    accepted = [r for r in rows if r["outcome"] == "accepted"]
    by_source = {name: [r for r in accepted if r["task_source"] == name] for name in NAMES}
    assert all(by_source.values()), {k: len(v) for k, v in by_source.items()}
    tasks = {t.task_id: t for src in cfg.tasks.sources for t in load_split(src, 20, 2)[0]}
    tool_results = 0
    for r in accepted:
        ids, mask = check_engine_tokens(r, answers)
        turns = [t.replace("<|im_end|>", "").strip() for t in sampled_turns(ids, mask, tok)]
        components = dict(r["reward_components"])  # archived with the trajectory, as graded
        prompt = tasks[tid_of(r["task_id"], tasks)].prompt
        if r["task_source"] == "sums":  # correct (weight 1) + mentions the answer (0.5); raised: 0
            row = next(x for x in SUM_ROWS if x["question"] == prompt)
            reply = turns[-1]
            expected = 0.0 if row["boom"] else float(reply == row["answer"]) + 0.5 * float(row["answer"] in reply)
            assert set(components) == {"rubric_error", "correct", "mentions_answer"}, components
        else:  # tool_answered (1) + correct (1): a tool response in the trajectory, the last reply the sum
            row = next(x for x in TOOL_ROWS if x["question"] == prompt)
            answered = "<tool_response>" in tok.tokenizer.decode(ids)
            tool_results += answered
            expected = float(answered) + float(turns[-1] == row["answer"])
            assert set(components) == {"rubric_error", "tool_answered", "correct"}, components
        assert r["reward"] == pytest.approx(expected), (r["trajectory_id"], turns, row, r["reward"], components)
    # the warm start's call parsed, ran on verifiers' MCP server and came back as a tool message
    assert tool_results, [sampled_turns(list(r["token_ids"]), list(r["loss_mask"]), tok) for r in by_source["tools"]]
