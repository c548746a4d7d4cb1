"""The environment interface (docs/DESIGN.md §6); environments are looked up by key in `trajmesh.plugins`. No torch.

An environment is deterministic given (task, seed, action log): replaying the actions on a fresh
instance reproduces every observation and state hash, so a session can move to another pod.
`StepResult.info` tells rollout what the action was (`action_type`: TEXT, CODE or TOOL_CALL), the
tool call it made (`tool_call`: name, request, response, status, latency_s, and `native`: True when
it came in the model's own ``<tool_call>{json}</tool_call>`` format), and, when the environment
ended the episode for a reason other than the policy's answer, `terminal_reason` (e.g.
SANDBOX_ERROR with `sandbox_error`).

Tool calls (math_tool, search, workplace) come in two forms, both accepted on every step so that
replaying an action log never depends on the model: the model's native Hermes/Qwen2.5 format
(`trajmesh.tool_calls`; tools declared as JSON schemas, `function_schemas`; the answer is
the plain tool output, which the chat template wraps as a tool message) and the environment's own
tags (``<code>``, ``<search>``, ``<tool>``; answered inside the environment's tags) for the
character-tokenizer demo model, which has no chat template. A source's ``tool_format`` picks which
form the task prompt asks for.
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass
from typing import Any, Protocol

from trajmesh.tool_calls import ToolCall, count_malformed, parse_tool_calls


@dataclass(frozen=True)
class StepResult:
    observation: str
    done: bool
    state_hash: str
    reward: float = 0.0
    info: dict[str, Any] | None = None


class Environment(Protocol):
    revision: str

    def reset(self, task: dict[str, Any], seed: int) -> tuple[str, str]:
        """Start an episode; returns (observation, state hash)."""
        ...

    def step(self, action: str) -> StepResult: ...


def state_hash(*parts: object) -> str:
    return hashlib.sha256("\x1f".join(map(str, parts)).encode()).hexdigest()[:16]


def last_tag(text: str, tag: str) -> str | None:
    """Content of the last ``<tag>...</tag>`` in ``text`` (None when absent)."""
    found = re.findall(rf"<{tag}>(.*?)</{tag}>", text, flags=re.DOTALL)
    return found[-1].strip() if found else None


def first_tag(text: str, tag: str) -> str | None:
    m = re.search(rf"<{tag}>(.*?)</{tag}>", text, flags=re.DOTALL)
    return m.group(1) if m else None


def function_schemas(tools: dict[str, dict[str, Any]]) -> list[dict[str, Any]]:
    """Tools ``{name: {description, parameters}}`` as the list a chat template's ``tools`` takes
    (OpenAI / Hugging Face function format)."""
    return [{"type": "function", "function": {"name": name, **spec}} for name, spec in tools.items()]


def native_instruction(tools: dict[str, dict[str, Any]], finish: str) -> str:
    """The task prompt's first line in the native format: the tools' signatures, how to call, how to finish."""
    sig = "; ".join(f"{name}({', '.join(spec['parameters']['properties'])})" for name, spec in tools.items())
    return f'Tools: {sig}. Call <tool_call>{{"name": ..., "arguments": {{...}}}}</tool_call>; {finish}\n'


@dataclass(frozen=True)
class NativeAction:
    """A turn written in the native tool-call format: the first well-formed call (one call per
    turn; `ignored` counts any further ones) or, when no block parsed, `error`."""

    call: ToolCall | None
    error: str = ""
    ignored: int = 0


def parse_native(action: str) -> NativeAction | None:
    """None when the turn holds no ``<tool_call>`` at all (the environment's own tags apply then)."""
    if "<tool_call>" not in action:
        return None
    _, calls = parse_tool_calls(action)
    if calls:
        return NativeAction(calls[0], ignored=len(calls) - 1)
    bad = count_malformed(action)
    return NativeAction(None, error=f"{bad} malformed <tool_call> block(s): "
                                    'expected {"name": ..., "arguments": {...}}')


def native_request(call: ToolCall) -> str:
    return json.dumps({"name": call.name, "arguments": call.arguments}, sort_keys=True)


def single_string_argument(native: NativeAction, h: str, tool: str, argument: str) -> str | StepResult:
    """For an environment with one tool taking one string argument: that argument of the turn's
    native call, or the StepResult answering a malformed block (parser error) or a call of another
    shape (invalid action `schema`)."""
    if native.call is None:
        return StepResult(f"error: {native.error}", False, h, info={"action_type": "TOOL_CALL", "parser_error": True})
    value = native.call.arguments.get(argument)
    if native.call.name != tool or not isinstance(value, str) or set(native.call.arguments) != {argument}:
        obs = f'error: the only tool is {tool} with one string argument "{argument}"; got {native.call.name!r}'
        return StepResult(obs, False, h, info={
            "action_type": "TOOL_CALL", "invalid_action": "schema",
            "tool_call": {"name": native.call.name, "request": native_request(native.call), "response": obs,
                          "status": "invalid", "latency_s": 0.0, "native": True}})
    return value


class SingleToolEnv:
    """The skeleton of an environment with one tool taking one string argument (math_tool's python,
    search's search): each turn is a text-format call (``<tag>argument</tag>``), a native
    ``<tool_call>``, or the final answer (any other text, which ends the episode). A subclass names
    its tool and sets `tool_tag`, `output_tag`, `action_type`, `budget_key` and `budget_reason`,
    loads its settings in `settings` and answers one call in `call`."""

    tool: str
    """The tool's name (native calls must name it)."""
    argument: str
    """Its one string argument."""
    tool_tag: str
    """The text-format call tag (``<code>``, ``<search>``)."""
    output_tag: str
    """The tag a text-format answer is wrapped in (a native call's answer goes back bare: the chat
    template wraps it)."""
    action_type: str
    """`info.action_type` of its calls (CODE, TOOL_CALL)."""
    budget_key: str
    """The setting that caps calls per episode."""
    budget_reason: str
    """`info.invalid_action` of a call past the budget."""
    budget_text: str
    """What a call past the budget is answered."""

    def settings(self, task: dict[str, Any]) -> dict[str, Any]:
        """The episode's settings (source defaults overridden by the task's metadata)."""
        raise NotImplementedError

    def call(self, argument: str, h: str, *, native: bool) -> StepResult:
        """Answers one call within the budget."""
        raise NotImplementedError

    def reset(self, task: dict[str, Any], seed: int) -> tuple[str, str]:
        self.task = task
        self.cfg = self.settings(task)
        self.prompt = str(task["prompt"])
        self.calls = 0
        self.actions: list[str] = []
        return self.prompt, state_hash(self.prompt)

    def step(self, action: str) -> StepResult:
        self.actions.append(action)
        h = state_hash(self.prompt, *self.actions)
        native = parse_native(action)
        if native is not None:
            argument = single_string_argument(native, h, self.tool, self.argument)
            return argument if isinstance(argument, StepResult) else self._budgeted(argument, h, native=True)
        tagged = first_tag(action, self.tool_tag)
        if tagged is None:
            return StepResult("", True, h, info={"action_type": "TEXT"})
        return self._budgeted(tagged, h, native=False)

    def _budgeted(self, argument: str, h: str, *, native: bool) -> StepResult:
        if self.calls >= int(self.cfg[self.budget_key]):
            body = self.budget_text
            return StepResult(body if native else f"<{self.output_tag}>{body}</{self.output_tag}>\n", False, h,
                              info={"action_type": self.action_type, "invalid_action": self.budget_reason})
        self.calls += 1
        return self.call(argument, h, native=native)


class SingleAnswerEnv:
    """One turn: the observation is the prompt, the action is the answer, then the episode ends.

    Serves any task with a `prompt` (reasoning-gym families such as chain_sum); the grader scores.
    """

    revision = "single_answer-v1"
    config_keys: tuple[str, ...] = ()
    inline = True
    """reset/step are quick pure Python: the environment service runs them on its event loop
    instead of a worker thread (environments without this attribute get a thread)."""
    stateless = True
    """One turn, and reset/step are pure functions of (task, seed, action): no session worth a
    round trip, so the rollout plays it in its own process (`rollout.stateless_environments_in_process`;
    environments without this attribute go through the environment service)."""

    def reset(self, task: dict[str, Any], seed: int) -> tuple[str, str]:
        self.prompt = str(task["prompt"])
        self.actions: list[str] = []
        return self.prompt, state_hash(self.prompt, seed)

    def step(self, action: str) -> StepResult:
        self.actions.append(action)
        return StepResult("", True, state_hash(self.prompt, *self.actions))


def make_environment(kind: str) -> Environment:
    """An environment by key (a task's ``environment``), from the plug-in registry (`trajmesh.plugins`)."""
    from trajmesh import plugins

    return plugins.environment_class(kind)()
