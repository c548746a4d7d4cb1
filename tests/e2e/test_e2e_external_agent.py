"""An external agent (examples/openai_agent.py, the official `openai` client and a tool loop) trains
a few learner steps through the real mesh: the rollout serves the agent endpoint, the environment
service runs the agent in a process of its own per sample (RunAgent), and the rollout publishes the
session as one trajectory (every segment in it). Every agent process's parent is the environment
service's process.

Checked in the archive: exact accounting (every admitted trajectory ends as exactly one final
outcome, nothing trained twice, every trained token's lag within η, the gate's counters reconcile),
and the masks: the prompt (the chat template's rendering of the agent's messages) is masked 0, every
sampled span is masked 1, and every masked-out token after the first sampled one is text the model
did not generate (the template's framing / tool results), version -1.

A second run trains the agents of examples/framework_agents.py (the OpenAI Agents SDK with its Chat
Completions and Responses models, LangChain's bind_tools, LangGraph's create_react_agent,
pydantic-ai) and an agent that rewrites its history, one per sample, served as the source's HTTP
agent: exact accounting again, and every trained sampled span decodes to exactly what the
framework received for that call (each agent writes down what it received). Each framework's first
call requires a tool call, which constrained decoding makes the untrained model write, so trained
spans include tool calls in the template's native format, and the tool's result goes back in a
second call.
"""

from __future__ import annotations

import asyncio
import importlib
import json
import re
import threading
import traceback
from collections import Counter, defaultdict
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web
from mesh_checks import check_archive, check_gate_reconciles, check_no_stale, sampled_spans, write_manifest
from repo_paths import REPO

from trajmesh.config import RunConfig, load_config
from trajmesh.infra import free_port
from trajmesh.run.launcher import accounting, start_mesh
from trajmesh.run.run_end import end_run
from trajmesh.run.train import read_metrics
from trajmesh.tasks import load_split

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(420)]
pytest.importorskip("openai")

EXAMPLES = str(REPO / "examples")
SOURCE = {"type": "external_agent", "agent": "openai_agent:solve", "python_path": [EXAMPLES], "budget_s": 120,
          "knobs": {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 1}}
STEPS = 3


@pytest.fixture(scope="module")
def chat_model_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    from chatml_model import build_chatml_model

    root = tmp_path_factory.mktemp("agent-model")
    cfg = load_config(None, {"tasks.sources": [SOURCE]})
    texts = [t.prompt for t in load_split(cfg.tasks.sources[0], 30, 5)[0]] * 4
    return str(build_chatml_model(root / "model", texts, max_positions=1024))


WHERE_AGENT = '''
import os
from pathlib import Path

from openai_agent import solve as example_solve


def solve(task, base_url, api_key):
    """The example agent, after writing down which process started it."""
    with open(Path(__file__).with_name("parents.txt"), "a") as f:
        f.write(f"{os.getppid()}\\n")
    return example_solve(task, base_url, api_key)
'''


def _train_through_the_mesh(tmp_path: Path, model_dir: str, source: dict[str, Any], steps: int
                            ) -> tuple[RunConfig, list[dict[str, Any]], dict[str, list[int]]]:
    """The whole mesh on one external-agent source until the learner's `steps`; exact accounting,
    no stale, gate = archive. The run's config, archive rows and each service's process ids."""
    cfg = load_config(None, {
        "run_dir": str(tmp_path / "run"), "model.path": model_dir, "gate.eta": 1,
        "tasks.sources": [source], "tasks.group_size": 2, "tasks.train_size": 30, "tasks.heldout_size": 5,
        "rollout.replicas": 1, "rollout.concurrent_tasks": 2, "rollout.agent_endpoint.max_tokens": 24,
        "grader.replicas": 1, "store.drop_zero_variance_groups": False,
        "learner.engine.type": "torch", "learner.batch_groups": 2, "learner.max_steps": steps,
        "learner.checkpoint_every": steps,
    })
    Path(cfg.run_dir).mkdir(parents=True)
    write_manifest(cfg)
    mesh = start_mesh(cfg)
    pids: dict[str, list[int]] = defaultdict(list)
    for p in mesh.procs:
        pids[p.name].append(p.popen.pid)
    try:
        learner = next(p for p in mesh.procs if p.name == "learner")
        assert learner.popen.wait(timeout=360) == 0, learner.log_path.read_text()[-3000:]
        assert end_run(mesh) == 0
        acct = accounting(mesh.cfg)
        rows = check_archive(mesh.cfg, acct, eta=1)
        check_no_stale(acct, mesh.cfg.run_dir)
        check_gate_reconciles(mesh.cfg, rows)
    finally:
        mesh.stop_services()
        mesh.stop_infra()
    return cfg, rows, pids


def test_example_agent_trains_through_the_mesh(tmp_path: Path, chat_model_dir: str) -> None:
    agents = tmp_path / "agents"
    agents.mkdir()
    (agents / "where_agent.py").write_text(WHERE_AGENT)
    source = {**SOURCE, "agent": "where_agent:solve", "python_path": [str(agents), EXAMPLES]}
    cfg, rows, pids = _train_through_the_mesh(tmp_path, chat_model_dir, source, STEPS)
    parents = (agents / "parents.txt").read_text().split()
    assert parents and set(parents) <= {str(p) for p in pids["environment"]}, (parents, dict(pids))
    steps = [m for m in read_metrics(Path(cfg.run_dir)) if m.get("kind") == "learner_step"]
    assert [m["version"] for m in steps] == list(range(1, STEPS + 1))
    from trajmesh.tokenizer import load_tokenizer

    tok = load_tokenizer(chat_model_dir)
    accepted = [r for r in rows if r["outcome"] == "accepted"]
    # one trajectory per sample, named <task id>-<sample> (not a session segment's <sid>-s<k>-<reason>)
    assert accepted and all(r["trajectory_id"] == f"{r['task_id']}-{r['trajectory_id'].rsplit('-', 1)[1]}"
                            and r["trajectory_id"].rsplit("-", 1)[1] in ("0", "1") for r in accepted)
    for r in accepted:
        ids, mask, versions = list(r["token_ids"]), list(r["loss_mask"]), list(r["behavior_versions"])
        first = mask.index(1)
        prompt = tok.tokenizer.decode(ids[:first], skip_special_tokens=False)
        assert prompt.startswith("<|im_start|>") and prompt.endswith("<|im_start|>assistant\n"), prompt
        assert all(v == -1 for v, m in zip(versions, mask, strict=True) if not m)
        assert all(v >= 0 for v, m in zip(versions, mask, strict=True) if m)


# ------------------------------------------------ the agent frameworks (examples/framework_agents.py)

FRAMEWORKS = ("agents_chat", "agents_responses", "langchain_tools", "langgraph_react", "pydantic_ai_agent")
TARGETS = (*FRAMEWORKS, "edit_history")
"""What the run's HTTP agent runs, in turn, one per sample: every framework's agent, and an agent
that rewrites its history (a second segment in its trajectory)."""
STOP = ["w"]
"""Stop strings every agent sends (the untrained model writes a "w" in most answers, often inside a
token): the trained tokens must end at the one completing it, as the engine stopped there."""


def _edit_history(task: dict[str, Any], base_url: str, api_key: str) -> str:
    """One call with examples/openai_agent.py's tool, then one on a rewritten history: a second
    segment. Records what it received as examples/framework_agents.py does."""
    from openai import OpenAI

    tools = importlib.import_module("openai_agent").TOOLS  # examples/ (on sys.path during the test)
    client = OpenAI(base_url=base_url, api_key=api_key, timeout=300)
    first = client.chat.completions.create(model=task["model"], messages=[{"role": "user", "content": task["prompt"]}],
                                           tools=tools, max_tokens=16, stop=task["stop"]).choices[0].message
    edited = client.chat.completions.create(
        model=task["model"], messages=[{"role": "user", "content": task["prompt"]},
                                       {"role": "assistant", "content": "I will not use tools."},
                                       {"role": "user", "content": "Why?"}], max_tokens=4, stop=task["stop"]
    ).choices[0].message
    received = [{"content": m.content or "", "tool_calls": [
        {"name": c.function.name, "arguments": json.loads(c.function.arguments)} for c in m.tool_calls or []]}
        for m in (first, edited)]
    importlib.import_module("framework_agents").record_received("edit_history", base_url, task["stop"], received)
    return edited.content or ""


class AgentServer:
    """The run's HTTP agent (the source's ``agent`` URL): each POST runs the next of TARGETS on the
    task, in a thread, and answers its final answer (500 with the error when it raised). An HTTP
    agent rather than a process per sample: the frameworks are imported once (seconds each)."""

    def __init__(self) -> None:
        self.agents: dict[str, Any] = {**importlib.import_module("framework_agents").AGENTS,
                                       "edit_history": _edit_history}
        self.count = 0
        self.errors: list[str] = []
        self.started = threading.Event()
        self.port = free_port()
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self._serve, daemon=True)

    async def _handle(self, request: web.Request) -> web.Response:
        body = await request.json()
        target = TARGETS[self.count % len(TARGETS)]
        self.count += 1
        task = {**body["task"], "stop": STOP}
        try:
            answer = await asyncio.to_thread(self.agents[target], task, body["base_url"], body["api_key"])
        except Exception:
            self.errors.append(f"{target}: {traceback.format_exc()[-1500:]}")
            return web.json_response({"error": self.errors[-1]}, status=500)
        return web.json_response({"answer": answer})

    def _serve(self) -> None:
        asyncio.set_event_loop(self.loop)
        app = web.Application()
        app.router.add_post("/solve", self._handle)
        self.runner = web.AppRunner(app)
        self.loop.run_until_complete(self.runner.setup())
        self.loop.run_until_complete(web.TCPSite(self.runner, "127.0.0.1", self.port).start())
        self.started.set()
        self.loop.run_forever()

    def __enter__(self) -> AgentServer:
        self.thread.start()
        assert self.started.wait(60), "the agent server did not start"
        return self

    def __exit__(self, *exc: object) -> None:
        asyncio.run_coroutine_threadsafe(self.runner.cleanup(), self.loop).result(60)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(60)
        self.loop.close()


def _check_span(decode: Any, ids: list[int], got: dict[str, Any], stops: list[str]) -> bool:
    """The sampled tokens `ids` of one call are exactly what the framework received for it (`got`);
    True when the call ended at one of `stops` (its tokens then end at the one completing it)."""
    text = decode(ids)
    hits = [(text.find(s), s) for s in stops if s in text]
    if hits:
        pos, stop = min(hits)
        before = decode(ids[:-1])
        assert not any(s in before for s in stops), (
            f"tokens past the stop string {stop!r} were trained: {text!r}, the agent got {got['content']!r}")
        text = text[:pos]
    block = r"<tool_call>\n(.*?)\n</tool_call>"
    if got["tool_calls"]:
        calls = [json.loads(b) for b in re.findall(block, text, re.S)]
        assert [(c["name"], c["arguments"]) for c in calls] == [
            (c["name"], c["arguments"]) for c in got["tool_calls"]], (text, got)
        assert got["content"] == re.sub(block, "", text, flags=re.S).strip(), (text, got)
    else:
        assert got["content"] == text, (text, got)
    return bool(hits)


def test_agent_frameworks_train_exactly_what_they_received(tmp_path: Path, chat_model_dir: str,
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """One run; its samples are solved in turn by the OpenAI Agents SDK (Chat Completions and
    Responses models), LangChain's bind_tools loop, LangGraph's create_react_agent, pydantic-ai and an
    agent that rewrites its history. Exact accounting; every framework's runs are trained, and every
    trained sampled span decodes to exactly what that framework received for the call (stop strings
    included: nothing after one is trained); the history-rewriting agent's trajectories hold both
    segments, the second opening with its own prompt, masked 0. Each framework's first call requires
    a tool call: every framework's first answer is one, some trained span is one (decoding to the
    native format, equal to the name and arguments the framework parsed), and a trained trajectory's
    next call has the tool's result in its prompt."""
    for module in ("agents", "langchain_openai", "langgraph", "pydantic_ai"):
        pytest.importorskip(module)
    monkeypatch.syspath_prepend(EXAMPLES)
    record = tmp_path / "received.jsonl"
    monkeypatch.setenv("TRAJMESH_AGENT_RECORD", str(record))
    with AgentServer() as server:
        source = {**SOURCE, "agent": f"http://127.0.0.1:{server.port}/solve", "python_path": []}
        _, rows, _ = _train_through_the_mesh(tmp_path, chat_model_dir, source, STEPS)
    from trajmesh.tokenizer import load_tokenizer

    tok = load_tokenizer(chat_model_dir)
    received: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for line in record.read_text().splitlines():
        rec = json.loads(line)
        sid = rec["base_url"].split("/sessions/", 1)[1].split("/", 1)[0]  # <task id>-<sample>-<nonce>
        received[sid.rsplit("-", 1)[0]].append(rec)
    trained_ids = {r["trajectory_id"] for r in rows if r["outcome"] == "trained"}
    trained = [r for r in rows if r["outcome"] == "accepted" and r["trajectory_id"] in trained_ids]  # with tokens
    assert trained and len(trained) == len(trained_ids)
    forced = [rec["received"][0] for recs in received.values() for rec in recs if rec["framework"] in FRAMEWORKS]
    assert forced and all(got["tool_calls"] for got in forced), [got for got in forced if not got["tool_calls"]]
    by_framework: Counter[str] = Counter()
    stopped = tool_spans = tool_results = 0
    for row in trained:
        (rec,) = received[row["trajectory_id"]]
        by_framework[rec["framework"]] += 1
        ids, mask, versions = list(row["token_ids"]), list(row["loss_mask"]), list(row["behavior_versions"])
        assert all(v == -1 for v, m in zip(versions, mask, strict=True) if not m)
        assert all(v >= 0 for v, m in zip(versions, mask, strict=True) if m)
        spans = sampled_spans(mask)
        assert len(spans) == len(rec["received"]), (rec["framework"], spans, rec["received"])
        for k, ((a, b), got) in enumerate(zip(spans, rec["received"], strict=True)):
            stopped += _check_span(tok.decode, ids[a:b], got, rec["stop"])
            if got["tool_calls"]:
                tool_spans += 1
            if k == 0 and rec["framework"] in FRAMEWORKS:  # required: the whole answer is tool calls
                assert got["tool_calls"] and tok.decode(ids[a:b]).startswith("<tool_call>\n"), (ids[a:b], got)
            if got["tool_calls"] and k + 1 < len(spans):  # the tool ran: its result is in the next prompt
                between = tok.tokenizer.decode(ids[b:spans[k + 1][0]], skip_special_tokens=False)
                sums = [int(c["arguments"]["a"]) + int(c["arguments"]["b"]) for c in got["tool_calls"]]
                assert all(str(n) in between for n in sums), (between, got)
                tool_results += 1
        if rec["framework"] == "edit_history":
            start = spans[0][1]  # the rewritten call's prompt, after the first call's answer
            assert list(row["sequence_starts"]) == [0, start], row["sequence_starts"]
            prompt = tok.tokenizer.decode(ids[start:spans[1][0]], skip_special_tokens=False)
            assert prompt.startswith("<|im_start|>") and "I will not use tools." in prompt, prompt
            assert prompt.endswith("Why?<|im_end|>\n<|im_start|>assistant\n"), prompt
    assert set(by_framework) == set(TARGETS), (by_framework, server.errors)
    assert stopped, "no trained call ended at a stop string"
    assert tool_spans and tool_results, ("no trained tool call, or none followed by its result", tool_spans,
                                         tool_results)
