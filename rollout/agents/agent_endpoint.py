"""An OpenAI- and Anthropic-compatible endpoint that turns any agent's LLM calls into trajectories.

::

    agent (openai / anthropic SDK, base_url = http://rollout:PORT/sessions/<sid>/v1)
      │ POST /v1/chat/completions | /v1/completions | /v1/responses | /v1/messages, GET /v1/models
      ▼
    AgentEndpoint ── messages ─▶ chat template (chat_format) ─▶ prompt ids (AgentSession: the
      │                          tokens of earlier assistant turns are the engine's, not re-encoded)
      │ TurnSampler (the rollout's: pauses for weight loads, resubmits aborted requests)
      ▼
    engine /generate (token ids in, token ids + log-probs + versions out) ─▶ recorded in the session
      │
      ▼ the answer in the API's own shape; tool calls parsed from the model's native format
        (Hermes <tool_call>, trajmesh/tool_calls.py) into each API's tool-call objects

A session whose task comes with an environment (the ``external_agent`` source's workplace tasks)
also serves ``POST /sessions/{sid}/env/step``: the agent's actions on the environment the runner
hosts for it (``AgentSession.environment``), whose final state grades the run.

The session id travels in the base URL path (``/sessions/{sid}/v1/...``) so the official clients
work unchanged; ``/v1/...`` with an ``X-Trajmesh-Session`` header works too. Sessions are opened by
whoever runs the agent (``open_session``); a call to an unknown or closed session is a 404 in the
API's error shape. While weights load (``PauseClock`` not ready) new calls are refused with a
retryable 503 (Anthropic: 529 ``overloaded_error``) and ``Retry-After``, which both SDKs retry;
calls already generating wait for the load and continue under the new version; a refused attempt
is recorded as refused (``AgentSession.refuse``). A request an SDK retries
(``x-stainless-retry-count`` > 0) drops its previous attempt's completions when that attempt
generated them, and a completion whose caller hung up before the answer is dropped too (orphans,
never trained).

Stop strings go to the engine (``TurnSampler``); the token completing one is kept, as SGLang and
vLLM keep it, and a turn is cut there so the recorded tokens are the ones behind the text the agent
got. ``tool_choice: none`` and ``parallel_tool_calls: false`` are stop strings on the native
tool-call tags. ``tool_choice`` required / a named tool (Anthropic: ``any`` / ``tool``) and JSON
output formats (``response_format`` / ``text.format``: ``json_object``, ``json_schema``) are
constrained decoding: the endpoint builds an EBNF grammar (rollout/engines/grammar.py, xgrammar) — tool calls
in the model's native Hermes format with each tool's JSON-schema arguments, or JSON of the schema —
and sends it as SGLang's ``ebnf`` sampling param (vLLM: ``structured_outputs.grammar``; the torch
engine masks with xgrammar). The engines mask the logits, so the recorded log-probs are of the masked
distribution. A schema that does not convert answers 400, as do a prompt past the context
(``context_length_exceeded``) and a ``max_tokens`` above what fits; a ``model`` other than the
served one is 404 ``model_not_found``.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from trajmesh.rollout.agents.agent_session import AgentSession, Call, PromptPlan
from trajmesh.rollout.agents.chat_format import ChatFormat
from trajmesh.rollout.engines.generation import EngineFailed, PauseClock, Turn, TurnSampler
from trajmesh.rollout.engines.grammar import json_ebnf, tool_calls_ebnf
from trajmesh.tokenizer import TextTokenizer
from trajmesh.tool_calls import ToolCall, parse_tool_calls, render_tool_calls

SESSION_HEADER = "x-trajmesh-session"
RETRY_AFTER_S = 1


class ApiError(Exception):
    """A request the endpoint refuses; rendered in the calling API's error shape."""

    def __init__(self, status: int, message: str, kind: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.kind, self.param, self.code = status, message, kind, param, code


TOOL_CALL_OPEN, TOOL_CALL_CLOSE = "<tool_call>", "</tool_call>"
"""The model's native (Hermes) tool-call tags: stop strings that keep a turn to one call
(``parallel_tool_calls: false``) or to text (``tool_choice: none``)."""


@dataclass
class Sample:
    """One generated choice as the APIs report it."""

    turn: Turn
    text: str
    """Decoded output, special tokens and a matched stop string removed."""
    content: str
    calls: list[ToolCall]
    finish: str
    """stop | length | tool_calls | stop_sequence (which stop string matched: ``stop_string``)."""
    stop_string: str | None = None


def _error_body(api: str, err: ApiError) -> dict[str, Any]:
    if api == "messages":
        return {"type": "error", "error": {"type": err.kind, "message": err.message}}
    return {"error": {"message": err.message, "type": err.kind, "param": err.param, "code": err.code}}


def _require(cond: bool, message: str, param: str | None = None) -> None:
    if not cond:
        raise ApiError(400, message, param=param)


def _tool_schemas(tools: Any, api: str) -> list[dict[str, Any]] | None:
    """Tools as the chat template takes them (OpenAI chat shape: {type: function, function: {...}})."""
    if not tools:
        return None
    _require(isinstance(tools, list), "'tools' must be a list", "tools")
    out = []
    for t in tools:
        _require(isinstance(t, dict), "each tool must be an object", "tools")
        if api == "messages":
            fn = {"name": t.get("name"), "description": t.get("description", ""),
                  "parameters": t.get("input_schema", {})}
        elif api == "responses":
            fn = {k: t.get(k) for k in ("name", "description", "parameters") if t.get(k) is not None}
        else:
            fn = t.get("function") or {}
        _require(isinstance(fn.get("name"), str) and bool(fn.get("name")), "every tool needs a name", "tools")
        out.append({"type": "function", "function": fn})
    return out


def _text_of(content: Any) -> str:
    """Content that is a string or a list of text parts (any API's)."""
    if content is None or isinstance(content, str):
        return content or ""
    _require(isinstance(content, list), "message content must be a string or a list of parts", "messages")
    parts = []
    for part in content:
        _require(isinstance(part, dict), "content parts must be objects", "messages")
        if part.get("type") in ("text", "input_text", "output_text"):
            parts.append(str(part.get("text", "")))
        else:
            raise ApiError(400, f"content part type {part.get('type')!r} is not supported", param="messages")
    return "".join(parts)


def chat_messages(body: dict[str, Any]) -> list[dict[str, Any]]:
    """OpenAI chat messages, canonical: role, content text, tool_calls [{name, arguments}]."""
    msgs = body.get("messages")
    _require(isinstance(msgs, list) and bool(msgs), "'messages' must be a non-empty list", "messages")
    out = []
    for m in msgs or []:
        _require(isinstance(m, dict) and m.get("role") in ("system", "developer", "user", "assistant", "tool"),
                 "each message needs a role: system, developer, user, assistant or tool", "messages")
        role = "system" if m["role"] == "developer" else m["role"]
        msg: dict[str, Any] = {"role": role, "content": _text_of(m.get("content"))}
        if m.get("tool_calls"):
            msg["tool_calls"] = [_call_dict(c.get("function", {})) for c in m["tool_calls"]]
        out.append(msg)
    return out


def _call_dict(fn: dict[str, Any]) -> dict[str, Any]:
    args = fn.get("arguments", {})
    if isinstance(args, str):
        try:
            args = json.loads(args) if args.strip() else {}
        except ValueError:
            raise ApiError(400, "tool call arguments must be a JSON object", param="messages") from None
    return {"name": str(fn.get("name", "")), "arguments": args}


def responses_messages(body: dict[str, Any]) -> list[dict[str, Any]]:
    """The Responses API's instructions + input items as canonical chat messages."""
    out: list[dict[str, Any]] = []
    if body.get("instructions"):
        out.append({"role": "system", "content": str(body["instructions"])})
    items = body.get("input")
    if isinstance(items, str):
        return [*out, {"role": "user", "content": items}]
    _require(isinstance(items, list) and bool(items), "'input' must be a string or a non-empty list", "input")
    for item in items or []:
        _require(isinstance(item, dict), "input items must be objects", "input")
        kind = item.get("type", "message")
        if kind == "function_call":
            call = _call_dict(item)
            if out and out[-1]["role"] == "assistant":
                out[-1].setdefault("tool_calls", []).append(call)
            else:
                out.append({"role": "assistant", "content": "", "tool_calls": [call]})
        elif kind == "function_call_output":
            out.append({"role": "tool", "content": _text_of(item.get("output"))})
        elif kind == "message":
            role = item.get("role")
            _require(role in ("system", "developer", "user", "assistant"), f"bad input role {role!r}", "input")
            out.append({"role": "system" if role == "developer" else role, "content": _text_of(item.get("content"))})
        else:
            raise ApiError(400, f"input item type {kind!r} is not supported", param="input")
    return out


def anthropic_messages(body: dict[str, Any]) -> list[dict[str, Any]]:
    """Anthropic system + messages (text, tool_use, tool_result blocks) as canonical chat messages."""
    out: list[dict[str, Any]] = []
    if body.get("system"):
        out.append({"role": "system", "content": _text_of(body["system"])})
    msgs = body.get("messages")
    _require(isinstance(msgs, list) and bool(msgs), "messages: field required (a non-empty list)", "messages")
    for m in msgs or []:
        _require(isinstance(m, dict) and m.get("role") in ("user", "assistant"),
                 "messages: each message's role must be 'user' or 'assistant'", "messages")
        blocks = m.get("content")
        if isinstance(blocks, str):
            out.append({"role": m["role"], "content": blocks})
            continue
        _require(isinstance(blocks, list), "messages: content must be a string or a list of blocks", "messages")
        text, calls = [], []
        for b in blocks:
            kind = b.get("type") if isinstance(b, dict) else None
            if kind == "text":
                text.append(str(b.get("text", "")))
            elif kind == "tool_use":
                calls.append({"name": str(b.get("name", "")), "arguments": b.get("input") or {}})
            elif kind == "tool_result":
                out.append({"role": "tool", "content": _text_of(b.get("content"))})
            else:
                raise ApiError(400, f"messages: content block type {kind!r} is not supported")
        if text or calls or m["role"] == "assistant":
            msg: dict[str, Any] = {"role": m["role"], "content": "".join(text)}
            if calls:
                msg["tool_calls"] = calls
            out.append(msg)
    return out


def template_renders_tools(chat: ChatFormat) -> bool:
    """Whether the chat template writes a ``tools`` list into the prompt itself."""
    probe = [{"type": "function", "function": {"name": "\x00probe\x00", "parameters": {}}}]
    msgs = [{"role": "user", "content": "x"}]
    return "\x00probe\x00" in chat.template.render(messages=msgs, tools=probe, add_generation_prompt=True,
                                                   **chat.special)


def render_messages(chat: ChatFormat, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None, gen: bool,
                    *, renders_tools: bool | None = None) -> str:
    """The chat template's text for canonical messages, as the endpoint prompts the model. Tool calls
    are written in the model's native format inside the assistant content; a template that does not
    render tools (`template_renders_tools`, or `renders_tools` when the caller knows) gets them in a
    Hermes-style system block."""
    if renders_tools is None:
        renders_tools = template_renders_tools(chat)
    msgs = [_native(m) for m in messages]
    if tools and not renders_tools:
        block = "\n".join(json.dumps(t["function"], ensure_ascii=False) for t in tools)
        note = ("# Tools\n\nYou may call functions. Signatures:\n<tools>\n" + block + "\n</tools>\n"
                'Call one as <tool_call>\n{"name": <name>, "arguments": <object>}\n</tool_call>')
        if msgs and msgs[0]["role"] == "system":
            msgs[0] = {**msgs[0], "content": msgs[0]["content"] + "\n\n" + note}
        else:
            msgs.insert(0, {"role": "system", "content": note})
    kwargs = {"tools": tools} if renders_tools else {"tools": None}
    return str(chat.template.render(messages=msgs, add_generation_prompt=gen, **kwargs, **chat.special))


def _native(m: dict[str, Any]) -> dict[str, Any]:
    if not m.get("tool_calls"):
        return {"role": m["role"], "content": m["content"]}
    calls = [ToolCall(f"call_{i}", c["name"], c["arguments"]) for i, c in enumerate(m["tool_calls"])]
    sep = "\n" if m["content"] else ""
    return {"role": m["role"], "content": m["content"] + sep + render_tool_calls(calls)}


class AgentEndpoint:
    """Sessions, prompt building and generation behind the HTTP routes (``create_app``)."""

    def __init__(self, tokenizer: TextTokenizer, chat: ChatFormat | None, sampler: TurnSampler,
                 pause: PauseClock, *, model_name: str = "trajmesh-policy", default_max_tokens: int = 256,
                 api_key: str | None = None) -> None:
        self.tokenizer = tokenizer
        self.chat = chat
        self.sampler = sampler
        self.pause = pause
        """Not ready while weights load: new calls are answered retryable (503 / 529)."""
        self.model_name = model_name
        self.default_max_tokens = default_max_tokens
        self.api_key = api_key
        """When set, calls must carry it (``Authorization: Bearer`` or ``x-api-key``)."""
        turn_end = chat.turn_end() if chat is not None else ""
        self.turn_end_id = tokenizer.tokenizer.token_to_id(turn_end) if turn_end else None
        self.sessions: dict[str, AgentSession] = {}
        self.orphans_dropped = 0
        """Completions dropped because the agent never received them."""
        self.retryable_answers = 0
        """Calls refused with a retryable 503 / 529 while weights loaded."""
        self._renders_tools = chat is not None and template_renders_tools(chat)

    # ----------------------------------------------------------------- sessions

    def open_session(self, session_id: str | None = None, *, forced: Any = None) -> AgentSession:
        """A new session; `forced`: a held-out evaluation's `SamplingParams` (`AgentSession.forced`)."""
        sid = session_id or uuid.uuid4().hex
        if sid in self.sessions:
            raise ValueError(f"session {sid} is already open")
        session = self.sessions[sid] = AgentSession(sid, self.tokenizer, self.chat, self.turn_end_id)
        session.forced = forced
        return session

    def close_session(self, session_id: str) -> AgentSession:
        """Stops taking calls for the session and hands it over (its calls stay recorded)."""
        session = self.sessions.pop(session_id)
        session.closed = True
        return session

    def session(self, session_id: str | None) -> AgentSession:
        session = self.sessions.get(session_id or "")
        if session is None or session.closed:
            raise ApiError(404, f"no open session {session_id!r}: open one with the run's runner",
                           kind="not_found_error")
        return session

    # ----------------------------------------------------------------- rendering

    def render(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None, gen: bool) -> str:
        """The chat template's text for canonical messages (`render_messages`)."""
        if self.chat is None:
            raise ApiError(400, "the model has no chat template: use /v1/completions")
        return render_messages(self.chat, messages, tools, gen, renders_tools=self._renders_tools)

    # ----------------------------------------------------------------- generation

    def sampling(self, body: dict[str, Any], *, max_key: str, stop_key: str = "stop") -> SimpleNamespace:
        """temperature, top_p, max tokens, stop strings and stop token ids (vLLM's ``stop_token_ids``
        extension) of a request, validated. ``stop`` is what the engine stops on: the request's
        strings (``user_stop``) and those a tool policy adds (``keep_stop``: text kept through them)."""
        temperature = body.get("temperature", 1.0)
        top_p = body.get("top_p", 1.0)
        asked = body.get(max_key) or body.get("max_completion_tokens")
        max_tokens = asked or self.default_max_tokens
        _require(isinstance(temperature, (int, float)) and 0 <= temperature <= 2,
                 "temperature must be a number in [0, 2]", "temperature")
        _require(isinstance(top_p, (int, float)) and 0 < top_p <= 1, "top_p must be in (0, 1]", "top_p")
        _require(isinstance(max_tokens, int) and max_tokens >= 1, f"{max_key} must be a positive integer", max_key)
        stop = body.get(stop_key) or []
        stop = [stop] if isinstance(stop, str) else stop
        _require(isinstance(stop, list) and all(isinstance(s, str) and s for s in stop),
                 f"{stop_key} must be a string or a list of strings", stop_key)
        stop_ids = body.get("stop_token_ids") or []
        _require(isinstance(stop_ids, list) and all(isinstance(t, int) and t >= 0 for t in stop_ids),
                 "stop_token_ids must be a list of token ids", "stop_token_ids")
        return SimpleNamespace(temperature=float(temperature), top_p=float(top_p), top_k=-1,
                               max_new_tokens=max_tokens, max_key=max_key, max_asked=asked is not None,
                               stop=list(stop), user_stop=list(stop), keep_stop=[], stop_token_ids=list(stop_ids))

    def fit_context(self, api: str, prompt_len: int, params: SimpleNamespace) -> None:
        """Refuses a prompt the engine's context cannot take (400 ``context_length_exceeded``) and a
        ``max_tokens`` above what fits beside it; a budget the request did not name is capped."""
        caps = self.sampler.capabilities()
        room = caps.room(prompt_len)
        if room is None:
            return
        limit = caps.context_len if caps.context_len is not None else caps.max_input_len
        if room <= 0:
            longest = min(n for n in (caps.context_len and caps.context_len - 2,
                                      caps.max_input_len and caps.max_input_len - 1) if n is not None)
            raise ApiError(400, f"prompt is too long: {prompt_len} tokens > {longest} maximum"
                           if api == "messages" else
                           f"This model's maximum context length is {limit} tokens. However, your "
                           f"{'prompt' if api == 'completions' else 'messages'} resulted in {prompt_len} "
                           "tokens. Please reduce the length of the messages.",
                           param="prompt" if api == "completions" else "input" if api == "responses" else "messages",
                           code="context_length_exceeded")
        if params.max_new_tokens <= room:
            return
        if not params.max_asked:
            params.max_new_tokens = room
            return
        asked = params.max_new_tokens
        raise ApiError(400, f"input length and `max_tokens` exceed context limit: {prompt_len} + {asked} > "
                       f"{prompt_len + room}, decrease input length or `max_tokens` and try again"
                       if api == "messages" else
                       f"This model's maximum context length is {limit} tokens. However, you requested "
                       f"{prompt_len + asked} tokens ({prompt_len} in the messages, {asked} in the completion). "
                       "Please reduce the length of the messages or completion.",
                       param=params.max_key, code="context_length_exceeded")

    async def generate(self, session: AgentSession, api: str, plan: PromptPlan, params: SimpleNamespace, n: int,
                       request: Request) -> tuple[Call, list[Sample]]:
        """Samples `n` choices for one call, records them, drops them if the caller hung up."""
        if session.forced is not None:  # a held-out episode: the evaluation's sampling, not the agent's
            f = session.forced
            params.temperature, params.top_p = float(f.temperature), float(f.top_p) or 1.0
            if f.max_new_tokens > 0 and params.max_new_tokens > f.max_new_tokens:
                params.max_new_tokens, params.max_asked = int(f.max_new_tokens), False
        self.fit_context(api, len(plan.prompt_ids), params)
        fingerprint = request_fingerprint(api, await request.body())
        if int(request.headers.get("x-stainless-retry-count", "0") or 0) > 0:
            self.orphans_dropped += session.drop_retried(fingerprint)
        call = session.begin(api, plan, fingerprint)
        try:
            turns = await asyncio.gather(*(self.sampler.sample(plan.prompt_ids, params) for _ in range(n)))
        except EngineFailed as exc:
            call.finished = time.time()
            raise ApiError(503, f"the engine failed: {exc}", kind="api_error") from None
        call.finished = time.time()
        samples = []
        for turn in turns:
            sample = self._sample(turn, params)
            session.add_completion(call, sample.turn.ids, sample.turn.logps, sample.turn.versions)
            samples.append(sample)
        if await request.is_disconnected():
            self.orphans_dropped += session.drop(call)
        return call, samples

    def _cut_at_stop(self, turn: Turn, stops: list[str]) -> Turn:
        """The turn up to the token that completes its first stop string (kept, as SGLang and vLLM keep
        it): the engine stops there, but a stop string spanning a resubmission after a weight load,
        or an engine that ignored it, leaves tokens after it that the agent never receives."""
        ids = turn.ids
        if not stops or _first_stop(self.tokenizer.decode(ids), stops) is None:
            return turn
        lo, hi = 1, len(ids)  # the shortest prefix whose text holds a stop string
        while lo < hi:
            mid = (lo + hi) // 2
            if _first_stop(self.tokenizer.decode(ids[:mid]), stops) is not None:
                hi = mid
            else:
                lo = mid + 1
        if hi == len(ids):
            return turn
        return Turn(ids[:hi], turn.logps[:hi], turn.versions[:hi], "stop")

    def _sample(self, turn: Turn, params: SimpleNamespace) -> Sample:
        turn = self._cut_at_stop(turn, params.stop)
        text = self.tokenizer.decode(turn.ids)
        hit = _first_stop(text, params.stop)
        matched = None
        if hit is not None:
            pos, stop = hit
            text = text[:pos + len(stop)] if stop in params.keep_stop else text[:pos]
            matched = stop if stop in params.user_stop else None
        content, calls = parse_tool_calls(text)
        finish = ("tool_calls" if calls else "length" if turn.finish == "length" else
                  "stop_sequence" if matched is not None else "stop")
        return Sample(turn, text, content if calls else text, calls, finish, matched)

    def logprobs_content(self, turn: Turn) -> list[dict[str, Any]]:
        out = []
        for tid, lp in zip(turn.ids, turn.logps, strict=True):
            tok = self.tokenizer.tokenizer.decode([tid], skip_special_tokens=False)
            out.append({"token": tok, "logprob": lp, "bytes": list(tok.encode()), "top_logprobs": []})
        return out


# --------------------------------------------------------------------- the HTTP routes


def request_fingerprint(api: str, raw: bytes) -> str:
    """A request's identity for SDK retries: the API and its body bytes (a retry resends them)."""
    return hashlib.sha256(api.encode() + raw).hexdigest()


def _first_stop(text: str, stops: list[str]) -> tuple[int, str] | None:
    """The earliest stop string in `text` (position, string); None: none occurs."""
    hits = [(text.find(s), -len(s), s) for s in stops if s in text]
    if not hits:
        return None
    pos, _, stop = min(hits)
    return pos, stop


def tool_policy(params: SimpleNamespace, *, choice: str, one_call: bool) -> None:
    """Honours a tool choice through stop strings on the model's native tool-call tags: ``none``
    stops before a call begins (the text before it is the answer), ``one_call`` (no parallel tool
    calls) stops after the first call closes. `choice` is auto | none | required | function (the
    last two are constrained too: `constrain`)."""
    if choice == "none":
        params.stop.append(TOOL_CALL_OPEN)
    if one_call:
        params.stop.append(TOOL_CALL_CLOSE)
        params.keep_stop.append(TOOL_CALL_CLOSE)


def _openai_tool_choice(body: dict[str, Any], api: str) -> tuple[str, str | None]:
    """(auto | none | required | function, the named function) of the OpenAI APIs' ``tool_choice``
    (chat: ``{"type": "function", "function": {"name"}}``; Responses: ``{"type": "function", "name"}``)."""
    choice = body.get("tool_choice")
    if choice is None or choice in ("auto", "none", "required"):
        return choice or "auto", None
    if isinstance(choice, dict) and choice.get("type") == "function":
        name = (choice.get("function") or {}).get("name") if api == "chat" else choice.get("name")
        _require(isinstance(name, str) and bool(name), "tool_choice names no function", "tool_choice")
        return "function", name
    raise ApiError(400, f"tool_choice {choice!r} is not one of auto, none, required or a function",
                   param="tool_choice")


def _openai_output_format(fmt: Any, param: str, api: str) -> tuple[str, dict[str, Any] | None] | None:
    """``response_format`` (chat: ``{"type": "json_schema", "json_schema": {"name", "schema"}}``) /
    ``text.format`` (Responses: ``{"type": "json_schema", "name", "schema"}``): None for text, else
    ("json", the schema; None for ``json_object``)."""
    if fmt is None or (isinstance(fmt, dict) and fmt.get("type", "text") == "text"):
        return None
    _require(isinstance(fmt, dict) and fmt.get("type") in ("json_object", "json_schema"),
             f"{param}.type must be text, json_object or json_schema", param)
    if fmt["type"] == "json_object":
        return "json", None
    schema = (fmt.get("json_schema") or {}).get("schema") if api == "chat" else fmt.get("schema")
    _require(isinstance(schema, dict), f"{param} of type json_schema needs a schema object", param)
    return "json", schema


async def constrain(params: SimpleNamespace, tools: list[dict[str, Any]] | None, *, choice: str,
                    name: str | None = None, one_call: bool = False,
                    output: tuple[str, dict[str, Any] | None] | None = None,
                    output_param: str = "response_format") -> None:
    """Sets ``params.constraint`` (SGLang's ``ebnf`` sampling param) when the request needs
    constrained decoding: tool choice ``required`` (at least one call of the given tools; one when
    `one_call`) or ``function`` (one call of `name`) in the model's native tool-call format, else
    an output format's JSON (schema). A 400 when it cannot be honoured (no such tool, a schema
    xgrammar does not convert)."""
    try:
        if choice in ("required", "function"):
            _require(bool(tools), f"tool_choice {choice!r} needs tools", "tool_choice")
            assert tools is not None
            chosen = tools if choice == "required" else [t for t in tools if t["function"]["name"] == name]
            _require(bool(chosen), f"tool_choice names {name!r}, which is not among the tools", "tool_choice")
            ebnf = await asyncio.to_thread(tool_calls_ebnf, chosen, one_call=one_call or choice == "function")
        elif output is not None:
            ebnf = await asyncio.to_thread(json_ebnf, output[1])
        else:
            return
    except ValueError as exc:
        raise ApiError(400, f"constrained decoding: {exc}",
                       param="tool_choice" if choice in ("required", "function") else output_param) from None
    params.constraint = {"ebnf": ebnf}


def _usage(call: Call, samples: list[Sample]) -> tuple[int, int]:
    return len(call.prompt_ids), sum(len(s.turn.ids) for s in samples)


def _openai_tool_calls(calls: list[ToolCall], call: Call, choice: int) -> list[dict[str, Any]]:
    return [{"id": f"call_{call.index}_{choice}_{i}", "type": "function",
             "function": {"name": c.name, "arguments": json.dumps(c.arguments, ensure_ascii=False)}}
            for i, c in enumerate(calls)]


def _returned(sample: Sample) -> dict[str, Any]:
    """The assistant message an agent will resend for `sample` (canonical form)."""
    msg: dict[str, Any] = {"role": "assistant", "content": sample.content}
    if sample.calls:
        msg["tool_calls"] = [{"name": c.name, "arguments": c.arguments} for c in sample.calls]
    return msg


async def chat_completions(ep: AgentEndpoint, session: AgentSession, body: dict[str, Any],
                           request: Request) -> dict[str, Any]:
    messages, tools = chat_messages(body), _tool_schemas(body.get("tools"), "chat")
    n = body.get("n") or 1
    _require(isinstance(n, int) and 1 <= n <= 16, "n must be an integer in [1, 16]", "n")
    params = ep.sampling(body, max_key="max_tokens")
    output = _openai_output_format(body.get("response_format"), "response_format", "chat")
    choice, name = _openai_tool_choice(body, "chat")
    one_call = body.get("parallel_tool_calls") is False
    tool_policy(params, choice=choice, one_call=one_call)
    await constrain(params, tools, choice=choice, name=name, one_call=one_call, output=output)
    plan = session.chat_prompt(messages, tools, lambda m, gen: ep.render(m, tools, gen))
    call, samples = await ep.generate(session, "chat", plan, params, n, request)
    choices = []
    for i, (s, comp) in enumerate(zip(samples, call.completions, strict=True)):
        session.remember_chat(comp, messages, tools, _returned(s))
        msg: dict[str, Any] = {"role": "assistant", "content": s.content or (None if s.calls else "")}
        if s.calls:
            msg["tool_calls"] = _openai_tool_calls(s.calls, call, i)
        choices.append({"index": i, "message": msg, "finish_reason": "stop" if s.finish == "stop_sequence" else s.finish,
                        "logprobs": {"content": ep.logprobs_content(s.turn)} if body.get("logprobs") else None})
    prompt, completion = _usage(call, samples)
    return {"id": f"chatcmpl-{session.session_id}-{call.index}", "object": "chat.completion",
            "created": int(call.started), "model": ep.model_name, "choices": choices,
            "usage": {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}}


async def completions(ep: AgentEndpoint, session: AgentSession, body: dict[str, Any],
                      request: Request) -> dict[str, Any]:
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1:
        prompt = prompt[0]
    _require(isinstance(prompt, str) and bool(prompt), "prompt must be one non-empty string", "prompt")
    n = body.get("n") or 1
    _require(isinstance(n, int) and 1 <= n <= 16, "n must be an integer in [1, 16]", "n")
    params = ep.sampling(body, max_key="max_tokens")
    call, samples = await ep.generate(session, "completions", session.text_prompt(prompt), params, n, request)
    choices = []
    for i, (s, comp) in enumerate(zip(samples, call.completions, strict=True)):
        session.remember_text(comp, prompt, s.text)
        lp = None
        if body.get("logprobs") is not None:
            content = ep.logprobs_content(s.turn)
            lp = {"tokens": [t["token"] for t in content], "token_logprobs": [t["logprob"] for t in content],
                  "top_logprobs": None, "text_offset": []}
        choices.append({"index": i, "text": s.text, "logprobs": lp,
                        "finish_reason": "length" if s.finish == "length" else "stop"})
    p, c = _usage(call, samples)
    return {"id": f"cmpl-{session.session_id}-{call.index}", "object": "text_completion", "created": int(call.started),
            "model": ep.model_name, "choices": choices,
            "usage": {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c}}


async def responses(ep: AgentEndpoint, session: AgentSession, body: dict[str, Any],
                    request: Request) -> dict[str, Any]:
    _require(not body.get("previous_response_id"), "previous_response_id is not supported: send the whole "
             "conversation in input", "previous_response_id")
    messages, tools = responses_messages(body), _tool_schemas(body.get("tools"), "responses")
    params = ep.sampling(body, max_key="max_output_tokens")
    fmt = _openai_output_format((body.get("text") or {}).get("format"), "text.format", "responses")
    choice, name = _openai_tool_choice(body, "responses")
    one_call = body.get("parallel_tool_calls") is False
    tool_policy(params, choice=choice, one_call=one_call)
    await constrain(params, tools, choice=choice, name=name, one_call=one_call, output=fmt,
                    output_param="text.format")
    plan = session.chat_prompt(messages, tools, lambda m, gen: ep.render(m, tools, gen))
    call, (s,) = await ep.generate(session, "responses", plan, params, 1, request)
    session.remember_chat(call.completions[0], messages, tools, _returned(s))
    rid = f"resp_{session.session_id}_{call.index}"
    output: list[dict[str, Any]] = []
    if s.content or not s.calls:
        output.append({"type": "message", "id": f"msg_{rid}", "status": "completed", "role": "assistant",
                       "content": [{"type": "output_text", "text": s.content, "annotations": []}]})
    for i, c in enumerate(_openai_tool_calls(s.calls, call, 0)):
        output.append({"type": "function_call", "id": f"fc_{rid}_{i}", "call_id": c["id"], "status": "completed",
                       "name": c["function"]["name"], "arguments": c["function"]["arguments"]})
    p, n = _usage(call, [s])
    return {"id": rid, "object": "response", "created_at": int(call.started), "model": ep.model_name,
            "status": "incomplete" if s.finish == "length" else "completed",
            "incomplete_details": {"reason": "max_output_tokens"} if s.finish == "length" else None,
            "output": output, "parallel_tool_calls": body.get("parallel_tool_calls") is not False,
            "tool_choice": body.get("tool_choice") or "auto", "tools": body.get("tools") or [],
            "usage": {"input_tokens": p, "output_tokens": n, "total_tokens": p + n,
                      "input_tokens_details": {"cached_tokens": 0}, "output_tokens_details": {"reasoning_tokens": 0}}}


async def messages(ep: AgentEndpoint, session: AgentSession, body: dict[str, Any], request: Request) -> dict[str, Any]:
    _require(isinstance(body.get("max_tokens"), int), "max_tokens: field required", "max_tokens")
    msgs, tools = anthropic_messages(body), _tool_schemas(body.get("tools"), "messages")
    params = ep.sampling(body, max_key="max_tokens", stop_key="stop_sequences")
    choice = body.get("tool_choice") or {"type": "auto"}
    _require(isinstance(choice, dict) and choice.get("type") in ("auto", "any", "tool", "none"),
             "tool_choice.type must be auto, any, tool or none", "tool_choice")
    kind = {"any": "required", "tool": "function"}.get(choice["type"], choice["type"])
    _require(kind != "function" or isinstance(choice.get("name"), str), "tool_choice.name: field required",
             "tool_choice")
    one_call = bool(choice.get("disable_parallel_tool_use"))
    tool_policy(params, choice=kind, one_call=one_call)
    await constrain(params, tools, choice=kind, name=choice.get("name"), one_call=one_call)
    plan = session.chat_prompt(msgs, tools, lambda m, gen: ep.render(m, tools, gen))
    call, (s,) = await ep.generate(session, "messages", plan, params, 1, request)
    session.remember_chat(call.completions[0], msgs, tools, _returned(s))
    content: list[dict[str, Any]] = [{"type": "text", "text": s.content}] if s.content or not s.calls else []
    content += [{"type": "tool_use", "id": f"toolu_{session.session_id}_{call.index}_{i}", "name": c.name,
                 "input": c.arguments} for i, c in enumerate(s.calls)]
    stop = {"tool_calls": "tool_use", "length": "max_tokens", "stop": "end_turn"}.get(s.finish, s.finish)
    p, n = _usage(call, [s])
    return {"id": f"msg_{session.session_id}_{call.index}", "type": "message", "role": "assistant",
            "model": ep.model_name, "content": content, "stop_reason": stop, "stop_sequence": s.stop_string,
            "usage": {"input_tokens": p, "output_tokens": n}}


def _sse(data: Any, event: str | None = None) -> str:
    head = f"event: {event}\n" if event else ""
    return f"{head}data: {data if isinstance(data, str) else json.dumps(data, ensure_ascii=False)}\n\n"


def chat_stream(resp: dict[str, Any], include_usage: bool) -> list[str]:
    """A finished chat completion as Server-Sent Events chunks (generated first, then sent: the
    stream carries the whole answer in one delta per choice)."""
    head = {k: resp[k] for k in ("id", "created", "model")} | {"object": "chat.completion.chunk"}
    out = []
    for c in resp["choices"]:
        msg = c["message"]
        delta: dict[str, Any] = {"role": "assistant", "content": msg.get("content")}
        if msg.get("tool_calls"):
            delta["tool_calls"] = [{"index": k, **tc} for k, tc in enumerate(msg["tool_calls"])]
        out.append(_sse({**head, "choices": [{"index": c["index"], "delta": delta, "logprobs": c["logprobs"],
                                              "finish_reason": None}]}))
        out.append(_sse({**head, "choices": [{"index": c["index"], "delta": {}, "logprobs": None,
                                              "finish_reason": c["finish_reason"]}]}))
    if include_usage:
        out.append(_sse({**head, "choices": [], "usage": resp["usage"]}))
    return [*out, _sse("[DONE]")]


def messages_stream(resp: dict[str, Any], include_usage: bool) -> list[str]:
    """A finished Anthropic message as its streaming events (one delta per content block)."""
    start = {**resp, "content": [], "stop_reason": None, "stop_sequence": None,
             "usage": {"input_tokens": resp["usage"]["input_tokens"], "output_tokens": 0}}
    out = [_sse({"type": "message_start", "message": start}, "message_start")]
    for i, block in enumerate(resp["content"]):
        first: dict[str, Any]
        if block["type"] == "text":
            first, delta = {"type": "text", "text": ""}, {"type": "text_delta", "text": block["text"]}
        else:
            first = {**block, "input": {}}
            delta = {"type": "input_json_delta", "partial_json": json.dumps(block["input"], ensure_ascii=False)}
        out.append(_sse({"type": "content_block_start", "index": i, "content_block": first}, "content_block_start"))
        out.append(_sse({"type": "content_block_delta", "index": i, "delta": delta}, "content_block_delta"))
        out.append(_sse({"type": "content_block_stop", "index": i}, "content_block_stop"))
    out.append(_sse({"type": "message_delta", "delta": {"stop_reason": resp["stop_reason"],
                                                        "stop_sequence": resp["stop_sequence"]},
                     "usage": {"output_tokens": resp["usage"]["output_tokens"]}}, "message_delta"))
    return [*out, _sse({"type": "message_stop"}, "message_stop")]


def responses_stream(resp: dict[str, Any], include_usage: bool) -> list[str]:
    """A finished Responses answer as the API's streaming events: ``response.created``, per output
    item its ``added`` / delta / ``done`` events (text parts; function-call arguments), then
    ``response.completed`` (``response.incomplete`` when the budget ran out) with the whole response."""
    events: list[dict[str, Any]] = []
    pending = {**resp, "status": "in_progress", "output": [], "incomplete_details": None}
    events += [{"type": "response.created", "response": pending},
               {"type": "response.in_progress", "response": pending}]
    for i, item in enumerate(resp["output"]):
        at = {"item_id": item["id"], "output_index": i}
        if item["type"] == "message":
            events.append({"type": "response.output_item.added", "output_index": i,
                           "item": {**item, "status": "in_progress", "content": []}})
            for k, part in enumerate(item["content"]):
                events += [{"type": "response.content_part.added", **at, "content_index": k,
                            "part": {**part, "text": ""}},
                           {"type": "response.output_text.delta", **at, "content_index": k, "delta": part["text"],
                            "logprobs": []},
                           {"type": "response.output_text.done", **at, "content_index": k, "text": part["text"],
                            "logprobs": []},
                           {"type": "response.content_part.done", **at, "content_index": k, "part": part}]
        else:
            events += [{"type": "response.output_item.added", "output_index": i,
                        "item": {**item, "status": "in_progress", "arguments": ""}},
                       {"type": "response.function_call_arguments.delta", **at, "delta": item["arguments"]},
                       {"type": "response.function_call_arguments.done", **at, "name": item["name"],
                        "arguments": item["arguments"]}]
        events.append({"type": "response.output_item.done", "output_index": i, "item": item})
    events.append({"type": "response.incomplete" if resp["status"] == "incomplete" else "response.completed",
                   "response": resp})
    return [_sse({**e, "sequence_number": n}, e["type"]) for n, e in enumerate(events)]


STREAMED = {"chat": chat_stream, "messages": messages_stream, "responses": responses_stream}
"""APIs that take ``stream: true`` (the answer is generated, then sent as events)."""

HANDLERS = {"chat/completions": ("chat", chat_completions), "completions": ("completions", completions),
            "responses": ("responses", responses), "messages": ("messages", messages)}


def _retryable(ep: AgentEndpoint, api: str) -> JSONResponse:
    """The answer to a call that arrives while weights load (the caller records it as refused)."""
    ep.retryable_answers += 1
    err = ApiError(529 if api == "messages" else 503, "weights are loading; retry shortly",
                   kind="overloaded_error" if api == "messages" else "server_error")
    return JSONResponse(_error_body(api, err), status_code=err.status, headers={"Retry-After": str(RETRY_AFTER_S)})


def _check_model(ep: AgentEndpoint, api: str, body: dict[str, Any]) -> None:
    """The request names the served model (``ep.model_name``); another name is a 404 ``model_not_found``."""
    model = body.get("model")
    _require(isinstance(model, str) and bool(model), "model: field required (the served model's name)", "model")
    if model != ep.model_name:
        if api == "messages":
            raise ApiError(404, f"model: {model} (this endpoint serves {ep.model_name!r})", kind="not_found_error")
        raise ApiError(404, f"The model `{model}` does not exist or you do not have access to it (this endpoint "
                       f"serves `{ep.model_name}`).", code="model_not_found")


def _authorized(ep: AgentEndpoint, request: Request) -> bool:
    if ep.api_key is None:
        return True
    bearer = request.headers.get("authorization", "")
    return bearer == f"Bearer {ep.api_key}" or request.headers.get("x-api-key") == ep.api_key


async def _dispatch(ep: AgentEndpoint, path: str, sid: str | None, request: Request) -> Response:
    api, handler = HANDLERS[path]
    try:
        if not _authorized(ep, request):
            raise ApiError(401, "invalid API key", kind="authentication_error")
        session = ep.session(sid or request.headers.get(SESSION_HEADER))
        raw = await request.body()
        try:
            body = json.loads(raw)
        except ValueError:
            raise ApiError(400, "the body is not valid JSON") from None
        _require(isinstance(body, dict), "the body must be a JSON object")
        _check_model(ep, api, body)
        if not ep.pause.ready.is_set():
            session.refuse(request_fingerprint(api, raw))
            return _retryable(ep, api)
        _require(not body.get("stream") or api in STREAMED, f"stream is not supported on {path}", "stream")
        result = await handler(ep, session, body, request)
        if body.get("stream"):
            events = STREAMED[api](result, bool((body.get("stream_options") or {}).get("include_usage")))
            return StreamingResponse(iter(events), media_type="text/event-stream")
        return JSONResponse(result)
    except ApiError as err:
        return JSONResponse(_error_body(api, err), status_code=err.status)


async def env_step(ep: AgentEndpoint, session: AgentSession, body: Any) -> dict[str, Any]:
    """One action on the session's hosted environment: ``{"tool_call": {"name", "arguments"}}``
    (written in the model's native tool-call format, as the environment reads a model's turn) or
    ``{"action": text}``. Answers the observation, whether the episode is over and the state hash."""
    hosted = session.environment
    _require(hosted is not None, "this session has no hosted environment (its task is graded by the agent's "
             "answer)")
    assert hosted is not None
    _require(not hosted.done, "the environment's episode is over")
    _require(isinstance(body, dict), "the body must be a JSON object")
    if body.get("tool_call") is not None:
        call = body["tool_call"]
        _require(isinstance(call, dict) and isinstance(call.get("name"), str) and bool(call["name"]),
                 "tool_call needs a name", "tool_call")
        action = render_tool_calls([ToolCall("call_0", call["name"], _call_dict(call)["arguments"])])
    else:
        action = body.get("action")
        _require(isinstance(action, str), "give 'tool_call' {name, arguments} or 'action' (text)", "action")
    try:
        observation, done, state_hash = await hosted.step(action)
    except Exception as exc:  # the environment service failed (recorded on `hosted`): the agent may retry
        if not hosted.failed:
            raise
        raise ApiError(503, f"the environment is unavailable: {hosted.failed}", kind="overloaded_error") from exc
    return {"observation": observation, "done": done, "state_hash": state_hash, "step": hosted.steps}


def create_app(ep: AgentEndpoint) -> FastAPI:
    """The FastAPI app: every API under ``/sessions/{sid}/v1/`` and under ``/v1/`` (session header)."""
    app = FastAPI(title="trajmesh agent endpoint", docs_url=None, redoc_url=None, openapi_url=None)

    def bind(path: str) -> None:
        async def with_sid(sid: str, request: Request) -> Response:
            return await _dispatch(ep, path, sid, request)

        async def with_header(request: Request) -> Response:
            return await _dispatch(ep, path, None, request)

        app.add_api_route(f"/sessions/{{sid}}/v1/{path}", with_sid, methods=["POST"])
        app.add_api_route(f"/v1/{path}", with_header, methods=["POST"])

    for path in HANDLERS:
        bind(path)

    async def environment_step(sid: str, request: Request) -> Response:
        try:
            if not _authorized(ep, request):
                raise ApiError(401, "invalid API key", kind="authentication_error")
            session = ep.session(sid)
            try:
                body = json.loads(await request.body())
            except ValueError:
                raise ApiError(400, "the body is not valid JSON") from None
            return JSONResponse(await env_step(ep, session, body))
        except ApiError as err:
            return JSONResponse(_error_body("env", err), status_code=err.status)

    app.add_api_route("/sessions/{sid}/env/step", environment_step, methods=["POST"])

    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [{"id": ep.model_name, "object": "model", "created": 0,
                                            "owned_by": "trajmesh"}]}

    app.add_api_route("/sessions/{sid}/v1/models", models, methods=["GET"])
    app.add_api_route("/v1/models", models, methods=["GET"])
    return app


class _EmbeddedServer(uvicorn.Server):
    """uvicorn inside a service's event loop: the service, not uvicorn, handles SIGTERM/SIGINT."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:  # uvicorn >= 0.29
        yield

    def install_signal_handlers(self) -> None:  # older uvicorn
        return None


async def serve(ep: AgentEndpoint, host: str, port: int, *, startup_timeout_s: float = 60.0
                ) -> tuple[uvicorn.Server, asyncio.Task[None]]:
    """Serves `ep` on the running loop; returns once it listens. Stop: ``server.should_exit = True``
    and await the task."""
    server = _EmbeddedServer(uvicorn.Config(create_app(ep), host=host, port=port, log_level="warning",
                                            lifespan="off"))
    task = asyncio.ensure_future(server.serve())
    deadline = time.monotonic() + startup_timeout_s
    while not server.started:  # uvicorn sets it once the socket listens
        if task.done():
            task.result()
            raise RuntimeError(f"agent endpoint on {host}:{port} stopped during start-up")
        if time.monotonic() > deadline:
            raise TimeoutError(f"agent endpoint on {host}:{port} not listening after {startup_timeout_s}s")
        await asyncio.sleep(0.02)
    return server, task
