"""Constrained decoding through the agent endpoint: ``tool_choice`` required / a named tool
(Anthropic ``any`` / ``tool``) and ``response_format`` / ``text.format`` JSON schemas.

The request building is checked per engine (the ``ebnf`` sampling param SGLang takes, vLLM's
``structured_outputs``; SGLang's request is not run against a server here). The torch engine runs
for real: a tiny random ChatML Qwen2 model (untrained: greedy, it never writes a tool call or JSON
by itself, which each test checks with the same request unconstrained) behind the endpoint, driven
by the official ``openai`` / ``anthropic`` clients over the app's ASGI transport. Every /generate
the engine answers is recorded by the test's client wrapper and compared with the trajectory; the
log-probs are compared with the masked distribution recomputed here from the model and xgrammar.
The vLLM counterpart runs in tests/unit/rollout/engines/test_engine_conformance.py (its module-scoped servers).
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

torch = pytest.importorskip("torch")
xgr = pytest.importorskip("xgrammar")
openai = pytest.importorskip("openai")
anthropic = pytest.importorskip("anthropic")
jsonschema = pytest.importorskip("jsonschema")
from chatml_model import build_chatml_model  # noqa: E402
from fastapi.testclient import TestClient  # noqa: E402

from trajmesh.infra import free_port  # noqa: E402
from trajmesh.rollout.agents.agent_endpoint import AgentEndpoint, ApiError, constrain, create_app  # noqa: E402
from trajmesh.rollout.agents.chat_format import ChatFormat, model_stop_ids  # noqa: E402
from trajmesh.rollout.engines import TorchEngineConfig  # noqa: E402
from trajmesh.rollout.engines.engine_client import EngineClient  # noqa: E402
from trajmesh.rollout.engines.generation import PauseClock, TurnSampler  # noqa: E402
from trajmesh.rollout.engines.grammar import json_ebnf, tool_calls_ebnf  # noqa: E402
from trajmesh.rollout.engines.vllm_engine import vllm_sampling  # noqa: E402
from trajmesh.tokenizer import load_tokenizer  # noqa: E402
from trajmesh.tool_calls import ToolCall, parse_tool_calls, render_tool_calls  # noqa: E402
from trajmesh.v1 import trajectory_pb2  # noqa: E402

WEATHER = {"name": "get_weather", "description": "Weather in a city.",
           "parameters": {"type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Oslo"]},
                                                           "celsius": {"type": "boolean"}},
                          "required": ["city", "celsius"]}}
TIME = {"name": "get_time", "description": "Local time in a zone.",
        "parameters": {"type": "object", "properties": {"zone": {"type": "string", "enum": ["UTC", "CET"]}},
                       "required": ["zone"]}}
TOOLS = [{"type": "function", "function": WEATHER}, {"type": "function", "function": TIME}]
ANSWER_SCHEMA = {"type": "object", "properties": {"answer": {"type": "integer", "minimum": 0, "maximum": 99},
                                                  "sure": {"type": "boolean"}},
                 "required": ["answer", "sure"], "additionalProperties": False}
TEXTS = ["What is the weather in Paris?", json.dumps(WEATHER), json.dumps(ANSWER_SCHEMA),
         "You are a helpful assistant."] * 20
MESSAGES = [{"role": "user", "content": "What is the weather in Paris?"}]


def _accepts(ebnf: str, text: str) -> bool:
    return bool(xgr.testing._is_grammar_accept_string(xgr.Grammar.from_ebnf(ebnf), text))


# ----------------------------------------------------------------- request building (no engine)


def test_tool_call_grammar_takes_the_native_format_with_schema_arguments_only() -> None:
    one = tool_calls_ebnf(TOOLS, one_call=True)
    many = tool_calls_ebnf(TOOLS, one_call=False)
    weather = render_tool_calls([ToolCall("c0", "get_weather", {"city": "Oslo", "celsius": True})])
    both = render_tool_calls([ToolCall("c0", "get_weather", {"city": "Paris", "celsius": False}),
                              ToolCall("c1", "get_time", {"zone": "UTC"})])
    assert _accepts(one, weather) and _accepts(many, weather) and _accepts(many, both)
    assert not _accepts(one, both)  # one call only
    assert not _accepts(many, "Sunny.")  # at least one call
    assert not _accepts(many, weather.replace("Oslo", "Rome"))  # arguments follow the schema
    assert not _accepts(many, weather.replace("get_weather", "get_news"))  # only the given tools
    named = tool_calls_ebnf([TOOLS[1]], one_call=True)
    assert _accepts(named, render_tool_calls([ToolCall("c0", "get_time", {"zone": "CET"})]))
    assert not _accepts(named, weather)


def test_json_grammar_follows_the_schema_and_json_object_any_object() -> None:
    schema = json_ebnf(ANSWER_SCHEMA)
    assert _accepts(schema, json.dumps({"answer": 7, "sure": True}))
    assert not _accepts(schema, json.dumps({"answer": 7}))
    assert not _accepts(schema, json.dumps({"answer": 7, "sure": True, "extra": 1}))
    anything = json_ebnf(None)
    assert _accepts(anything, json.dumps({"a": [1, "x", None]}))
    assert not _accepts(anything, "[1, 2]") and not _accepts(anything, "hello")


def _params() -> SimpleNamespace:
    return SimpleNamespace(temperature=1.0, top_p=1.0, top_k=-1, max_new_tokens=8, stop=[], stop_token_ids=[])


def test_the_engine_request_carries_the_grammar_as_sglang_ebnf_and_vllm_structured_outputs() -> None:
    params = _params()
    asyncio.run(constrain(params, TOOLS, choice="function", name="get_time"))
    assert params.constraint == {"ebnf": tool_calls_ebnf([TOOLS[1]], one_call=True)}
    sampler = TurnSampler(EngineClient("http://unused"), TorchEngineConfig(), stop_ids={7}, pause=PauseClock(),
                          context_len=None, loaded_version=lambda: 0)
    sent = sampler._sampling(params, 8, None, sampler.capabilities())
    # SGLang (and the torch engine): sampling_params.ebnf (sglang 0.4.10.post2 srt/sampling/sampling_params.py)
    assert sent["ebnf"] == params.constraint["ebnf"] and "json_schema" not in sent and "regex" not in sent
    vllm = vllm_sampling(sent)
    assert vllm["structured_outputs"] == {"grammar": params.constraint["ebnf"]} and "ebnf" not in vllm
    assert vllm_sampling({"json_schema": "{}"})["structured_outputs"] == {"json": "{}"}
    assert vllm_sampling({"regex": "a+"})["structured_outputs"] == {"regex": "a+"}
    with pytest.raises(ValueError, match="Only one"):
        vllm_sampling({"regex": "a+", "ebnf": "root ::= \"a\""})
    free = _params()
    asyncio.run(constrain(free, TOOLS, choice="auto"))
    assert not hasattr(free, "constraint") and "ebnf" not in sampler._sampling(free, 8, None, sampler.capabilities())


@pytest.mark.parametrize("choice, name, tools, output, match", [
    ("required", None, None, None, "needs tools"),
    ("function", "get_news", TOOLS, None, "not among the tools"),
    ("auto", None, None, ("json", {"type": "object", "properties": {"a": {"type": "nonsense"}}}), "nonsense"),
])
def test_a_constraint_that_cannot_be_honoured_is_a_400(choice: str, name: str | None, tools: Any, output: Any,
                                                        match: str) -> None:
    with pytest.raises(ApiError, match=match) as err:
        asyncio.run(constrain(_params(), tools, choice=choice, name=name, output=output, output_param="text.format"))
    assert err.value.status == 400
    assert err.value.param == ("text.format" if output else "tool_choice")


# ----------------------------------------------------------------- the torch engine, for real


class RecordingEngine(EngineClient):
    """The engine client, keeping (prompt, sampling, output ids, log-probs) of every /generate answer."""

    def __init__(self, url: str) -> None:
        super().__init__(url)
        self.records: list[tuple[list[int], dict[str, Any], list[int], list[float]]] = []
        self.cut_next: tuple[int, PauseClock] | None = None
        """(n, the rollout's pause clock): the next answer stops after n tokens and comes back
        aborted by a weight load (the clock paused and resumed meanwhile), as SGLang answers a
        request that a pause aborted."""

    async def generate(self, input_ids: Any, sampling: Any, return_logprob: bool = True) -> Any:
        cut, self.cut_next = self.cut_next, None
        if cut is None:
            res = await super().generate(input_ids, sampling, return_logprob)
        else:
            res = await super().generate(input_ids, {**sampling, "max_new_tokens": cut[0]}, return_logprob)
            cut[1].pause()
            cut[1].resume()
            res = dataclasses.replace(res, finish_reason={"type": "abort", "message": "generation paused"})
        self.records.append((list(input_ids), dict(sampling), list(res.output_ids), list(res.logprobs)))
        return res


class Harness:
    def __init__(self, root: Path) -> None:
        self.model = build_chatml_model(root / "model", TEXTS, hidden=64, layers=1, max_positions=1024, seed=3)
        self.tok = load_tokenizer(self.model)
        chat = ChatFormat.load(self.model)
        assert chat is not None
        port = free_port()
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "trajmesh.rollout.engines.engine_server", "--model", str(self.model), "--port", str(port),
             "--host", "127.0.0.1", "--version", "0", "--threads", "1"],
            stdout=subprocess.DEVNULL, stderr=open(root / "engine.log", "w"))  # noqa: SIM115
        self.engine = RecordingEngine(f"http://127.0.0.1:{port}")
        pause = PauseClock()
        sampler = TurnSampler(self.engine, TorchEngineConfig(request_timeout_s=300),
                              stop_ids=model_stop_ids(self.model, self.tok.eos_token_id), pause=pause,
                              context_len=1024, loaded_version=lambda: 0)
        self.ep = AgentEndpoint(self.tok, chat, sampler, pause, model_name="tiny", default_max_tokens=64)
        self.http = TestClient(create_app(self.ep))
        self.http.__enter__()
        asyncio.run(self._wait(root))

    async def _wait(self, root: Path) -> None:
        async with EngineClient(self.engine.base_url) as client:
            for _ in range(1200):
                assert self.proc.poll() is None, (root / "engine.log").read_text()
                if await client.health():
                    return
                await asyncio.sleep(0.1)
        raise AssertionError("engine not healthy")

    def openai(self, sid: str) -> Any:
        self.ep.open_session(sid)
        return openai.OpenAI(base_url=f"http://testserver/sessions/{sid}/v1", api_key="x", http_client=self.http)

    def stop(self) -> None:
        self.http.__exit__(None, None, None)
        os.kill(self.proc.pid, signal.SIGTERM)
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            os.kill(self.proc.pid, signal.SIGKILL)
            self.proc.wait()


@pytest.fixture(scope="module")
def h(tmp_path_factory: pytest.TempPathFactory) -> Any:
    harness = Harness(tmp_path_factory.mktemp("agent_constrained"))
    try:
        yield harness
    finally:
        harness.stop()


def _trajectory_outputs(h: Harness, sid: str) -> list[list[int]]:
    session = h.ep.close_session(sid)
    task = trajectory_pb2.Task(task_id=sid, group_id="g", source="external_agent", revision="r")
    (traj,) = session.trajectories(task, base_id=sid)
    ids = traj.token_ids_T.tolist()
    return [ids[s.token_start:s.token_end] for s in traj.pb.spans if s.action_type != 0 and
            all(m == 1 for m in traj.loss_mask_T.tolist()[s.token_start:s.token_end])]


def _masked_logprobs(h: Harness, prompt: list[int], output: list[int], ebnf: str) -> tuple[list[float], list[float]]:
    """(masked, unmasked) log_softmax of the sampled tokens, recomputed from the model and xgrammar."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(str(h.model)).float().eval()
    with torch.no_grad():
        logits = model(torch.tensor([prompt + output])).logits[0, len(prompt) - 1:-1].float()
    info = xgr.TokenizerInfo.from_huggingface(AutoTokenizer.from_pretrained(str(h.model)), vocab_size=logits.shape[1],
                                              stop_token_ids=sorted(model_stop_ids(h.model, h.tok.eos_token_id)))
    matcher = xgr.GrammarMatcher(xgr.GrammarCompiler(info).compile_grammar(ebnf))
    bitmask = xgr.allocate_token_bitmask(1, logits.shape[1])
    masked, unmasked = [], []
    for row, token in zip(logits, output, strict=True):
        unmasked.append(float(torch.log_softmax(row, -1)[token]))
        matcher.fill_next_token_bitmask(bitmask)
        m = row.clone().unsqueeze(0)
        xgr.apply_token_bitmask_inplace(m, bitmask)
        masked.append(float(torch.log_softmax(m[0], -1)[token]))
        assert matcher.accept_token(token)
    return masked, unmasked


def _chat(h: Harness, sid: str, **kw: Any) -> Any:
    return h.openai(sid).chat.completions.create(model="tiny", messages=MESSAGES, temperature=0, max_tokens=200,
                                                 **kw)


def test_required_tool_choice_answers_a_schema_valid_call_recorded_with_the_engines_tokens(h: Harness) -> None:
    free = _chat(h, "free", tools=TOOLS, tool_choice="auto")
    assert not free.choices[0].message.tool_calls  # the model alone writes no call
    _trajectory_outputs(h, "free")
    before = len(h.engine.records)
    resp = _chat(h, "req", tools=TOOLS, tool_choice="required")
    calls = resp.choices[0].message.tool_calls
    assert resp.choices[0].finish_reason == "tool_calls" and calls  # at least one (parallel calls allowed)
    for call in calls:
        fn = next(t["function"] for t in TOOLS if t["function"]["name"] == call.function.name)
        jsonschema.validate(json.loads(call.function.arguments), fn["parameters"])
    (prompt, sampling, out, logps), = h.engine.records[before:]
    assert sampling["ebnf"] == tool_calls_ebnf(TOOLS, one_call=False)
    assert _trajectory_outputs(h, "req") == [out]
    # the engine's log-probs are of the masked distribution (the one it sampled from)
    masked, unmasked = _masked_logprobs(h, prompt, out, sampling["ebnf"])
    assert max(abs(a - b) for a, b in zip(logps, masked, strict=True)) < 1e-4
    assert max(abs(a - b) for a, b in zip(logps, unmasked, strict=True)) > 1e-2


def test_a_named_tool_and_anthropic_tool_choice_call_that_tool(h: Harness) -> None:
    resp = _chat(h, "named", tools=TOOLS, tool_choice={"type": "function", "function": {"name": "get_time"}})
    (call,) = resp.choices[0].message.tool_calls or [None]
    assert call is not None and call.function.name == "get_time"
    jsonschema.validate(json.loads(call.function.arguments), TIME["parameters"])
    _trajectory_outputs(h, "named")
    h.ep.open_session("claude")
    client = anthropic.Anthropic(base_url="http://testserver/sessions/claude", api_key="x", http_client=h.http)
    tools = [{"name": t["function"]["name"], "description": "", "input_schema": t["function"]["parameters"]}
             for t in TOOLS]
    msg = client.messages.create(model="tiny", max_tokens=200, extra_body={"temperature": 0}, messages=MESSAGES, tools=tools,
                                 tool_choice={"type": "tool", "name": "get_weather"})
    (use,) = [b for b in msg.content if b.type == "tool_use"]
    assert msg.stop_reason == "tool_use" and use.name == "get_weather"
    jsonschema.validate(use.input, WEATHER["parameters"])
    _trajectory_outputs(h, "claude")


def test_response_format_json_schema_answers_json_of_the_schema(h: Harness) -> None:
    fmt = {"type": "json_schema", "json_schema": {"name": "answer", "schema": ANSWER_SCHEMA, "strict": True}}
    free = _chat(h, "jfree")
    with pytest.raises(ValueError):
        json.loads(free.choices[0].message.content or "")
    _trajectory_outputs(h, "jfree")
    before = len(h.engine.records)
    resp = _chat(h, "json", response_format=fmt)
    jsonschema.validate(json.loads(resp.choices[0].message.content), ANSWER_SCHEMA)
    (_, _, out, _), = h.engine.records[before:]
    assert _trajectory_outputs(h, "json") == [out]
    # the Responses API's text.format, the flat shape
    r = h.openai("resp").responses.create(model="tiny", input="What is 2+3?", temperature=0, max_output_tokens=200,
                                          text={"format": {"type": "json_schema", "name": "answer",
                                                           "schema": ANSWER_SCHEMA}})
    jsonschema.validate(json.loads(r.output_text), ANSWER_SCHEMA)
    _trajectory_outputs(h, "resp")
    assert parse_tool_calls(r.output_text)[1] == []


def test_a_constrained_turn_aborted_by_a_weight_load_is_generated_again_from_its_start(h: Harness) -> None:
    """The engine's grammar starts at its root on every request, so the sampler does not resubmit
    prompt + partial output (that would be matched as a fresh answer): it asks again from the prompt,
    and only the second answer is recorded."""
    before = len(h.engine.records)
    h.engine.cut_next = (5, h.ep.pause)
    resp = _chat(h, "cut", tools=TOOLS, tool_choice="required")
    assert resp.choices[0].message.tool_calls
    (p1, _, partial, _), (p2, _, out, _) = h.engine.records[before:]
    assert len(partial) == 5 and p2 == p1
    assert _trajectory_outputs(h, "cut") == [out]
