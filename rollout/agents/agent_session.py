"""One external agent's session: every LLM call it makes, recorded with the engine's own tokens.

An agent talks to the endpoint (``rollout/agents/agent_endpoint.py``) in text: it resends the whole
conversation on every call. Re-encoding that text would not give back the tokens the engine
sampled (a BPE merge across a turn boundary, a tool call's JSON re-serialized, whitespace), and
training on re-encoded tokens with the engine's log-probs is off-policy garbage (retokenization
drift). So the session keeps, for every completion it handed out, the exact conversation that
continues it (the request's messages plus the assistant message it returned, normalized), and a new
request whose messages start with such a conversation reuses that call's prompt ids and the
completion's output ids verbatim; only the text after them (tool results, the next user message,
the template's framing) is tokenized, and it is masked out of the loss.

::

    call 0: prompt P0 ──▶ engine ──▶ out O0          segment 0: P0 O0 | T1 O1 | T2 O2
    call 1: messages = call 0's + O0's message + tool result
            prompt P0 + O0 + T1 (T1 = the new text's tokens) ──▶ engine ──▶ out O1
    call 2: history edited (no recorded conversation is a prefix) ──▶ new segment, reason
            "history_changed": its whole prompt is re-encoded and masked 0

Each completion is a node of the call graph; its parent is the completion its prompt continues.
A completion continuing the tail of a segment extends that segment; any other (a branch from an
earlier call, a second sample of ``n``) starts a new one whose prompt — earlier generated tokens
included — has loss mask 0, so no token is trained twice. The session is published as ONE
trajectory (:meth:`AgentSession.trajectory`), its segments marked by ``sequence_starts``; the learner
trains each segment as a row of its own. Completions the agent never received
(its SDK retried the request, or it hung up before the answer) are orphans: dropped, never trained.
"""

from __future__ import annotations

import hashlib
import json
import time
from dataclasses import dataclass, field
from typing import Any

from trajmesh.contract import Trajectory
from trajmesh.rollout.agents.chat_format import ChatFormat
from trajmesh.tokenizer import TextTokenizer
from trajmesh.v1 import trajectory_pb2


def canonical_message(msg: dict[str, Any]) -> dict[str, Any]:
    """A chat message as the session compares it: role, content text, tool calls as (name,
    arguments object); ids, names and empty fields dropped, ``arguments`` JSON strings decoded."""
    out: dict[str, Any] = {"role": str(msg.get("role", "")), "content": str(msg.get("content") or "")}
    calls = []
    for call in msg.get("tool_calls") or []:
        fn = call.get("function", call)
        args = fn.get("arguments", {})
        if isinstance(args, str):
            try:
                args = json.loads(args) if args.strip() else {}
            except ValueError:
                args = {"__raw__": args}
        calls.append({"name": str(fn.get("name", "")), "arguments": args})
    if calls:
        out["tool_calls"] = calls
    return out


def conversation_key(messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None) -> str:
    """A hash of canonical messages and tools: equal keys render to equal prompts."""
    body = json.dumps({"m": [canonical_message(m) for m in messages], "t": tools or []},
                      sort_keys=True, ensure_ascii=False)
    return hashlib.sha256(body.encode()).hexdigest()


@dataclass
class Completion:
    """One sampled continuation of a call (a call with ``n`` > 1 has n)."""

    call_index: int
    choice: int
    output_ids: list[int]
    logprobs: list[float]
    versions: list[int]
    ended_turn: bool
    """The last output token is the template's end-of-turn token (else the template's closing
    text after it is not the model's and is masked 0 when the conversation continues)."""
    orphan: bool = False
    """The agent never received it (retried or hung up): dropped from the trajectory."""
    continued: bool = False
    """A later call's prompt continues it."""


@dataclass
class Call:
    """One request to the endpoint as the engine saw it."""

    index: int
    api: str
    """chat | completions | responses | messages."""
    prompt_ids: list[int]
    parent: Completion | None
    """The completion whose tokens this prompt continues (None: the prompt was encoded from text)."""
    reason: str
    """Why its prompt starts where it does: continued | first | history_changed."""
    fingerprint: str
    """Hash of the request body: an SDK retry resends the same one."""
    started: float
    finished: float = 0.0
    completions: list[Completion] = field(default_factory=list)


@dataclass
class PromptPlan:
    """The prompt a call sends to the engine and where its tokens came from."""

    prompt_ids: list[int]
    parent: Completion | None
    reason: str


@dataclass
class Segment:
    """A chain of completions, each continuing the previous one: one sequence of the session's
    trajectory (``sequence_starts``), trained as a row of its own."""

    reason: str
    """first | history_changed | branch | sibling (another sample of the same call)."""
    prompt_ids: list[int]
    links: list[Completion] = field(default_factory=list)


@dataclass
class HostedEnvironment:
    """The task's own environment (e.g. workplace), hosted by the runner for one session: the agent
    acts on it through the endpoint (``POST /sessions/<sid>/env/step``); every state is recorded and
    the last one is what the run is graded by."""

    env: Any
    """A project environment (``reset``/``step``, envs/base.py), reset on the task; None when the
    environment service hosts it (`remote`)."""
    state_hashes: list[str]
    """The state after reset, then after each step."""
    steps: int = 0
    done: bool = False
    remote: Any = None
    """(environment service stub, its session id): the episode lives in that service (the mesh's
    agent runs); None: `env`, in this process."""
    failed: str = ""
    """Why the environment service failed a step ("": it did not): the run is then the
    environment's infrastructure failure, not the agent's."""

    async def step(self, action: str) -> tuple[str, bool, str]:
        """One action: (observation, done, state hash), recorded. A failing environment service
        raises its `grpc.aio.AioRpcError` (recorded in `failed`)."""
        if self.remote is None:
            res = self.env.step(action)
            observation, done, state_hash = res.observation, bool(res.done), res.state_hash
        else:
            import grpc

            from trajmesh.v1 import services_pb2

            stub, session_id = self.remote
            try:
                reply = await stub.Step(services_pb2.StepRequest(session_id=session_id, action=action), timeout=60.0)
            except grpc.aio.AioRpcError as exc:
                self.failed = f"environment service Step: {exc.code().name}"
                raise
            observation, done, state_hash = reply.observation, bool(reply.done), reply.state_hash
        self.steps += 1
        self.done = done
        self.state_hashes.append(state_hash)
        return observation, done, state_hash


class AgentSession:
    """Every call of one session, how each prompt was built, and the trajectories they make."""

    def __init__(self, session_id: str, tokenizer: TextTokenizer, chat: ChatFormat | None,
                 turn_end_id: int | None) -> None:
        self.session_id = session_id
        self.tokenizer = tokenizer
        self.chat = chat
        self.turn_end_id = turn_end_id
        """The id of the template's end-of-turn token (ChatML ``<|im_end|>``), if it is one token."""
        self.calls: list[Call] = []
        self.attempts: list[tuple[str, Call | None]] = []
        """Every request in arrival order: its fingerprint and its call (None: refused with a retryable
        answer while weights loaded, nothing generated)."""
        self.started = time.time()
        self.closed = False
        """No more calls are taken (the task ended, timed out or was abandoned)."""
        self.environment: HostedEnvironment | None = None
        """The environment the agent acts on (None: the agent brings its own, graded by its answer)."""
        self.forced: Any = None
        """A held-out evaluation's sampling (a `SamplingParams`): every call samples at its temperature
        and top-p, within its max_new_tokens, whatever the agent asks (None: as the agent asks)."""
        self._chat_continuations: dict[str, tuple[Completion, list[dict[str, Any]]]] = {}
        """conversation key of (request messages + returned assistant message) -> (completion, messages)."""
        self._text_continuations: dict[str, Completion] = {}
        """prompt text + returned completion text -> completion (the plain completions API)."""
        self._calls_by_completion: dict[int, Call] = {}

    # ----------------------------------------------------------------- building prompts

    def chat_prompt(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None,
                    render: Any) -> PromptPlan:
        """The prompt ids for a chat request. `render(messages, add_generation_prompt)` renders
        with the model's template (tools included). The longest recorded conversation that the
        request's messages start with gives the prefix ids; the rest is encoded text."""
        full = render(messages, True)
        for k in range(len(messages) - 1, -1, -1):
            if messages[k].get("role") != "assistant":
                continue
            hit = self._chat_continuations.get(conversation_key(messages[:k + 1], tools))
            if hit is None:
                continue
            upto = render(messages[:k + 1], False)
            tail = self._turn_tail(upto, hit[0])
            if tail is None or not full.startswith(upto):
                continue
            call = self._calls_by_completion[id(hit[0])]
            ids = call.prompt_ids + hit[0].output_ids + self.tokenizer.encode(tail + full[len(upto):])
            return PromptPlan(ids, hit[0], "continued")
        return PromptPlan(self.tokenizer.encode(full), None, "history_changed" if self.calls else "first")

    def _turn_tail(self, rendered: str, comp: Completion) -> str | None:
        """The template's text after the generated tokens of the assistant turn `rendered` ends with
        (ChatML: ``"\\n"`` when the model wrote ``<|im_end|>`` itself, else ``"<|im_end|>\\n"``)."""
        if self.chat is None:
            return ""
        end = self.chat.turn_end()
        cut = rendered.rfind(end) if end else -1
        if cut < 0:
            return None
        return rendered[cut + len(end):] if comp.ended_turn else rendered[cut:]

    def text_prompt(self, prompt: str) -> PromptPlan:
        """The prompt ids for a plain completion: the longest recorded prompt + completion text
        that `prompt` starts with keeps its ids."""
        best = max((k for k in self._text_continuations if prompt.startswith(k)), key=len, default=None)
        if best is None:
            return PromptPlan(self.tokenizer.encode(prompt), None, "history_changed" if self.calls else "first")
        comp = self._text_continuations[best]
        call = self._calls_by_completion[id(comp)]
        return PromptPlan(call.prompt_ids + comp.output_ids + self.tokenizer.encode(prompt[len(best):]),
                          comp, "continued")

    # ----------------------------------------------------------------- recording

    def begin(self, api: str, plan: PromptPlan, fingerprint: str) -> Call:
        call = Call(len(self.calls), api, plan.prompt_ids, plan.parent, plan.reason, fingerprint, time.time())
        self.calls.append(call)
        self.attempts.append((fingerprint, call))
        if plan.parent is not None:
            plan.parent.continued = True
        return call

    def add_completion(self, call: Call, output_ids: list[int], logprobs: list[float],
                       versions: list[int]) -> Completion:
        ended = bool(output_ids) and self.turn_end_id is not None and output_ids[-1] == self.turn_end_id
        comp = Completion(call.index, len(call.completions), list(output_ids), list(logprobs), list(versions), ended)
        call.completions.append(comp)
        self._calls_by_completion[id(comp)] = call
        return comp

    def remember_chat(self, comp: Completion, messages: list[dict[str, Any]],
                      tools: list[dict[str, Any]] | None, returned: dict[str, Any]) -> None:
        """`returned`: the assistant message the agent got for `comp` (it will resend it)."""
        convo = [*messages, returned]
        self._chat_continuations[conversation_key(convo, tools)] = (comp, convo)

    def remember_text(self, comp: Completion, prompt: str, returned: str) -> None:
        self._text_continuations[prompt + returned] = comp

    def refuse(self, fingerprint: str) -> None:
        """Records a request answered retryable (503 / 529) while weights loaded: generated nothing."""
        self.attempts.append((fingerprint, None))

    def drop_retried(self, fingerprint: str) -> int:
        """An SDK retry of the request `fingerprint`: its previous attempt is the latest one with that
        body. If that attempt generated an answer (finished, and nobody continued it), the agent never
        received it: its completions become orphans. A refused attempt, one still generating (its
        hang-up is caught when it ends) or an earlier identical request (a second sample the agent
        asked for) costs nothing."""
        previous = next((call for fp, call in reversed(self.attempts) if fp == fingerprint), None)
        if previous is None or not previous.finished or any(c.continued for c in previous.completions):
            return 0
        return self.drop(previous)

    def drop(self, call: Call) -> int:
        """Marks a call's completions as never received; returns how many were live."""
        live = [c for c in call.completions if not c.orphan]
        for comp in live:
            comp.orphan = True
        return len(live)

    # ----------------------------------------------------------------- trajectories

    def segments(self) -> list[Segment]:
        """The received completions as chains, in call order (see the module docstring)."""
        segments: list[Segment] = []
        tail_of: dict[int, Segment] = {}
        for call in self.calls:
            for comp in call.completions:
                if comp.orphan:
                    continue
                seg = tail_of.pop(id(call.parent), None) if call.parent is not None and comp.choice == 0 else None
                if seg is None:
                    reason = ("sibling" if comp.choice else
                              "branch" if call.parent is not None else call.reason)
                    seg = Segment(reason, list(call.prompt_ids))
                    segments.append(seg)
                seg.links.append(comp)
                tail_of[id(comp)] = seg
        return segments

    def trajectory(self, task: trajectory_pb2.Task | None, *, trajectory_id: str,
                   rollout_worker: str = "") -> Trajectory | None:
        """The whole session as ONE trajectory (one per sample: the store's and the gate's
        accounting stay exact): every segment in ``segments()`` order, each its own sequence
        (``sequence_starts``): its prompt (mask 0, earlier generated tokens included), then per link
        the engine's tokens (mask 1, its log-probs and versions) and the text to the next (mask 0).
        The learner trains each segment as a row of its own. None: no received completion."""
        segments = self.segments()
        if not segments:
            return None
        traj = Trajectory.new(task, trajectory_id=trajectory_id, rollout_worker=rollout_worker,
                              created_unix_seconds=self.started)
        span_of: dict[int, str] = {}
        turn = 0
        for seg in segments:
            traj.start_segment()
            turn = self._append_segment(traj, seg, span_of, turn)
        if len(segments) == 1:  # one sequence: no starts (as the project's own agent loop)
            traj.pb.ClearField("sequence_starts")
        traj.pb.timing.rollout_seconds = max(c.finished for c in self.calls) - self.started
        return traj

    def _append_segment(self, traj: Trajectory, seg: Segment, span_of: dict[int, str], turn: int) -> int:
        """One segment onto ``traj``: its prompt (mask 0, at turn index ``turn``), then per link the
        engine's tokens (mask 1, log-probs, versions) and the text to the next link (mask 0); each
        span's parent is the span of the call that caused it. Returns the next turn index."""
        traj.append_prompt(seg.prompt_ids, turn_index=turn)
        pos = len(seg.prompt_ids)
        for k, comp in enumerate(seg.links):
            call = self._calls_by_completion[id(comp)]
            if k:
                traj.append_observation(call.prompt_ids[pos:], turn_index=turn - 1)
            span = traj.append_sampled(comp.output_ids, comp.logprobs, comp.versions, turn_index=turn)
            if call.parent is not None and id(call.parent) in span_of:  # the call graph
                span.parent_span_id = span_of[id(call.parent)]
            span_of[id(comp)] = span.span_id
            pos = len(call.prompt_ids) + len(comp.output_ids)
            turn += 1
        return turn

    def final_segment(self) -> int | None:
        """Index (in ``segments()``) of the segment holding the last completion the agent received."""
        segments = self.segments()
        live = [(c.call_index, c.choice, n) for n, seg in enumerate(segments) for c in seg.links]
        return max(live)[2] if live else None

    def trajectories(self, task: trajectory_pb2.Task | None, *, base_id: str,
                     rollout_worker: str = "") -> list[Trajectory]:
        """Each segment as a trajectory of its own, named ``<base_id>-s<n>-<reason>`` (for inspecting
        a session; what is published is :meth:`trajectory`, all segments in one): prompt (mask 0), then per link its generated tokens (mask 1,
        the engine's log-probs and versions) and the text between it and the next (mask 0)."""
        out = []
        span_of: dict[int, str] = {}
        for n, seg in enumerate(self.segments()):
            traj = Trajectory.new(task, trajectory_id=f"{base_id}-s{n}-{seg.reason}",
                                  rollout_worker=rollout_worker, created_unix_seconds=self.started)
            self._append_segment(traj, seg, span_of, 0)
            traj.pb.timing.rollout_seconds = max(c.finished for c in self.calls) - self.started
            out.append(traj)
        return out
