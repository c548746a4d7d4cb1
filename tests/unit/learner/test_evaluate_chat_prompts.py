"""Held-out evaluation feeds the policy exactly the token ids the rollout feeds its engine, with a
chat model (the ChatML Qwen2 model of tests/chatml_model.py): for a task and seed, the first prompt
(chat template, the task's tool schemas) and, in a tool environment, every later context (the
sampled turn, then the tool result as a ``tool`` message up to the next generation prompt).

The rollout side is the rollout service's own episode code (`RolloutService.run_episode`) against a
real environment service over gRPC, with its engine call replaced by a recorder; the evaluator side
is `trajmesh train`'s `evaluate_dir` on the real model (its prompts read where the model is
prefilled) and `evaluate_tasks` with a scripted policy."""

from __future__ import annotations

import asyncio
import json
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import grpc
import pytest

pytest.importorskip("transformers")

from chatml_model import build_chatml_model  # noqa: E402

from trajmesh.config import RunConfig, load_config  # noqa: E402
from trajmesh.learner.evaluate import evaluate_tasks  # noqa: E402
from trajmesh.rollout.agents.episode import EpisodeFormat  # noqa: E402
from trajmesh.rollout.engines.torch_sampler import Sampled, SamplingParams  # noqa: E402
from trajmesh.run import train as train_mod  # noqa: E402
from trajmesh.services.environment import EnvironmentService  # noqa: E402
from trajmesh.services.rollout import RolloutService  # noqa: E402
from trajmesh.v1 import services_pb2_grpc, trajectory_pb2  # noqa: E402

TEXTS = ["What is 2+3? Answer with a number.", "Search with <search>q</search>; reply <answer>x</answer>.",
         '<tool_call>{"name": "search", "arguments": {"query": "town"}}</tool_call>', "In which year was founded?",
         "<answer>1234</answer>", "Sum the numbers: 3 + 4 + 5 = ?"] * 30
SOURCES = {"chain_sum": {"type": "reasoning_gym"},
           "search": {"type": "search", "corpus_size": 20, "tool_format": "native"}}
Respond = Callable[[str], str]
"""Decoded context so far -> the turn's text (the end-of-turn token is appended)."""


@pytest.fixture(scope="module")
def chat_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_chatml_model(tmp_path_factory.mktemp("chatml"), TEXTS, max_positions=1024)


def _cfg(chat_dir: Path, tmp_path: Path, source: str, max_turns: int, max_new_tokens: int = 24) -> RunConfig:
    return load_config(None, {"run_dir": str(tmp_path / "run"), "model.path": str(chat_dir), "seed": 3,
                              "tasks.heldout_size": 3, "tasks.sources": [SOURCES[source]],
                              "tasks.sampling.max_new_tokens": max_new_tokens, "tasks.sampling.max_turns": max_turns})


def _task_pb(task: dict[str, Any], seed: int, cfg: RunConfig) -> trajectory_pb2.Task:
    """The task as the store publishes it to the rollout (services/store/service.py)."""
    s = cfg.tasks.sampling
    pb = trajectory_pb2.Task(task_id=task["task_id"], group_id="g", source=task["source"], seed=seed, group_size=1,
                             environment=task["environment"] or "", prompt=task["prompt"], answer=task["answer"],
                             metadata_json=json.dumps(task["metadata"], default=str))
    pb.sampling.CopyFrom(trajectory_pb2.SamplingParams(temperature=s.temperature, top_p=s.top_p, top_k=s.top_k,
                                                       max_new_tokens=s.max_new_tokens, max_turns=s.max_turns))
    return pb


def _rollout_contexts(cfg: RunConfig, tasks: list[dict[str, Any]], seed: int,
                      turn: Callable[[list[int]], list[int]]) -> list[list[list[int]]]:
    """Per task, every context the rollout service sends its engine in sample 0 of the task with
    `seed`, against a real environment service; `turn(context)` is the engine's answer (a stop)."""
    svc = RolloutService(cfg)
    svc.format = EpisodeFormat.load(str(cfg.model.path))  # what setup() loads
    svc.tokenizer, svc.chat, svc.stop_ids = svc.format.tokenizer, svc.format.chat, svc.format.stop_ids
    svc.version = 0
    seen: list[list[int]] = []

    async def generate(context: list[int], sp: Any, sample_seed: int) -> Any:
        seen.append(list(context))
        ids = turn(context)
        return ids, [-1.0] * len(ids), [0] * len(ids), "stop"

    svc._generate = generate  # type: ignore[method-assign]

    async def play() -> list[list[list[int]]]:
        env_svc = EnvironmentService(cfg)
        await env_svc.setup()
        out = []
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{env_svc.grpc_port}") as ch:
                svc.envs = [services_pb2_grpc.EnvironmentStub(ch)]
                for task in tasks:
                    seen.clear()
                    traj = await svc.run_episode(_task_pb(task, seed, cfg), 0)
                    assert traj.terminal_reason != trajectory_pb2.INFRA_FAILURE
                    out.append([list(c) for c in seen])
        finally:
            await env_svc.stop()
        return out

    return asyncio.run(play())


def _prefilled_prompts(monkeypatch: pytest.MonkeyPatch) -> list[list[list[int]]]:
    """Every batch of prompts the evaluator's model is prefilled with (padding removed), in order."""
    import trajmesh.learner.models as models

    calls: list[list[list[int]]] = []
    real_load = models.load_model

    def hook(module: Any, args: Any, kwargs: dict[str, Any]) -> None:
        ids, mask = kwargs["input_ids"], kwargs["attention_mask"]
        if ids.shape[1] > 1:  # a prefill (decode steps feed one token per row)
            calls.append([row[m.bool()].tolist() for row, m in zip(ids, mask[:, -ids.shape[1]:], strict=True)])

    def load_model(model_dir: Any) -> tuple[Any, Any]:
        model, tok = real_load(model_dir)
        model.register_forward_pre_hook(hook, with_kwargs=True)
        return model, tok

    monkeypatch.setattr(models, "load_model", load_model)
    return calls


def test_evaluate_dir_prompts_are_the_rollouts(chat_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """`evaluate_dir` (the launcher's evaluation, stateless sources only: a tool source such as
    search is refused there and played by the evaluator service with the rollout's own loop)."""
    source = "chain_sum"
    cfg = _cfg(chat_dir, tmp_path, source, max_turns=1)
    tasks = train_mod.heldout_tasks(cfg)[source]
    calls = _prefilled_prompts(monkeypatch)
    train_mod.evaluate_dir(str(chat_dir), {source: tasks}, cfg, samples=1)
    # The greedy pass runs first, with seed cfg.seed: its first prefill holds every task's first prompt.
    evaluator_first = sorted(calls[0])
    end = EpisodeFormat.load(chat_dir).turn_end_id
    assert end is not None
    rollout = _rollout_contexts(cfg, tasks, cfg.seed, lambda ctx: [end])
    rollout_first = sorted(contexts[0] for contexts in rollout)
    im_start = EpisodeFormat.load(chat_dir).tokenizer.tokenizer.token_to_id("<|im_start|>")
    assert all(p[0] == im_start for p in rollout_first)  # the chat template's prompt, not the raw text
    assert evaluator_first == rollout_first


def _search_respond(ctx: str) -> str:
    """Turn 1: a native search call for the question's town; turn 2: an answer."""
    if "<tool_response>" in ctx:
        return "<answer>1234</answer>"
    town = re.findall(r"(?:was|founded|is) ([A-Z][a-z]+)(?: founded)?\?", ctx)
    assert town, ctx
    return f'<tool_call>{{"name": "search", "arguments": {{"query": "{town[-1]}"}}}}</tool_call>'


class _ScriptedPolicy:
    """Answers `respond(decoded context)` + end of turn; records every context per episode."""

    def __init__(self, fmt: EpisodeFormat, respond: Respond) -> None:
        self.fmt, self.respond = fmt, respond
        self.seen: list[list[int]] = []

    def turn(self, ctx: list[int]) -> list[int]:
        assert self.fmt.turn_end_id is not None
        return self.fmt.tokenizer.encode(self.respond(self.fmt.tokenizer.decode(ctx))) + [self.fmt.turn_end_id]

    def generate(self, contexts: list[list[int]], params: SamplingParams) -> list[Sampled]:
        assert self.fmt.turn_end_id in params.stop_token_ids  # the rollout's stop ids
        out = []
        for ctx in contexts:
            self.seen.append(list(ctx))
            ids = self.turn(ctx)
            out.append(Sampled(ids, [-1.0] * len(ids), {"type": "stop", "matched": ids[-1]}))
        return out


def test_tool_episode_contexts_are_the_rollouts_turn_by_turn(chat_dir: Path, tmp_path: Path) -> None:
    cfg = _cfg(chat_dir, tmp_path, "search", max_turns=3, max_new_tokens=64)
    tasks = train_mod.heldout_tasks(cfg)["search"]
    fmt = EpisodeFormat.load(chat_dir)
    evaluator = _ScriptedPolicy(fmt, _search_respond)
    res = evaluate_tasks(evaluator, fmt, tasks, temperature=0.0, max_new_tokens=64, max_turns=3, seed=cfg.seed)
    assert res["terminal_reasons"] == {"EOS": len(tasks)}  # search, read the passages, answer
    rollout = _rollout_contexts(cfg, tasks, cfg.seed, _ScriptedPolicy(fmt, _search_respond).turn)
    assert all(len(contexts) == 2 for contexts in rollout)  # the call, then the answer
    # The lock-step evaluator sees every task's first context, then every task's second one.
    by_turn = [sorted(evaluator.seen[:len(tasks)]), sorted(evaluator.seen[len(tasks):])]
    assert by_turn == [sorted(c[0] for c in rollout), sorted(c[1] for c in rollout)]
    tool_response = fmt.tokenizer.tokenizer.token_to_id("<tool_response>")
    assert all(tool_response in c[1][len(c[0]):] for c in rollout)  # the result came back as a tool message
