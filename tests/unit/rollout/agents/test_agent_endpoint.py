"""The agent endpoint driven by the official `openai` and `anthropic` clients against a real
uvicorn server and the torch engine (a tiny ChatML Qwen2 model, trained here to script a tool call).

The model is overfitted on one conversation: asked "What is 2+3?" with an ``add`` tool it writes a
Hermes tool call, and given the tool's result it answers "The answer is 5." spelled one byte-level
token per character — a tokenization the BPE tokenizer would never produce from that text, so a
trajectory built by re-encoding the conversation would differ from what the engine generated.
Every /generate the engine answers is recorded by the test's own client wrapper; the trajectory's
sampled tokens are checked against those records.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

torch = pytest.importorskip("torch")
openai = pytest.importorskip("openai")
anthropic = pytest.importorskip("anthropic")
uvicorn = pytest.importorskip("uvicorn")

from chatml_model import build_chatml_model  # noqa: E402
from repo_paths import REPO  # noqa: E402

from trajmesh.infra import free_port  # noqa: E402
from trajmesh.rollout.agents.agent_endpoint import AgentEndpoint, create_app  # noqa: E402
from trajmesh.rollout.agents.chat_format import ChatFormat, model_stop_ids  # noqa: E402
from trajmesh.rollout.engines import TorchEngineConfig  # noqa: E402
from trajmesh.rollout.engines.engine_client import EngineClient  # noqa: E402
from trajmesh.rollout.engines.generation import PauseClock, TurnSampler  # noqa: E402
from trajmesh.tokenizer import load_tokenizer  # noqa: E402
from trajmesh.v1 import trajectory_pb2  # noqa: E402

QUESTION = "What is 2+3?"
CALL_TEXT = '<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n</tool_call>'
ANSWER = "The answer is 5."
ADD_FN = {"name": "add", "description": "Add two integers.",
          "parameters": {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
                         "required": ["a", "b"]}}
TEXTS = [QUESTION, CALL_TEXT, ANSWER, json.dumps(ADD_FN), "You are a helpful assistant."] * 30


class Interrupt:
    """Cuts the next /generate after `cut` tokens and holds its answer until `release`, then hands
    it back as the engine answers a request aborted by /pause_generation (partial output, finish
    reason abort): a request that is generating when a weight update starts, at a known token."""

    def __init__(self, cut: int) -> None:
        self.cut = cut
        self.generated = threading.Event()
        """The first `cut` tokens came back from the engine (under the old weights)."""
        self.release = threading.Event()


class RecordingEngine(EngineClient):
    """The engine client, keeping (input ids, output ids) of every /generate answer."""

    def __init__(self, url: str) -> None:
        super().__init__(url)
        self.records: list[tuple[list[int], list[int]]] = []
        self.samplings: list[dict[str, Any]] = []
        """The sampling fields of each answered /generate, beside ``records``."""
        self.interrupt: Interrupt | None = None
        self.loop: asyncio.AbstractEventLoop | None = None
        """The endpoint's event loop (uvicorn's thread): where the test runs its weight update."""

    async def generate(self, input_ids: Any, sampling: Any, return_logprob: bool = True) -> Any:
        self.loop = asyncio.get_running_loop()
        cut, self.interrupt = self.interrupt, None
        if cut is None:
            res = await super().generate(input_ids, sampling, return_logprob)
        else:
            res = await super().generate(input_ids, {**sampling, "max_new_tokens": cut.cut}, return_logprob)
            cut.generated.set()
            await asyncio.to_thread(cut.release.wait, 120)
            res = dataclasses.replace(res, finish_reason={"type": "abort", "message": "generation paused"})
        self.records.append((list(input_ids), list(res.output_ids)))
        self.samplings.append(dict(sampling))
        return res


def _spelled(tok: Any, text: str) -> list[int]:
    """`text` one token per character (non-canonical for a BPE tokenizer)."""
    return [tok.encode(ch)[0] for ch in text]


def _train_script(model_dir: Path, ep: AgentEndpoint, tok: Any) -> dict[str, list[int]]:
    """Overfits the model on the tool conversation; returns the scripted output ids."""
    from transformers import Qwen2ForCausalLM

    tools = [{"type": "function", "function": ADD_FN}]
    first = [{"role": "user", "content": QUESTION}]
    second = [*first, {"role": "assistant", "content": "", "tool_calls": [{"name": "add", "arguments": {"a": 2, "b": 3}}]},
              {"role": "tool", "content": "5"}]
    end = tok.tokenizer.token_to_id("<|im_end|>")
    out1, out2 = tok.encode(CALL_TEXT) + [end], _spelled(tok, ANSWER) + [end]
    p1 = tok.encode(ep.render(first, tools, True))
    upto = ep.render(second[:2], tools, False)
    tail = upto[upto.rfind("<|im_end|>") + len("<|im_end|>"):] + ep.render(second, tools, True)[len(upto):]
    ids = p1 + out1 + tok.encode(tail) + out2
    target = [0] * len(p1) + [1] * len(out1) + [0] * (len(ids) - len(p1) - len(out1) - len(out2)) + [1] * len(out2)
    model = Qwen2ForCausalLM.from_pretrained(str(model_dir)).float().train()
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    x = torch.tensor([ids])
    labels = torch.tensor([[t if m else -100 for t, m in zip(ids, target, strict=True)]])
    torch.manual_seed(0)
    for _ in range(600):
        logits = model(x).logits
        loss = torch.nn.functional.cross_entropy(logits[0, :-1], labels[0, 1:], ignore_index=-100)
        opt.zero_grad()
        loss.backward()
        opt.step()
        pred = logits[0, :-1].argmax(-1)
        keep = labels[0, 1:] != -100
        if bool((pred[keep] == labels[0, 1:][keep]).all()) and loss.item() < 0.05:
            break
    model.eval().save_pretrained(str(model_dir), safe_serialization=True)
    return {"call": out1, "answer": out2}


class Harness:
    """Engine subprocess + endpoint served by uvicorn in a thread."""

    def __init__(self, root: Path) -> None:
        self.model = build_chatml_model(root / "model", TEXTS, hidden=64, layers=2, max_positions=1024)
        self.tok = load_tokenizer(self.model)
        self.chat = ChatFormat.load(self.model)
        assert self.chat is not None
        self.pause = PauseClock()
        stop_ids = model_stop_ids(self.model, self.tok.eos_token_id)
        self.engine = RecordingEngine("http://unset")
        sampler = TurnSampler(self.engine, TorchEngineConfig(request_timeout_s=120), stop_ids=stop_ids,
                              pause=self.pause, context_len=1024, loaded_version=lambda: 0)
        self.ep = AgentEndpoint(self.tok, self.chat, sampler, self.pause, model_name="tiny", default_max_tokens=48)
        self.script = _train_script(self.model, self.ep, self.tok)
        self.root = root

    def start(self) -> None:
        port = free_port()
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "trajmesh.rollout.engines.engine_server", "--model", str(self.model), "--port", str(port),
             "--host", "127.0.0.1", "--version", "0", "--threads", "1"],
            stdout=subprocess.DEVNULL, stderr=open(self.root / "engine.log", "w"))  # noqa: SIM115
        self.engine.base_url = f"http://127.0.0.1:{port}"
        api_port = free_port()
        self.server = uvicorn.Server(uvicorn.Config(create_app(self.ep), host="127.0.0.1", port=api_port,
                                                    log_level="warning", lifespan="off"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        self.url = f"http://127.0.0.1:{api_port}"
        asyncio.run(self._wait_engine())
        deadline = time.monotonic() + 60
        while not self.server.started:  # uvicorn sets it once it listens
            assert time.monotonic() < deadline and self.thread.is_alive(), "uvicorn did not start"
            time.sleep(0.05)

    async def _wait_engine(self) -> None:
        async with EngineClient(self.engine.base_url) as client:
            for _ in range(600):
                assert self.proc.poll() is None, (self.root / "engine.log").read_text()
                if await client.health():
                    return
                await asyncio.sleep(0.1)
        raise AssertionError("engine not healthy")

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=30)
        os.kill(self.proc.pid, signal.SIGTERM)
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            os.kill(self.proc.pid, signal.SIGKILL)
            self.proc.wait()

    def base(self, sid: str) -> str:
        return f"{self.url}/sessions/{sid}/v1"

    def openai(self, sid: str, **kw: Any) -> Any:
        return openai.OpenAI(base_url=self.base(sid), api_key="unused", timeout=120, **kw)


@pytest.fixture(scope="module")
def h(tmp_path_factory: pytest.TempPathFactory) -> Any:
    harness = Harness(tmp_path_factory.mktemp("agent_endpoint"))
    harness.start()
    try:
        yield harness
    finally:
        harness.stop()


def _sampled(traj: Any) -> list[list[int]]:
    """The token ids of each sampled span of a trajectory."""
    ids = traj.token_ids_T.tolist()
    return [ids[s.token_start:s.token_end] for s in traj.pb.spans if s.action_type != 0 and
            all(m == 1 for m in traj.loss_mask_T.tolist()[s.token_start:s.token_end])]


def _engine_outputs(h: Any, since: int) -> list[list[int]]:
    return [out for _, out in h.engine.records[since:]]


def test_chat_completion_is_recorded_with_the_engine_tokens(h: Harness) -> None:
    session = h.ep.open_session("chat1")
    before = len(h.engine.records)
    resp = h.openai("chat1").chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "Say hi."}], max_tokens=12, temperature=1.0,
        logprobs=True, n=2)
    assert resp.object == "chat.completion" and len(resp.choices) == 2
    outs = _engine_outputs(h, before)
    assert len(outs) == 2 and resp.usage.completion_tokens == sum(len(o) for o in outs)
    assert all(1 <= len(o) <= 12 for o in outs)
    assert [len(c.logprobs.content) for c in resp.choices] == [len(o) for o in outs]
    task = trajectory_pb2.Task(task_id="t1", group_id="g1", source="external_agent", revision="r1")
    trajs = session.trajectories(task, base_id="t")
    assert sorted(_sampled(t)[0] for t in trajs) == sorted(outs)  # one trajectory per sample
    for t in trajs:
        t.finish(trajectory_pb2.EOS)
        assert t.validate(vocab_size=h.tok.vocab_size, learner_version=0) == []
        assert all(v == 0 for v, m in zip(t.behavior_versions_T.tolist(), t.loss_mask_T.tolist(), strict=True) if m)
        assert all(lp <= 0 for lp, m in zip(t.behavior_logprobs_T.tolist(), t.loss_mask_T.tolist(), strict=True) if m)
    assert [t.pb.trajectory_id.split("-")[-1] for t in trajs] == ["first", "sibling"]


def test_held_out_session_samples_at_the_evaluations_sampling(h: Harness) -> None:
    """A held-out episode's session (`forced`: the evaluation's `SamplingParams`, services/evaluator.py)
    samples greedy within the evaluation's budget whatever the agent asks; a training session as asked."""
    forced = trajectory_pb2.SamplingParams(temperature=0.0, top_p=1.0, max_new_tokens=5)
    seen = {}
    for sid, kw in (("heldout1", {"forced": forced}), ("train1", {})):
        h.ep.open_session(sid, **kw)
        before = len(h.engine.samplings)
        h.openai(sid).chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Say hi."}],
                                              max_tokens=40, temperature=1.3, top_p=0.5)
        (seen[sid],) = h.engine.samplings[before:]
        h.ep.close_session(sid)
    assert (seen["heldout1"]["temperature"], seen["heldout1"]["top_p"], seen["heldout1"]["max_new_tokens"]) == (0.0, 1.0, 5)
    assert (seen["train1"]["temperature"], seen["train1"]["top_p"], seen["train1"]["max_new_tokens"]) == (1.3, 0.5, 40)


def _tool_round_trip_chat(client: Any) -> tuple[Any, Any]:
    tools = [{"type": "function", "function": ADD_FN}]
    msgs: list[dict[str, Any]] = [{"role": "user", "content": QUESTION}]
    first = client.chat.completions.create(model="tiny", messages=msgs, tools=tools, temperature=0, max_tokens=64)
    msgs.append(first.choices[0].message.model_dump(exclude_none=True))
    for call in first.choices[0].message.tool_calls or []:
        args = json.loads(call.function.arguments)
        msgs.append({"role": "tool", "tool_call_id": call.id, "content": str(args["a"] + args["b"])})
    second = client.chat.completions.create(model="tiny", messages=msgs, tools=tools, temperature=0, max_tokens=64)
    return first, second


def test_tool_call_round_trip_keeps_the_generated_tokens(h: Harness) -> None:
    session = h.ep.open_session("tools1")
    before = len(h.engine.records)
    first, second = _tool_round_trip_chat(h.openai("tools1"))
    call = first.choices[0].message.tool_calls[0]
    assert first.choices[0].finish_reason == "tool_calls"
    assert (call.function.name, json.loads(call.function.arguments)) == ("add", {"a": 2, "b": 3})
    assert second.choices[0].message.content == ANSWER and second.choices[0].finish_reason == "stop"
    (in1, out1), (in2, out2) = h.engine.records[before:before + 2]
    assert (out1, out2) == (h.script["call"], h.script["answer"])
    assert in2[:len(in1) + len(out1)] == in1 + out1  # the second prompt continues the engine's tokens
    assert h.tok.encode(ANSWER) != out2[:-1]  # re-encoding the text would have drifted
    (traj,) = session.trajectories(None, base_id="t")
    assert _sampled(traj) == [out1, out2]
    assert traj.token_ids_T.tolist() == in2 + out2
    assert sum(traj.loss_mask_T.tolist()) == len(out1) + len(out2)
    spans = [s for s in traj.pb.spans if s.action_type != 0]
    sampled_spans = [s for s in spans if traj.loss_mask_T[s.token_start] == 1]
    assert sampled_spans[1].parent_span_id == sampled_spans[0].span_id  # the call graph


def test_changed_history_starts_a_new_segment(h: Harness) -> None:
    session = h.ep.open_session("edit1")
    client = h.openai("edit1")
    before = len(h.engine.records)
    first, _ = _tool_round_trip_chat(client)
    edited = [{"role": "user", "content": QUESTION}, {"role": "assistant", "content": "I will not use tools."},
              {"role": "user", "content": "Why?"}]
    client.chat.completions.create(model="tiny", messages=edited, max_tokens=4)
    reasons = [t.pb.trajectory_id.split("-")[-1] for t in session.trajectories(None, base_id="t")]
    assert reasons == ["first", "history_changed"]
    assert [c.reason for c in session.calls] == ["first", "continued", "history_changed"]
    # the published trajectory holds both segments, each its own sequence of the engine's tokens
    (in1, out1), (in2, out2), (in3, out3) = h.engine.records[before:before + 3]
    traj = session.trajectory(trajectory_pb2.Task(task_id="x", group_id="g"), trajectory_id="edit1")
    assert traj is not None
    traj.finish(trajectory_pb2.EOS)
    assert traj.validate() == []
    assert list(traj.pb.sequence_starts) == [0, len(in2) + len(out2)]
    assert traj.token_ids_T.tolist() == in2 + out2 + in3 + out3
    assert _sampled(traj) == [out1, out2, out3]
    assert sum(traj.loss_mask_T.tolist()) == len(out1) + len(out2) + len(out3)  # no token trained twice
    from trajmesh.learner.step import build_batch

    batch = build_batch([traj], pad_id=0)
    assert batch.trajectory_ids == ["edit1", "edit1"] and batch.unique_trajectory_ids() == ["edit1"]
    rows = [batch.input_ids_BT[r, :n].tolist() for r, n in enumerate(batch.lengths())]
    assert rows == [in2 + out2, in3 + out3]  # the edited call's row starts at its own prompt
    trained = [[i for i, m in zip(row, batch.mask_BT[r].tolist(), strict=False) if m] for r, row in enumerate(rows)]
    assert trained == [out1 + out2, out3]


def test_responses_api_tool_round_trip(h: Harness) -> None:
    session = h.ep.open_session("resp1")
    client = h.openai("resp1")
    tools = [{"type": "function", **ADD_FN}]
    first = client.responses.create(model="tiny", input=QUESTION, tools=tools, temperature=0, max_output_tokens=64)
    calls = [o for o in first.output if o.type == "function_call"]
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [("add", {"a": 2, "b": 3})]
    items: list[Any] = [{"role": "user", "content": QUESTION}, *[o.model_dump(exclude_none=True) for o in first.output],
                        {"type": "function_call_output", "call_id": calls[0].call_id, "output": "5"}]
    second = client.responses.create(model="tiny", input=items, tools=tools, temperature=0, max_output_tokens=64)
    assert second.output_text == ANSWER and second.status == "completed"
    (traj,) = session.trajectories(None, base_id="t")
    assert _sampled(traj) == [h.script["call"], h.script["answer"]]


def test_bad_request_has_the_openai_error_shape(h: Harness) -> None:
    h.ep.open_session("bad1")
    client = h.openai("bad1", max_retries=0)
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model="tiny", messages=[], max_tokens=4)
    assert err.value.status_code == 400
    body = err.value.response.json()
    assert body["error"]["type"] == "invalid_request_error" and body["error"]["param"] == "messages"
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "x"}], temperature=7)
    assert err.value.response.json()["error"]["param"] == "temperature"
    with pytest.raises(openai.NotFoundError):
        h.openai("no-such-session", max_retries=0).chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": "x"}])
    assert [m.id for m in client.models.list()] == ["tiny"]


def test_anthropic_messages_with_a_tool(h: Harness) -> None:
    session = h.ep.open_session("anth1")
    client = anthropic.Anthropic(base_url=f"{h.url}/sessions/anth1", api_key="unused", timeout=120)
    tools = [{"name": ADD_FN["name"], "description": ADD_FN["description"], "input_schema": ADD_FN["parameters"]}]
    msgs: list[dict[str, Any]] = [{"role": "user", "content": QUESTION}]
    first = client.messages.create(model="tiny", max_tokens=64, messages=msgs, tools=tools,
                                   extra_body={"temperature": 0})
    assert first.stop_reason == "tool_use"
    use = [b for b in first.content if b.type == "tool_use"]
    assert [(b.name, b.input) for b in use] == [("add", {"a": 2, "b": 3})]
    msgs += [{"role": "assistant", "content": [b.model_dump() for b in first.content]},
             {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use[0].id, "content": "5"}]}]
    second = client.messages.create(model="tiny", max_tokens=64, messages=msgs, tools=tools,
                                   extra_body={"temperature": 0})
    assert [b.text for b in second.content if b.type == "text"] == [ANSWER] and second.stop_reason == "end_turn"
    (traj,) = session.trajectories(None, base_id="t")
    assert _sampled(traj) == [h.script["call"], h.script["answer"]]
    with pytest.raises(anthropic.BadRequestError) as err:
        anthropic.Anthropic(base_url=f"{h.url}/sessions/anth1", api_key="x", max_retries=0).messages.create(
            model="tiny", max_tokens=4, messages=[])
    assert err.value.response.json()["error"]["type"] == "invalid_request_error"


def test_sdk_retry_drops_the_unreceived_completion(h: Harness) -> None:
    session = h.ep.open_session("retry1")
    client = h.openai("retry1")
    msgs = [{"role": "user", "content": "Say hi."}]
    client.chat.completions.create(model="tiny", messages=msgs, max_tokens=6)
    again = client.chat.completions.create(model="tiny", messages=msgs, max_tokens=6,
                                           extra_headers={"x-stainless-retry-count": "1"})
    assert [c.orphan for call in session.calls for c in call.completions] == [True, False]
    (traj,) = session.trajectories(None, base_id="t")
    assert _sampled(traj)[0] == h.engine.records[-1][1] and again.usage.completion_tokens == len(_sampled(traj)[0])


def test_weight_update_answers_retryable_and_sdk_retries(h: Harness) -> None:
    session = h.ep.open_session("pause1")
    h.pause.pause()
    try:
        with pytest.raises(openai.APIStatusError) as err:
            h.openai("pause1", max_retries=0).chat.completions.create(
                model="tiny", messages=[{"role": "user", "content": "x"}], max_tokens=2)
        assert err.value.status_code == 503 and err.value.response.headers["retry-after"] == "1"
        with pytest.raises(anthropic.APIStatusError) as aerr:
            anthropic.Anthropic(base_url=f"{h.url}/sessions/pause1", api_key="x", max_retries=0).messages.create(
                model="tiny", max_tokens=2, messages=[{"role": "user", "content": "x"}])
        assert aerr.value.status_code == 529 and aerr.value.response.json()["error"]["type"] == "overloaded_error"
        refused = h.ep.retryable_answers
        result: dict[str, Any] = {}
        worker = threading.Thread(target=lambda: result.update(r=h.openai("pause1", max_retries=5).chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": "x"}], max_tokens=2)))
        worker.start()
        deadline = time.monotonic() + 60
        while h.ep.retryable_answers == refused:  # the SDK's first attempt was refused
            assert time.monotonic() < deadline
            time.sleep(0.02)
    finally:
        h.pause.resume()
    worker.join(timeout=120)
    assert result["r"].choices and len(session.calls) == 1


AGENTS_FOR_TEST = '''
import time
from openai import OpenAI


def call_then_crash(task, base_url, api_key):
    OpenAI(base_url=base_url, api_key=api_key).chat.completions.create(
        model=task["model"], messages=[{"role": "user", "content": task["prompt"]}], max_tokens=2)
    raise RuntimeError("the agent broke")


def call_then_hang(task, base_url, api_key):
    OpenAI(base_url=base_url, api_key=api_key).chat.completions.create(
        model=task["model"], messages=[{"role": "user", "content": task["prompt"]}], max_tokens=2)
    time.sleep(3600)


def pid_then_hang(task, base_url, api_key):
    import os
    from pathlib import Path

    Path(task["metadata"]["pid_file"]).write_text(str(os.getpid()))
    time.sleep(3600)


def tool_loop_then_return(task, base_url, api_key):
    """The example's tool loop (the model's last turn is its answer), then returns something else."""
    from openai_agent import solve

    solve(task, base_url, api_key)
    return task["metadata"]["agent_returns"]


def solve_then_edit_history(task, base_url, api_key):
    """The example's tool loop, then one more call on a rewritten history (a new segment)."""
    from openai_agent import solve

    answer = solve(task, base_url, api_key)
    OpenAI(base_url=base_url, api_key=api_key).chat.completions.create(
        model=task["model"], messages=[{"role": "user", "content": task["prompt"]},
                             {"role": "assistant", "content": "I will not use tools."},
                             {"role": "user", "content": "Why?"}], max_tokens=4)
    return answer
'''


def _task(prompt: str) -> Any:
    return trajectory_pb2.Task(task_id="ext1", group_id="g1", source="external_agent", revision="r1", prompt=prompt,
                               answer="5")


def test_example_agent_runs_in_its_own_process_through_the_endpoint(h: Harness) -> None:
    from trajmesh.rollout.agents.agent_runner import AgentRunner

    runner = AgentRunner(h.ep, h.url, python_path=[str(REPO / "examples")])
    trajs, outcome = asyncio.run(runner.run(_task(QUESTION), "openai_agent:solve", 300, session_id="ex1"))
    assert (outcome.terminal_reason, outcome.answer) == (trajectory_pb2.EOS, ANSWER), outcome.detail
    (traj,) = trajs
    assert _sampled(traj) == [h.script["call"], h.script["answer"]]
    assert traj.pb.terminal_reason == trajectory_pb2.EOS and traj.pb.task_id == "ext1"
    assert sum(traj.loss_mask_T.tolist()) == len(h.script["call"]) + len(h.script["answer"])
    assert traj.validate(vocab_size=h.tok.vocab_size, learner_version=0) == []
    assert "ex1" not in h.ep.sessions  # closed: later calls are refused


def test_held_out_agent_run_samples_at_the_tasks_sampling(h: Harness) -> None:
    """An external agent's held-out task (`evaluation`, as the evaluator sends it): every call the
    agent makes (it asks temperature 0, 64 tokens) samples at the task's sampling."""
    from trajmesh.rollout.agents.agent_runner import AgentRunner

    runner = AgentRunner(h.ep, h.url, python_path=[str(REPO / "examples")])
    task = _task(QUESTION)
    task.evaluation = True
    task.sampling.CopyFrom(trajectory_pb2.SamplingParams(temperature=0.7, top_p=0.9, max_new_tokens=20))
    before = len(h.engine.samplings)
    asyncio.run(runner.run(task, "openai_agent:solve", 300, session_id="ex-heldout"))
    calls = h.engine.samplings[before:]
    assert calls and {(c["temperature"], c["top_p"], c["max_new_tokens"]) for c in calls} == {(0.7, 0.9, 20)}, calls


def test_agent_that_edits_history_yields_one_trajectory_with_two_segments(h: Harness, tmp_path: Path) -> None:
    from trajmesh.rollout.agents.agent_runner import AgentRunner

    (tmp_path / "agents_for_test.py").write_text(AGENTS_FOR_TEST)
    runner = AgentRunner(h.ep, h.url, python_path=[str(tmp_path), str(REPO / "examples")])
    before = len(h.engine.records)
    trajs, outcome = asyncio.run(runner.run(_task(QUESTION), "agents_for_test:solve_then_edit_history", 300,
                                            session_id="edit2"))
    assert (outcome.terminal_reason, outcome.answer, outcome.segments) == (trajectory_pb2.EOS, ANSWER, 2), outcome.detail
    (in1, out1), (in2, out2), (in3, out3) = h.engine.records[before:before + 3]
    (traj,) = trajs  # one per sample, both segments in it
    assert list(traj.pb.sequence_starts) == [0, len(in2) + len(out2)]
    assert traj.token_ids_T.tolist() == in2 + out2 + in3 + out3
    assert _sampled(traj) == [out1, out2, out3] and (out1, out2) == (h.script["call"], h.script["answer"])
    assert traj.pb.final_answer == ANSWER
    assert traj.validate(vocab_size=h.tok.vocab_size, learner_version=0) == []


def test_crashed_agent_is_an_infra_failure(h: Harness, tmp_path: Path) -> None:
    from trajmesh.rollout.agents.agent_runner import AgentRunner

    (tmp_path / "agents_for_test.py").write_text(AGENTS_FOR_TEST)
    runner = AgentRunner(h.ep, h.url, python_path=[str(tmp_path)])
    trajs, outcome = asyncio.run(runner.run(_task("Hi"), "agents_for_test:call_then_crash", 300, session_id="crash1"))
    assert outcome.terminal_reason == trajectory_pb2.INFRA_FAILURE and "the agent broke" in outcome.detail
    assert [t.pb.terminal_reason for t in trajs] == [trajectory_pb2.INFRA_FAILURE]
    trajs, outcome = asyncio.run(runner.run(_task("Hi"), "agents_for_test:no_such_agent", 300, session_id="bad2"))
    assert outcome.terminal_reason == trajectory_pb2.INFRA_FAILURE and trajs == []


@pytest.mark.slow
def test_timed_out_agent_is_killed_and_never_rewarded(h: Harness, tmp_path: Path) -> None:
    """Waits out a 30 s budget (the agent's one call must fit in it on a loaded machine)."""
    from trajmesh.rollout.agents.agent_runner import AgentRunner

    (tmp_path / "agents_for_test.py").write_text(AGENTS_FOR_TEST)
    runner = AgentRunner(h.ep, h.url, python_path=[str(tmp_path)])
    trajs, outcome = asyncio.run(runner.run(_task("Hi"), "agents_for_test:call_then_hang", 30, session_id="hang1"))
    assert outcome.terminal_reason == trajectory_pb2.WALL_TIMEOUT
    assert [(t.pb.terminal_reason, t.pb.truncated) for t in trajs] == [(trajectory_pb2.WALL_TIMEOUT, True)]


def test_http_agent(h: Harness) -> None:
    from aiohttp import web

    from trajmesh.rollout.agents.agent_runner import AgentRunner

    answered: list[str] = []

    async def agent(request: web.Request) -> web.Response:
        body = await request.json()
        if body["task"]["prompt"] == "fail":
            return web.Response(status=500)
        client = openai.AsyncOpenAI(base_url=body["base_url"], api_key=body["api_key"])
        reply = await client.chat.completions.create(
            model=body["task"]["model"], messages=[{"role": "user", "content": body["task"]["prompt"]}], max_tokens=3)
        answered.append(f"agent says: {reply.choices[0].message.content}")
        return web.json_response({"answer": answered[-1]})

    async def scenario() -> list[Any]:
        runner_http = web.AppRunner(web.Application())
        runner_http.app.router.add_post("/run", agent)
        await runner_http.setup()
        port = free_port()
        await web.TCPSite(runner_http, "127.0.0.1", port).start()
        try:
            runner = AgentRunner(h.ep, h.url)
            ok = await runner.run(_task("Say hi."), f"http://127.0.0.1:{port}/run", 120, session_id="http1")
            bad = await runner.run(_task("fail"), f"http://127.0.0.1:{port}/run", 120, session_id="http2")
            return [ok, bad]
        finally:
            await runner_http.cleanup()

    before = len(h.engine.records)
    (trajs, outcome), (bad_trajs, bad) = asyncio.run(scenario())
    assert outcome.terminal_reason == trajectory_pb2.EOS, outcome.detail
    (traj,) = trajs
    assert _sampled(traj) == [h.engine.records[before][1]]
    assert traj.pb.final_answer == outcome.answer == answered[0]  # the HTTP agent's answer is what is graded
    assert bad.terminal_reason == trajectory_pb2.INFRA_FAILURE and bad_trajs == []


def test_api_key_is_checked_when_set(h: Harness) -> None:
    h.ep.open_session("key1")
    h.ep.api_key = "secret"
    try:
        with pytest.raises(openai.AuthenticationError) as err:
            h.openai("key1", max_retries=0).completions.create(model="tiny", prompt="Say hi.", max_tokens=2)
        assert err.value.response.json()["error"]["type"] == "authentication_error"
        ok = openai.OpenAI(base_url=h.base("key1"), api_key="secret").completions.create(
            model="tiny", prompt="Say hi.", max_tokens=2, logprobs=1)
        assert ok.choices[0].logprobs is not None and len(ok.choices[0].logprobs.token_logprobs) >= 1
    finally:
        h.ep.api_key = None


def test_streaming_clients_get_the_whole_answer(h: Harness) -> None:
    h.ep.open_session("stream1")
    tools = [{"type": "function", "function": ADD_FN}]
    chunks = list(h.openai("stream1").chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": QUESTION}], tools=tools, temperature=0, max_tokens=64,
        stream=True, stream_options={"include_usage": True}))
    calls = [tc for c in chunks for ch in c.choices for tc in (ch.delta.tool_calls or [])]
    assert [(tc.function.name, json.loads(tc.function.arguments)) for tc in calls] == [("add", {"a": 2, "b": 3})]
    assert [ch.finish_reason for c in chunks for ch in c.choices if ch.finish_reason] == ["tool_calls"]
    assert chunks[-1].usage.completion_tokens == len(h.script["call"])
    h.ep.open_session("stream2")
    client = anthropic.Anthropic(base_url=f"{h.url}/sessions/stream2", api_key="unused", timeout=120)
    a_tools = [{"name": ADD_FN["name"], "description": ADD_FN["description"], "input_schema": ADD_FN["parameters"]}]
    with client.messages.stream(model="tiny", max_tokens=64, messages=[{"role": "user", "content": QUESTION}],
                                tools=a_tools, extra_body={"temperature": 0}) as stream:
        message = stream.get_final_message()
    assert message.stop_reason == "tool_use"
    assert [(b.name, b.input) for b in message.content if b.type == "tool_use"] == [("add", {"a": 2, "b": 3})]
    assert message.usage.output_tokens == len(h.script["call"])


EXAMPLES = str(REPO / "examples")


def test_the_agents_returned_answer_is_graded_not_the_models_last_turn(h: Harness, tmp_path: Path) -> None:
    """The agent runs the example tool loop (the model's last turn: "The answer is 5.") and returns
    another string; the grader service's view of the trajectory carries that string and the
    external_agent grader scores it with the task source's scorer (chain_sum: exact answer)."""
    from trajmesh.contract import Trajectory
    from trajmesh.graders.external_agent import ExternalAgentGrader
    from trajmesh.graders.reasoning_gym import ReasoningGymGrader
    from trajmesh.rollout.agents.agent_runner import AgentRunner
    from trajmesh.services.grader import GraderService

    (tmp_path / "agents_for_test.py").write_text(AGENTS_FOR_TEST)
    runner = AgentRunner(h.ep, h.url, python_path=[str(tmp_path), EXAMPLES])
    service = SimpleNamespace(tokenizer=h.tok)  # what GraderService._sample reads

    def run(n: int, answer: str, returned: str | None) -> tuple[list[Trajectory], Any, dict[str, Any]]:
        meta = {"source": "agents_chain_sum", "grader": "external_agent", "agent_returns": returned}
        task = trajectory_pb2.Task(task_id=f"ans{n}", group_id="g1", source="agents_chain_sum", revision="r1",
                                   prompt=QUESTION, answer=answer, metadata_json=json.dumps(meta))
        trajs, outcome = asyncio.run(runner.run(task, "agents_for_test:tool_loop_then_return", 300,
                                                session_id=f"ans{n}"))
        return trajs, outcome, {"prompt": QUESTION, "answer": answer, "metadata": meta}

    # (task answer, what the agent returns, reward): right answer / wrong last turn, and the reverse
    for n, (answer, returned, reward) in enumerate([("5", "5", 1.0), (ANSWER, "5", 0.0)]):
        trajs, outcome, record = run(n, answer, returned)
        assert (outcome.terminal_reason, outcome.answer) == (trajectory_pb2.EOS, returned), outcome.detail
        (traj,) = trajs
        assert traj.pb.final_answer == returned  # recorded in the trajectory
        sample = GraderService._sample(service, Trajectory.from_bytes(traj.to_bytes()))  # type: ignore[arg-type]
        assert sample.final_answer == returned and sample.turns[-1] == ANSWER  # the model's last turn
        assert ReasoningGymGrader().grade(sample.turns[-1], record).reward == 1.0 - reward  # last turn: the reverse
        grade = ExternalAgentGrader().grade(sample, record)
        assert (grade.reward, grade.components["correct"], grade.components["finished"]) == (reward, reward, 1.0)
    # returns nothing: an infrastructure failure, no answer recorded (the grader never scores it)
    trajs, outcome, _ = run(2, "5", None)
    assert outcome.terminal_reason == trajectory_pb2.INFRA_FAILURE and "returned nothing" in outcome.detail
    assert [(t.pb.terminal_reason, t.pb.HasField("final_answer")) for t in trajs] == [
        (trajectory_pb2.INFRA_FAILURE, False)]


def _on_endpoint_loop(h: Harness, fn: Any) -> Any:
    """Runs `fn()` (a coroutine function) on the endpoint's event loop, where the rollout service
    runs its weight loads (PauseClock's events belong to that loop); returns its result."""
    assert h.engine.loop is not None
    return asyncio.run_coroutine_threadsafe(fn(), h.engine.loop).result(timeout=120)


def test_call_in_flight_across_a_weight_update(h: Harness) -> None:
    """A call is generating (3 tokens out, under v0) when a weight update starts. The update runs
    the rollout's sequence (RolloutService._load_weights: PauseClock.pause, engine
    /pause_generation, /update_weights_from_disk v1, /continue_generation, PauseClock.resume); the
    request comes back aborted, the sampler resubmits prompt + partial output under v1 and the call
    completes: its tokens record v0 for the first 3 and v1 after. A call started during the update
    is answered 503 + Retry-After and the official client retries it transparently under v1."""
    before = len(h.engine.records)
    session, late = h.ep.open_session("update1"), h.ep.open_session("update2")
    tools = [{"type": "function", "function": ADD_FN}]
    interrupt = h.engine.interrupt = Interrupt(cut=3)
    result: dict[str, Any] = {}

    def ask(sid: str) -> None:
        try:
            result[sid] = h.openai(sid, max_retries=8).chat.completions.create(
                model="tiny", messages=[{"role": "user", "content": QUESTION}], tools=tools, temperature=0,
                max_tokens=64)
        except Exception as exc:  # reported by the asserts below
            result[sid] = exc

    first = threading.Thread(target=ask, args=("update1",))
    first.start()
    assert interrupt.generated.wait(120), "the call never reached the engine"

    async def pause() -> None:
        h.pause.pause()
        async with EngineClient(h.engine.base_url) as ctl:
            await ctl.pause()

    async def load_and_resume() -> None:
        async with EngineClient(h.engine.base_url) as ctl:
            await ctl.update_weights_from_disk(str(h.model), version=1)
            await ctl.resume()
        h.pause.resume()

    _on_endpoint_loop(h, pause)
    interrupt.release.set()  # the in-flight request returns its partial output, aborted
    refused = h.ep.retryable_answers
    second = threading.Thread(target=ask, args=("update2",))
    second.start()
    deadline = time.monotonic() + 60
    while h.ep.retryable_answers == refused:  # the late call's first attempt was refused (retryable)
        assert time.monotonic() < deadline and second.is_alive(), "the late call was not refused"
        time.sleep(0.02)
    assert first.is_alive()  # still waiting for the load, not failed
    _on_endpoint_loop(h, load_and_resume)
    first.join(timeout=120)
    second.join(timeout=120)

    call = result["update1"].choices[0].message.tool_calls[0]
    assert (call.function.name, json.loads(call.function.arguments)) == ("add", {"a": 2, "b": 3})
    (comp,) = session.calls[0].completions
    assert comp.output_ids == h.script["call"]  # the same tokens as an uninterrupted generation
    assert comp.versions == [0] * 3 + [1] * (len(comp.output_ids) - 3)
    prompt = session.calls[0].prompt_ids
    mine = [(i, o) for i, o in h.engine.records[before:] if i[:len(prompt)] == prompt]
    # the interrupted request, its resubmission (prompt + the partial output) and the late call's
    assert sorted(len(i) - len(prompt) for i, _ in mine) == [0, 0, 3]
    assert prompt + comp.output_ids[:3] in [i for i, _ in mine]
    (traj,) = session.trajectories(_task(QUESTION), base_id="u")
    traj.finish(trajectory_pb2.EOS)
    sampled = [v for v, m in zip(traj.behavior_versions_T.tolist(), traj.loss_mask_T.tolist(), strict=True) if m]
    assert sampled == comp.versions and traj.validate(vocab_size=h.tok.vocab_size, learner_version=1) == []
    assert len(late.calls) == 1 and late.calls[0].completions[0].versions == [1] * len(h.script["call"])
    assert result["update2"].choices[0].message.tool_calls[0].function.name == "add"
    h.ep.close_session("update1")
    h.ep.close_session("update2")


WORKPLACE_AGENT = '''
import json
import urllib.request

from openai import OpenAI

ACTIONS = __ACTIONS__


def act(task, base_url, api_key):
    """One model call, then the scripted tool calls on the environment the runner hosts."""
    OpenAI(base_url=base_url, api_key=api_key).chat.completions.create(
        model=task["model"], messages=[{"role": "user", "content": task["prompt"]}], max_tokens=2)
    for name, arguments in ACTIONS:
        body = json.dumps({"tool_call": {"name": name, "arguments": arguments}}).encode()
        req = urllib.request.Request(base_url.removesuffix("/v1") + "/env/step", data=body,
                                     headers={"Content-Type": "application/json", "Authorization": f"Bearer {api_key}"})
        with urllib.request.urlopen(req) as resp:
            json.load(resp)
    return json.dumps(sorted(task["metadata"]))
'''


def test_workplace_task_is_graded_by_the_hosted_environments_final_state(h: Harness, tmp_path: Path) -> None:
    """The external_agent source's workplace tasks: the runner hosts a workplace environment for the
    session, the agent acts on it through the endpoint's env route (never seeing the reference
    solution), and the grader compares the recorded final state with the reference solution's."""
    import urllib.error
    import urllib.request

    from trajmesh.config import load_config
    from trajmesh.contract import Trajectory
    from trajmesh.envs.workplace import WorkplaceEnv
    from trajmesh.graders.external_agent import ExternalAgentGrader
    from trajmesh.rollout.agents.agent_runner import AgentRunner
    from trajmesh.services.grader import GraderService
    from trajmesh.tasks import load_split

    cfg = load_config(None, {"tasks.sources": [{"type": "external_agent", "agent": "unused:act",
                                                "tasks_from": "workplace"}]})
    spec = load_split(cfg.tasks.sources[0], 2, 1)[0][0]
    record = {"prompt": spec.prompt, "answer": spec.answer, "metadata": spec.metadata}
    task = trajectory_pb2.Task(task_id="wp", group_id="g1", source=spec.source, revision="r1", prompt=spec.prompt,
                               answer=spec.answer, metadata_json=json.dumps(spec.metadata), seed=3)
    initial = WorkplaceEnv().reset(record, 0)[1]
    runner = AgentRunner(h.ep, h.url, python_path=[str(tmp_path)])
    wrong = [["create_task", {"title": "nobody asked for this", "assignee_id": 1}]]
    for n, (actions, reward) in enumerate([(spec.metadata["solution"], 1.0), (wrong, 0.0)]):
        (tmp_path / f"agent_wp{n}.py").write_text(WORKPLACE_AGENT.replace("__ACTIONS__", repr(actions)))
        trajs, outcome = asyncio.run(runner.run(task, f"agent_wp{n}:act", 300, session_id=f"wp{n}"))
        assert outcome.terminal_reason == trajectory_pb2.EOS, outcome.detail
        seen = json.loads(outcome.answer)  # the metadata keys the agent was given
        assert "tools" in seen and "solution" not in seen and "answer" not in seen
        (traj,) = trajs
        hashes = list(traj.pb.state_hashes)
        assert len(hashes) == len(actions) + 1 and hashes[0] == initial and hashes[-1] != initial
        sample = GraderService._sample(SimpleNamespace(tokenizer=h.tok),  # type: ignore[arg-type]
                                       Trajectory.from_bytes(traj.to_bytes()))
        grade = ExternalAgentGrader().grade(sample, record)
        assert (grade.reward, grade.components["correct"]) == (reward, reward), grade.verifier_output
    # a session without a hosted environment: the env route answers 400 in the OpenAI error shape
    h.ep.open_session("noenv")
    req = urllib.request.Request(f"{h.url}/sessions/noenv/env/step", data=b'{"action": "x"}',
                                 headers={"Content-Type": "application/json"})
    with pytest.raises(urllib.error.HTTPError) as err:
        urllib.request.urlopen(req)
    assert err.value.code == 400 and "no hosted environment" in json.load(err.value)["error"]["message"]
    h.ep.close_session("noenv")


# --------------------------------------------------------------------- the APIs' exact behaviour


def _mid_token_stop(h: Harness) -> tuple[str, int, str]:
    """A stop string inside the scripted tool call that ends one character into a token of two or
    more characters: (stop, k, text before it); the engine's output ends with token k (kept, as
    SGLang and vLLM keep the token that completes a stop string)."""
    call = h.script["call"][:-1]
    full = h.tok.decode(call)
    for k in range(2, len(call)):
        pre, upto = h.tok.decode(call[:k]), h.tok.decode(call[:k + 1])
        if len(upto) - len(pre) < 2 or not upto.startswith(pre):
            continue
        stop = pre[-3:] + upto[len(pre)]
        if full.find(stop) == len(pre) - 3 and not pre[-3:].isspace():
            return stop, k, pre[:-3]
    raise AssertionError("no token of two characters in the scripted call")


def test_stop_string_stops_the_engine_and_the_trajectory_is_what_the_agent_got(h: Harness) -> None:
    """``stop`` reaches the engine, which ends the turn at the token completing the stop string;
    the answer is the text before it, and the trajectory, the usage, the log-probs and the next
    call's prompt prefix hold exactly the tokens generated up to there."""
    stop, k, before_stop = _mid_token_stop(h)
    expected = h.script["call"][:k + 1]
    session = h.ep.open_session("stop1")
    client = h.openai("stop1")
    tools = [{"type": "function", "function": ADD_FN}]
    msgs: list[dict[str, Any]] = [{"role": "user", "content": QUESTION}]
    n = len(h.engine.records)
    first = client.chat.completions.create(model="tiny", messages=msgs, tools=tools, temperature=0, max_tokens=64,
                                           stop=[stop], logprobs=True)
    assert h.engine.samplings[n]["stop"] == [stop]  # the engine, not the endpoint, stopped
    (in1, out1), = h.engine.records[n:]
    assert out1 == expected
    choice = first.choices[0]
    assert (choice.message.content, choice.message.tool_calls, choice.finish_reason) == (before_stop, None, "stop")
    assert first.usage.completion_tokens == len(expected) == len(choice.logprobs.content)
    msgs += [{"role": "assistant", "content": choice.message.content}, {"role": "user", "content": "Go on."}]
    client.chat.completions.create(model="tiny", messages=msgs, tools=tools, max_tokens=2)
    (in2, out2), = h.engine.records[n + 1:]
    assert in2[:len(in1) + len(expected)] == in1 + expected
    (traj,) = session.trajectories(None, base_id="t")
    assert _sampled(traj) == [expected, out2]
    aclient = anthropic.Anthropic(base_url=f"{h.url}/sessions/stop1", api_key="unused", timeout=120)
    a_tools = [{"name": ADD_FN["name"], "description": ADD_FN["description"], "input_schema": ADD_FN["parameters"]}]
    msg = aclient.messages.create(model="tiny", max_tokens=64, messages=[{"role": "user", "content": QUESTION}],
                                  tools=a_tools, stop_sequences=[stop], extra_body={"temperature": 0})
    assert (msg.stop_reason, msg.stop_sequence, msg.usage.output_tokens) == ("stop_sequence", stop, len(expected))
    assert [b.text for b in msg.content] == [before_stop] and h.engine.records[-1][1] == expected


def test_identical_request_retried_after_a_refusal_keeps_the_delivered_answer(h: Harness) -> None:
    """A best-of-2 agent sends one request twice; the second is refused (503) during a weight load
    and the SDK retries it. Both answers reached the agent: both are trained, none is an orphan."""
    session = h.ep.open_session("retry2")
    msgs = [{"role": "user", "content": "Say hi."}]
    n = len(h.engine.records)
    h.openai("retry2").chat.completions.create(model="tiny", messages=msgs, max_tokens=6)
    result: dict[str, Any] = {}
    h.pause.pause()
    try:
        refused = h.ep.retryable_answers
        worker = threading.Thread(target=lambda: result.update(r=h.openai("retry2", max_retries=3).chat.completions.create(
            model="tiny", messages=msgs, max_tokens=6)))
        worker.start()
        deadline = time.monotonic() + 60
        while h.ep.retryable_answers == refused:  # the second request's first attempt was refused
            assert time.monotonic() < deadline and worker.is_alive()
            time.sleep(0.02)
    finally:
        h.pause.resume()
    worker.join(timeout=120)
    assert result["r"].choices
    assert [c.orphan for call in session.calls for c in call.completions] == [False, False]
    assert [call is None for _, call in session.attempts] == [False, True, False]  # the refusal is recorded
    outs = [out for _, out in h.engine.records[n:]]
    assert sorted(_sampled(t)[0] for t in session.trajectories(None, base_id="t")) == sorted(outs)
    assert h.ep.close_session("retry2").calls[1].completions[0].output_ids == outs[1]


def test_context_model_and_budget_errors_are_the_apis_own(h: Harness) -> None:
    """A prompt past the context: 400 ``context_length_exceeded`` (Anthropic: invalid_request_error);
    ``max_tokens`` above what fits: 400; a model the endpoint does not serve: 404 ``model_not_found``.
    Each is the SDKs' own exception type, and none reaches the engine or the session's record."""
    session = h.ep.open_session("err1")
    client = h.openai("err1", max_retries=0)
    aclient = anthropic.Anthropic(base_url=f"{h.url}/sessions/err1", api_key="unused", max_retries=0)
    long_text = " ".join([QUESTION] * 400)
    assert len(h.tok.encode(long_text)) > 1024  # the harness engine's context
    n = len(h.engine.records)
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": long_text}])
    assert (err.value.code, err.value.param) == ("context_length_exceeded", "messages")
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": QUESTION}], max_tokens=1000)
    assert (err.value.code, err.value.param) == ("context_length_exceeded", "max_tokens")
    with pytest.raises(openai.BadRequestError) as err:
        client.responses.create(model="tiny", input=long_text)
    assert err.value.code == "context_length_exceeded"
    with pytest.raises(openai.NotFoundError) as nf:
        client.chat.completions.create(model="gpt-4o", messages=[{"role": "user", "content": QUESTION}])
    assert nf.value.code == "model_not_found"
    with pytest.raises(anthropic.BadRequestError) as aerr:
        aclient.messages.create(model="tiny", max_tokens=8, messages=[{"role": "user", "content": long_text}])
    assert aerr.value.body["error"]["type"] == "invalid_request_error"
    with pytest.raises(anthropic.BadRequestError):
        aclient.messages.create(model="tiny", max_tokens=1000, messages=[{"role": "user", "content": QUESTION}])
    with pytest.raises(anthropic.NotFoundError) as anf:
        aclient.messages.create(model="claude-x", max_tokens=8, messages=[{"role": "user", "content": QUESTION}])
    assert anf.value.body["error"]["type"] == "not_found_error"
    assert len(h.engine.records) == n and session.calls == []
    ok = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": QUESTION}], max_tokens=2)
    assert ok.model == "tiny" and len(session.calls) == 1
    h.ep.close_session("err1")


def test_served_model_name_is_configured_or_the_model_directorys() -> None:
    from trajmesh.config import load_config
    from trajmesh.rollout.agents.agent_episodes import served_model_name

    assert load_config(None, {}).rollout.agent_endpoint.model_name == ""
    assert served_model_name("", "/models/Qwen2.5-0.5B-Instruct/") == "Qwen2.5-0.5B-Instruct"
    assert served_model_name("", "Qwen/Qwen2.5-0.5B-Instruct") == "Qwen2.5-0.5B-Instruct"
    assert served_model_name("policy", "/models/Qwen2.5-0.5B-Instruct") == "policy"


def test_tool_choice_and_parallel_tool_calls_are_honoured_or_refused(h: Harness) -> None:
    """``tool_choice: none`` stops the engine before a tool call begins and ``parallel_tool_calls:
    false`` after the first call closes (stop strings on the native tags, the tokens kept as
    generated); a constraint that cannot be honoured (``required`` without tools, a function that
    is not among them, a format that is not JSON) answers 400 (the constrained ones:
    tests/unit/rollout/agents/test_agent_constrained.py)."""
    session = h.ep.open_session("choice1")
    client = h.openai("choice1", max_retries=0)
    tools = [{"type": "function", "function": ADD_FN}]
    msgs = [{"role": "user", "content": QUESTION}]
    open_tag, close_tag = (h.tok.tokenizer.token_to_id(t) for t in ("<tool_call>", "</tool_call>"))
    call = h.script["call"]
    n = len(h.engine.records)
    none = client.chat.completions.create(model="tiny", messages=msgs, tools=tools, tool_choice="none",
                                          temperature=0, max_tokens=64)
    assert (none.choices[0].message.tool_calls, none.choices[0].finish_reason) == (None, "stop")
    assert h.engine.records[n][1] == call[:call.index(open_tag) + 1]
    one = client.chat.completions.create(model="tiny", messages=msgs, tools=tools, parallel_tool_calls=False,
                                         temperature=0, max_tokens=64)
    assert "</tool_call>" in h.engine.samplings[n + 1]["stop"]
    assert h.engine.records[n + 1][1] == call[:call.index(close_tag) + 1]  # ends at the call: no second one
    assert [tc.function.name for tc in one.choices[0].message.tool_calls] == ["add"]
    assert one.choices[0].finish_reason == "tool_calls"
    resp = client.responses.create(model="tiny", input=QUESTION, tools=[{"type": "function", **ADD_FN}],
                                   tool_choice="none", parallel_tool_calls=False, temperature=0, max_output_tokens=64)
    assert (resp.tool_choice, resp.parallel_tool_calls) == ("none", False)
    assert [o.type for o in resp.output] == ["message"]
    refused = [
        lambda: client.chat.completions.create(model="tiny", messages=msgs, tool_choice="required"),
        lambda: client.chat.completions.create(model="tiny", messages=msgs, tools=tools,
                                               tool_choice={"type": "function", "function": {"name": "sub"}}),
        lambda: client.chat.completions.create(model="tiny", messages=msgs, response_format={"type": "yaml"}),
        lambda: client.responses.create(model="tiny", input=QUESTION, text={"format": {"type": "json_schema",
                                                                                      "name": "x"}}),
    ]
    for ask in refused:
        with pytest.raises(openai.BadRequestError) as err:
            ask()
        assert err.value.param in ("tool_choice", "response_format", "text.format")
    aclient = anthropic.Anthropic(base_url=f"{h.url}/sessions/choice1", api_key="unused", max_retries=0)
    with pytest.raises(anthropic.BadRequestError):
        aclient.messages.create(model="tiny", max_tokens=8, messages=msgs, tool_choice={"type": "tool", "name": "sub"},
                                tools=[{"name": "add", "input_schema": ADD_FN["parameters"]}])
    assert len(session.calls) == 3
    h.ep.close_session("choice1")


def test_responses_streaming_gives_the_sdk_its_event_sequence(h: Harness) -> None:
    """``stream: true`` on the Responses API: the SDK's stream helper assembles the answer from the
    events (it checks their order) and the final response is the recorded call."""
    session = h.ep.open_session("rstream1")
    client = h.openai("rstream1")
    tools = [{"type": "function", **ADD_FN}]
    with client.responses.stream(model="tiny", input=QUESTION, tools=tools, temperature=0,
                                 max_output_tokens=64) as stream:
        kinds = [event.type for event in stream]
        final = stream.get_final_response()
    assert kinds[0] == "response.created" and kinds[-1] == "response.completed"
    assert "response.function_call_arguments.delta" in kinds
    calls = [o for o in final.output if o.type == "function_call"]
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [("add", {"a": 2, "b": 3})]
    assert final.usage.output_tokens == len(h.script["call"])
    (traj,) = session.trajectories(None, base_id="t")
    assert _sampled(traj) == [h.script["call"]]
    h.ep.close_session("rstream1")


def test_openai_agents_sdk_runs_streamed_on_the_responses_model(h: Harness) -> None:
    """The OpenAI Agents SDK's ``Runner.run_streamed`` with its Responses model drives the tool loop
    through the endpoint; every trained span is exactly the tokens behind what the SDK received."""
    agents = pytest.importorskip("agents")
    agents.set_tracing_disabled(True)
    session = h.ep.open_session("oa-sdk1")

    async def add(_ctx: Any, arguments: str) -> str:
        args = json.loads(arguments)
        return str(args["a"] + args["b"])

    tool = agents.FunctionTool(name=ADD_FN["name"], description=ADD_FN["description"],
                               params_json_schema=ADD_FN["parameters"], on_invoke_tool=add, strict_json_schema=False)
    model = agents.OpenAIResponsesModel(model="tiny", openai_client=openai.AsyncOpenAI(
        base_url=h.base("oa-sdk1"), api_key="unused", timeout=120))
    agent = agents.Agent(name="adder", model=model, tools=[tool],
                         model_settings=agents.ModelSettings(temperature=0, max_tokens=64))

    async def run() -> tuple[Any, list[str]]:
        result = agents.Runner.run_streamed(agent, input=QUESTION)
        kinds = [event.type async for event in result.stream_events()]
        return result, kinds

    result, kinds = asyncio.run(run())
    assert result.final_output == ANSWER and "raw_response_event" in kinds
    (traj,) = h.ep.close_session("oa-sdk1").trajectories(None, base_id="t")
    assert _sampled(traj) == [h.script["call"], h.script["answer"]]
    assert [c.reason for c in session.calls] == ["first", "continued"]


# ------------------------------------------------ the agent run by the environment service (RunAgent)

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

HANG_HOOK = '''
import asyncio

import openai

from trajmesh.rollout.agents.agent_runner import AgentOutcome
from trajmesh.v1 import trajectory_pb2

STATE = {"runs": [], "called": None}


async def call_then_hang(call):
    """One model call, then hangs until the service running it goes away; a second run (a retry
    elsewhere) answers at once."""
    STATE["runs"].append(call.cache["name"])
    if len(STATE["runs"]) > 1:
        return AgentOutcome(trajectory_pb2.EOS, "retried")
    client = openai.AsyncOpenAI(base_url=call.base_url, api_key=call.api_key, timeout=120)
    await client.chat.completions.create(model=call.model, messages=[{"role": "user", "content": "Hi"}], max_tokens=2)
    STATE["called"].set()
    await asyncio.Event().wait()
'''


def _agent_task(tid: str, agent: str, python_path: list[str]) -> Any:
    meta = {"agent": agent, "python_path": python_path, "budget_s": 120}
    return trajectory_pb2.Task(task_id=tid, group_id="g1", source="external_agent", revision="r1", prompt=QUESTION,
                               answer="5", environment="external_agent", metadata_json=json.dumps(meta))


def _rollout_host(h: Harness, tmp_path: Path, ports: list[int], wait_s: float = 60.0) -> Any:
    """What `agent_episodes.run_episode` asks of the rollout process, stubs to environment services on `ports`."""
    import grpc

    from trajmesh.config import load_config
    from trajmesh.rollout.agents.agent_runner import AgentRunner
    from trajmesh.v1 import services_pb2_grpc

    cfg = load_config(None, {"run_dir": str(tmp_path / "run"), "rollout.environment_wait_s": wait_s})
    channels = [grpc.aio.insecure_channel(f"127.0.0.1:{p}") for p in ports]
    return SimpleNamespace(cfg=cfg, envs=[services_pb2_grpc.EnvironmentStub(c) for c in channels], channels=channels,
                           agents=AgentRunner(h.ep, h.url), tokenizer=h.tok, worker_id="rollout-test")


async def _environment_service(tmp_path: Path, name: str) -> Any:
    from trajmesh.config import load_config
    from trajmesh.services.environment import EnvironmentService

    svc = EnvironmentService(load_config(None, {"run_dir": str(tmp_path / name)}))
    svc.agent_cache["name"] = name
    await svc.setup()
    return svc


def test_the_agent_runs_in_the_environment_service(h: Harness, tmp_path: Path) -> None:
    """A sample of an external agent: the rollout hands the run to the environment service's RunAgent,
    whose process starts the agent; the agent's calls reach the rollout's endpoint session and make
    the trajectory. An environment with no agent hook is a config error (INVALID_ARGUMENT)."""
    import grpc

    from trajmesh.rollout.agents import agent_episodes
    from trajmesh.services.environment import CALLS

    (tmp_path / "where_agent.py").write_text(WHERE_AGENT)
    task = _agent_task("env1", "where_agent:solve", [str(tmp_path), EXAMPLES])

    async def scenario() -> Any:
        svc = await _environment_service(tmp_path, "env-a")
        host = _rollout_host(h, tmp_path, [svc.grpc_port])
        try:
            traj = await agent_episodes.run_episode(host, task, 0)
            plain = _agent_task("env2", "where_agent:solve", [])
            plain.environment = "single_answer"
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await agent_episodes.run_episode(host, plain, 0)
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "external_agent" in str(err.value.details())
            return traj
        finally:
            await svc.stop()

    runs = CALLS.labels("run_agent", "eos")._value.get()
    before = len(h.engine.records)
    traj = asyncio.run(scenario())
    assert CALLS.labels("run_agent", "eos")._value.get() == runs + 1  # through RunAgent
    assert (tmp_path / "parents.txt").read_text().split() == [str(os.getpid())]  # the service's process started it
    assert traj.pb.terminal_reason == trajectory_pb2.EOS and traj.pb.final_answer == ANSWER
    assert traj.pb.trajectory_id == "env1-0" and traj.pb.environment_revision
    assert _sampled(traj) == [out for _, out in h.engine.records[before:]] == [h.script["call"], h.script["answer"]]


def test_no_environment_service_ends_the_sample_as_an_environment_failure(h: Harness, tmp_path: Path) -> None:
    """No replica answers RunAgent: the rollout waits `rollout.environment_wait_s` (nothing of the
    sample exists yet), then ends it INFRA_FAILURE with cause INFRA_ENVIRONMENT; the agent never ran."""
    from trajmesh.rollout.agents import agent_episodes

    (tmp_path / "where_agent.py").write_text(WHERE_AGENT)
    before = len(h.engine.records)

    async def scenario() -> Any:
        host = _rollout_host(h, tmp_path, [free_port()], wait_s=1.0)
        return await agent_episodes.run_episode(host, _agent_task("none1", "where_agent:solve", [str(tmp_path)]), 0)

    traj = asyncio.run(scenario())
    assert (traj.pb.terminal_reason, traj.pb.infra_cause) == (trajectory_pb2.INFRA_FAILURE,
                                                              trajectory_pb2.INFRA_ENVIRONMENT)
    assert len(h.engine.records) == before and not (tmp_path / "parents.txt").exists()


def test_an_environment_that_dies_mid_run_is_not_retried(h: Harness, tmp_path: Path) -> None:
    """Two environment replicas. The one running the agent goes away after the agent's first model
    call: the sample ends INFRA_FAILURE (INFRA_ENVIRONMENT) with that call in it, and it is not run
    again on the other replica (a second run would mix two runs' calls in one session)."""
    import importlib

    from trajmesh.rollout.agents import agent_episodes

    (tmp_path / "hang_hook.py").write_text(HANG_HOOK)
    sys.path.insert(0, str(tmp_path))
    try:
        hook = importlib.import_module("hang_hook")

        async def scenario() -> Any:
            hook.STATE["called"] = asyncio.Event()
            services = {name: await _environment_service(tmp_path, name) for name in ("env-a", "env-b")}
            for svc in services.values():
                svc.agent_hooks["external_agent"] = "hang_hook:call_then_hang"
            host = _rollout_host(h, tmp_path, [s.grpc_port for s in services.values()])
            try:
                run = asyncio.create_task(agent_episodes.run_episode(host, _agent_task("die1", "unused:x", []), 0))
                await asyncio.wait_for(hook.STATE["called"].wait(), 120)
                (running,) = hook.STATE["runs"]
                await services[running].stop()
                return await asyncio.wait_for(run, 120)
            finally:
                for svc in services.values():
                    await svc.stop()

        traj = asyncio.run(scenario())
    finally:
        sys.path.remove(str(tmp_path))
        sys.modules.pop("hang_hook", None)
    assert len(hook.STATE["runs"]) == 1, hook.STATE["runs"]  # never run again on the other replica
    assert (traj.pb.terminal_reason, traj.pb.infra_cause) == (trajectory_pb2.INFRA_FAILURE,
                                                              trajectory_pb2.INFRA_ENVIRONMENT)
    assert len(_sampled(traj)) == 1  # the call it made before the replica went away


def test_a_hosted_environment_lives_in_the_environment_service(h: Harness, tmp_path: Path) -> None:
    """A workplace task run through the mesh's path (`agent_episodes.run_episode`): the hosted
    environment is a session of the environment service, reset there and stepped there by the
    agent's /env/step calls; the trajectory records its states, graded as before. A service that
    lost the session before a step (a replica restarted) makes the run the environment's
    infrastructure failure, whatever the agent does with the endpoint's 503."""
    from trajmesh.config import load_config
    from trajmesh.contract import Trajectory
    from trajmesh.envs.workplace import WorkplaceEnv
    from trajmesh.graders.external_agent import ExternalAgentGrader
    from trajmesh.rollout.agents import agent_episodes
    from trajmesh.services.environment import CALLS
    from trajmesh.services.grader import GraderService
    from trajmesh.tasks import load_split

    cfg = load_config(None, {"tasks.sources": [{"type": "external_agent", "agent": "unused:act",
                                                "tasks_from": "workplace"}]})
    spec = load_split(cfg.tasks.sources[0], 2, 1)[0][0]
    actions = spec.metadata["solution"]
    (tmp_path / "agent_wp_env.py").write_text(WORKPLACE_AGENT.replace("__ACTIONS__", repr(actions)))
    meta = {**spec.metadata, "agent": "agent_wp_env:act", "python_path": [str(tmp_path)], "budget_s": 120}
    task = trajectory_pb2.Task(task_id="wpe", group_id="g1", source=spec.source, revision="r1", prompt=spec.prompt,
                               answer=spec.answer, environment="external_agent", metadata_json=json.dumps(meta), seed=3)
    record = {"prompt": spec.prompt, "answer": spec.answer, "metadata": spec.metadata}
    initial = WorkplaceEnv().reset(record, 3)[1]

    async def scenario(stop_first: bool) -> Any:
        svc = await _environment_service(tmp_path, "env-wp")
        host = _rollout_host(h, tmp_path, [svc.grpc_port])
        try:
            if stop_first:  # the service answers the Reset, then loses the session before the agent's steps
                real = host.agents.run_session

                async def run_session(*args: Any, **kwargs: Any) -> Any:
                    svc.close_session(kwargs["hosted"].remote[1])  # as a restarted replica has lost it
                    return await real(*args, **kwargs)

                host.agents.run_session = run_session
            return await agent_episodes.run_episode(host, task, 0)
        finally:
            await svc.stop()

    if h.engine.loop is None:  # the endpoint's loop (uvicorn's thread) is known once it generated
        h.ep.open_session("wpe-warm")
        h.openai("wpe-warm").completions.create(model="tiny", prompt="Hi", max_tokens=1)
        h.ep.close_session("wpe-warm")
    loop = h.engine.loop
    assert loop is not None

    def on_endpoint_loop(coro: Any) -> Any:
        """The mesh runs the endpoint, the stubs and the episode on one loop, as the rollout does."""
        return asyncio.run_coroutine_threadsafe(coro, loop).result(300)

    steps = CALLS.labels("step", "ok")._value.get()
    traj = on_endpoint_loop(scenario(stop_first=False))
    assert CALLS.labels("step", "ok")._value.get() == steps + len(actions)  # stepped in the service
    assert traj.pb.terminal_reason == trajectory_pb2.EOS
    hashes = list(traj.pb.state_hashes)
    assert len(hashes) == len(actions) + 1 and hashes[0] == initial and hashes[-1] != initial
    sample = GraderService._sample(SimpleNamespace(tokenizer=h.tok),  # type: ignore[arg-type]
                                   Trajectory.from_bytes(traj.to_bytes()))
    assert ExternalAgentGrader().grade(sample, record).reward == 1.0

    failed = on_endpoint_loop(scenario(stop_first=True))
    assert (failed.pb.terminal_reason, failed.pb.infra_cause) == (trajectory_pb2.INFRA_FAILURE,
                                                                  trajectory_pb2.INFRA_ENVIRONMENT)


def test_a_cancelled_run_kills_the_agent(h: Harness, tmp_path: Path) -> None:
    """A run cancelled from outside (the sample's deadline, a rollout gone: the environment service's
    RunAgent handler is cancelled) kills the agent's process group, not only a run past its budget:
    here, and through the environment service."""
    from trajmesh.rollout.agents.agent_runner import AgentRunner

    (tmp_path / "agents_for_test.py").write_text(AGENTS_FOR_TEST)
    pid_file = tmp_path / "agent.pid"
    task = _task("Hi")
    task.metadata_json = json.dumps({"pid_file": str(pid_file)})
    runner = AgentRunner(h.ep, h.url, python_path=[str(tmp_path)])

    async def scenario() -> int:
        run = asyncio.create_task(runner.run(task, "agents_for_test:pid_then_hang", 300, session_id="cancel1"))
        deadline = time.monotonic() + 120
        while not pid_file.exists() or not pid_file.read_text():  # the agent is up
            assert time.monotonic() < deadline and not run.done()
            await asyncio.sleep(0.05)
        run.cancel()
        with pytest.raises(asyncio.CancelledError):
            await run
        return int(pid_file.read_text())

    def dies(pid: int) -> None:
        """SIGKILLed before the cancel propagated: dead (a zombie until reaped) or gone once the
        kernel has run the kill; the old code left it sleeping out its hour."""
        state = Path(f"/proc/{pid}/stat")
        deadline = time.monotonic() + 30
        while state.exists() and state.read_text().split(") ")[1][0] not in "ZX":
            assert time.monotonic() < deadline, state.read_text()
            time.sleep(0.05)

    dies(asyncio.run(scenario()))

    # through the environment service: the rollout's side cancelled (its sample deadline), the
    # cancellation crosses gRPC to RunAgent's handler, which kills the agent
    from trajmesh.rollout.agents import agent_episodes

    pid_file.unlink()
    meta = {"agent": "agents_for_test:pid_then_hang", "python_path": [str(tmp_path)], "budget_s": 300,
            "pid_file": str(pid_file)}
    remote = _agent_task("cancel2", "unused:x", [])
    remote.metadata_json = json.dumps(meta)

    async def through_the_service() -> int:
        svc = await _environment_service(tmp_path, "env-cancel")
        host = _rollout_host(h, tmp_path, [svc.grpc_port])
        try:
            run = asyncio.create_task(agent_episodes.run_episode(host, remote, 0))
            deadline = time.monotonic() + 120
            while not pid_file.exists() or not pid_file.read_text():
                assert time.monotonic() < deadline and not run.done()
                await asyncio.sleep(0.05)
            run.cancel()
            with pytest.raises(asyncio.CancelledError):
                await run
            pid = int(pid_file.read_text())
            state = Path(f"/proc/{pid}/stat")
            deadline = time.monotonic() + 30  # the service keeps serving meanwhile: its stop is not what kills it
            while state.exists() and state.read_text().split(") ")[1][0] not in "ZX":
                assert time.monotonic() < deadline, state.read_text()
                await asyncio.sleep(0.05)
            return pid
        finally:
            await svc.stop()

    asyncio.run(through_the_service())
