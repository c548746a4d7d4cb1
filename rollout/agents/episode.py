"""The token layout of one episode, shared by the rollout service and held-out evaluation.

::

    task ── env.reset ── EpisodeFormat.prompt_ids(observation, tools)    chat template: system + user turn
      ▲                      │ policy / engine samples one turn            + generation prompt; else BOS + text
      │                      ▼ (stops on EpisodeFormat.stop_ids)
      │    finish "length" ─▶ MAX_TOKENS (the environment never sees the cut turn)
      │                      │ env.step(decoded turn)
      │            done? ─ yes ─▶ EpisodeFormat.end_reason(turn, info): the environment's reason, EOS, ENV_DONE
      └── EpisodeFormat.observation_ids(text, action_type, turn)    loss mask 0: a tool message after a
                                                                     tool call or code, a user message otherwise

`EpisodeFormat` is what the rollout service (services/rollout.py) feeds its engine, and
`play_episodes` runs the same layout in-process (the `envs/` classes themselves, a `Policy` in place
of the engine) for held-out evaluation (learner/evaluate.py): for a task and seed both build the
same token ids. The environment sees the task as the environment service hands it over (prompt,
answer, metadata after a JSON round trip, `reset_view`).
"""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from trajmesh.rollout.agents.chat_format import ChatFormat, model_stop_ids
from trajmesh.tokenizer import TextTokenizer, load_tokenizer
from trajmesh.v1 import trajectory_pb2

if TYPE_CHECKING:  # the torch sampler's types; this module itself imports without torch (the rollout service)
    from trajmesh.rollout.engines.torch_sampler import Sampled, SamplingParams

TOOL_ACTIONS = ("TOOL_CALL", "CODE")
"""Action types (the environment's ``info.action_type``) whose observation is a ``tool`` message."""


class EpisodeFormat:
    """A model's episode token layout: its tokenizer, chat format (None: BOS + raw text) and stop ids."""

    def __init__(self, tokenizer: TextTokenizer, chat: ChatFormat | None, stop_ids: set[int]) -> None:
        self.tokenizer, self.chat = tokenizer, chat
        self.turn_end_id: int | None = None
        """The id of the template's end-of-turn text (ChatML ``<|im_end|>``; None without a template)."""
        if chat is not None:
            end = tokenizer.tokenizer.token_to_id(chat.turn_end())
            self.turn_end_id = int(end) if end is not None else None
        self.stop_ids = set(stop_ids) | ({self.turn_end_id} if self.turn_end_id is not None else set())
        """Every id that ends a turn: the EOS ids of the tokenizer and generation config, the end of turn."""

    @staticmethod
    def load(model_dir: str | Path) -> EpisodeFormat:
        tokenizer = load_tokenizer(model_dir)
        return EpisodeFormat(tokenizer, ChatFormat.load(model_dir), model_stop_ids(model_dir, tokenizer.eos_token_id))

    def prompt_ids(self, observation: str, tools: list[dict[str, Any]] | None = None) -> list[int]:
        """The first context: the chat template's user turn + generation prompt (with the task's tool
        schemas for a template that renders them), or BOS + text."""
        if self.chat is not None:
            return self.tokenizer.encode(self.chat.prompt(observation, tools=tools))
        bos = [self.tokenizer.bos_token_id] if self.tokenizer.bos_token_id is not None else []
        return bos + self.tokenizer.encode(observation)

    def observation_ids(self, text: str, action_type: str, turn_ids: list[int]) -> list[int]:
        """An observation's tokens (loss mask 0): through the chat template as a tool message after a
        tool call or code (`action_type`), a user message otherwise, up to the next generation prompt;
        raw text without a template. The generated `turn_ids` before it stay as sampled."""
        if self.chat is None:
            return self.tokenizer.encode(text)
        role = "tool" if action_type in TOOL_ACTIONS else "user"
        closed = bool(turn_ids) and self.turn_end_id is not None and turn_ids[-1] == self.turn_end_id
        return self.tokenizer.encode(self.chat.observation(text, role, turn_closed=closed))

    def end_reason(self, turn_ids: list[int], info: dict[str, Any]) -> str:
        """The terminal reason of an episode the environment ended after `turn_ids`: the reason the
        environment reports (a `TerminalReason` name, e.g. SANDBOX_ERROR), else EOS when the turn
        ended on a stop id, else ENV_DONE."""
        reported = info.get("terminal_reason")
        if reported in trajectory_pb2.TerminalReason.keys():
            return str(reported)
        return "EOS" if turn_ids and turn_ids[-1] in self.stop_ids else "ENV_DONE"

    def sampling(self, temperature: float, top_p: float, max_new_tokens: int) -> SamplingParams:
        """One turn's sampling settings for the in-process sampler, stopping on every stop id."""
        from trajmesh.rollout.engines.torch_sampler import SamplingParams

        return SamplingParams(temperature=temperature, top_p=top_p, max_new_tokens=max_new_tokens,
                              stop_token_ids=tuple(sorted(self.stop_ids)))


def reset_view(task: dict[str, Any]) -> dict[str, Any]:
    """The task as an environment's ``reset`` receives it from the environment service (the store
    sends the metadata as JSON)."""
    return {"prompt": task["prompt"], "answer": task["answer"],
            "metadata": json.loads(json.dumps(task.get("metadata") or {}, default=str))}


class Policy(Protocol):
    """One sampled turn per context (the engine's place in `play_episodes`; a scripted one in tests)."""

    def generate(self, contexts: list[list[int]], params: SamplingParams) -> list[Sampled]: ...


@dataclass
class Episode:
    """One episode played in-process: its contexts, the policy's turns, state hashes, how it ended."""

    task: dict[str, Any]
    env: Any
    context: list[int]
    state_hashes: list[str]
    prompt_ids: list[int] = field(default_factory=list)
    """The first context (what the rollout sends its engine first for this task and seed)."""
    turn_ids: list[list[int]] = field(default_factory=list)
    terminal_reason: str = ""
    """A `TerminalReason` name (EOS, ENV_DONE, MAX_TOKENS, MAX_TURNS, SANDBOX_ERROR, ...); "" while live."""


def start_episode(task: dict[str, Any], seed: int, fmt: EpisodeFormat) -> Episode:
    from trajmesh.envs.base import make_environment

    env = make_environment(str(task.get("environment") or "single_answer"))
    obs, h = env.reset(reset_view(task), seed)
    prompt = fmt.prompt_ids(obs, (task.get("metadata") or {}).get("tools"))
    return Episode(task, env, list(prompt), [h], prompt_ids=list(prompt))


def advance_episode(ep: Episode, out: Sampled, fmt: EpisodeFormat) -> None:
    """Applies one sampled turn: a turn cut by the token budget ends the episode unseen by the
    environment (MAX_TOKENS); otherwise the environment steps and either ends it or answers."""
    ids = list(out.output_ids)
    ep.context += ids
    ep.turn_ids.append(ids)
    if (out.finish_reason or {}).get("type") != "stop":
        ep.terminal_reason = "MAX_TOKENS"
        return
    res = ep.env.step(fmt.tokenizer.decode(ids))
    ep.state_hashes.append(res.state_hash)
    info = res.info or {}
    if res.done:
        ep.terminal_reason = fmt.end_reason(ids, info)
        return
    ep.context += fmt.observation_ids(res.observation, str(info.get("action_type", "TEXT")), ids)


def play_episodes(policy: Policy, fmt: EpisodeFormat, tasks: list[dict[str, Any]], params: SamplingParams, *,
                  max_turns: int, samples: int = 1, seed: int = 0, workers: int = 4) -> list[Episode]:
    """`samples` episodes per task (sample k resets with `seed + k`, as the rollout's sample k of a
    task with seed `seed`), played turn by turn in lock step (one batched generate per turn).

    Steps of environments that block (sandboxed code: no `inline` attribute, as in the environment
    service) run on `workers` threads; each step touches only its own episode."""
    episodes = [start_episode(t, seed + k, fmt) for t in tasks for k in range(samples)]
    with ThreadPoolExecutor(max_workers=max(1, workers)) as pool:
        for _ in range(max(1, max_turns)):
            live = [e for e in episodes if not e.terminal_reason]
            if not live:
                break
            pairs = list(zip(live, policy.generate([e.context for e in live], params), strict=True))
            for ep, out in pairs:
                if getattr(ep.env, "inline", False):
                    advance_episode(ep, out, fmt)
            blocking = [(ep, out) for ep, out in pairs if not getattr(ep.env, "inline", False)]
            list(pool.map(lambda pair: advance_episode(pair[0], pair[1], fmt), blocking))
    for ep in episodes:
        ep.terminal_reason = ep.terminal_reason or "MAX_TURNS"
    return episodes


class ModelPolicy:
    """A causal LM sampled in-process with `sample_batch` (rollout/engines/torch_sampler.py); contexts of
    similar length share a batch."""

    def __init__(self, model: Any, *, pad_id: int, eos_id: int, seed: int, batch_size: int = 512) -> None:
        import torch

        self.model = model
        self.pad_id, self.eos_id, self.batch_size = pad_id, eos_id, batch_size
        self.generator = torch.Generator(device=next(model.parameters()).device).manual_seed(seed)

    def generate(self, contexts: list[list[int]], params: SamplingParams) -> list[Sampled]:
        from trajmesh.rollout.engines.torch_sampler import Sampled, sample_batch

        order = sorted(range(len(contexts)), key=lambda i: len(contexts[i]))
        out: list[Sampled] = [Sampled() for _ in contexts]
        for start in range(0, len(order), self.batch_size):
            idx = order[start : start + self.batch_size]
            rows = sample_batch(self.model, [contexts[i] for i in idx], [params] * len(idx), pad_id=self.pad_id,
                                eos_id=self.eos_id, generator=self.generator)
            for i, row in zip(idx, rows, strict=True):
                out[i] = row
        return out
