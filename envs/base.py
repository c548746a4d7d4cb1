"""The environment interface (DESIGN.md §6) and the registry keyed by `type`. No torch.

An environment is deterministic given (task, seed, action log): replaying the actions on a fresh
instance reproduces every observation and state hash, so a session can move to another pod.
`StepResult.info` tells rollout what the action was (`action_type`: TEXT, CODE or TOOL_CALL), the
tool call it made (`tool_call`: name, request, response, status, latency_s), and, when the
environment ended the episode for a reason other than the policy's answer, `terminal_reason`
(e.g. SANDBOX_ERROR with `sandbox_error`).
"""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass
from typing import Any, Protocol


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


class SingleAnswerEnv:
    """One turn: the observation is the prompt, the action is the answer, then the episode ends.

    Serves any task with a `prompt` (reasoning-gym families such as chain_sum); the grader scores.
    """

    revision = "single_answer-v1"
    config_keys: tuple[str, ...] = ()
    inline = True
    """reset/step are quick pure Python: the environment service runs them on its event loop
    instead of a worker thread (environments without this attribute get a thread)."""

    def reset(self, task: dict[str, Any], seed: int) -> tuple[str, str]:
        self.prompt = str(task["prompt"])
        self.actions: list[str] = []
        return self.prompt, state_hash(self.prompt, seed)

    def step(self, action: str) -> StepResult:
        self.actions.append(action)
        return StepResult("", True, state_hash(self.prompt, *self.actions))


def make_environment(kind: str) -> Environment:
    """An environment by registry key (`trajmesh.envs.registry.ENVIRONMENTS`)."""
    from trajmesh.envs.registry import ENVIRONMENTS

    try:
        return ENVIRONMENTS[kind]()  # type: ignore[no-any-return]
    except KeyError:
        raise ValueError(f"unknown environment {kind!r}; available: {sorted(ENVIRONMENTS)}") from None
