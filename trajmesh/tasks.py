"""Task sources and the mixture sampler the store draws from (no torch).

`TaskSampler.task_at(i)` is a pure function of (config, seed, i): the store keeps only the cursor
i in Redis, so a restarted store continues the same sequence. Every source type has a generator in
`envs/`; `load_split` draws the held-out split first (its own seed) and keeps training disjoint.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Any

from trajmesh.config import (
    ExternalAgentSource,
    MathToolSource,
    ReasoningGymSource,
    SearchSource,
    TasksConfig,
    WorkplaceSource,
)

TRAIN_SEED, HELDOUT_SEED = 1234, 98765


@dataclass(frozen=True)
class TaskSpec:
    task_id: str
    source: str
    revision: str
    prompt: str
    answer: str
    environment: str
    metadata: dict[str, Any] = field(default_factory=dict)


def _draw(src: Any, seed: int, n: int, exclude: set[str]) -> list[dict[str, Any]]:
    """``n`` task dicts of one source; ``exclude`` holds prompts that must not appear."""
    if isinstance(src, ReasoningGymSource):
        from trajmesh.envs import reasoning_gym

        return reasoning_gym.make_tasks(src.family, seed, n, dict(src.knobs), source=src.name, exclude=exclude)
    if isinstance(src, MathToolSource):
        from trajmesh.envs import math_tool

        tool = {"max_tool_calls": src.max_tool_calls, "call_timeout_s": src.call_timeout_s,
                "max_output_bytes": src.max_output_bytes}
        return math_tool.make_tasks(seed, n, difficulty=src.difficulty, tool=tool, source=src.name,
                                    exclude={p.split("\n", 1)[-1] for p in exclude}, tool_format=src.tool_format)
    if isinstance(src, WorkplaceSource):
        from trajmesh.envs import workplace

        tasks = workplace.make_tasks(seed, min(n, src.pool_size), n_employees=src.n_employees,
                                     n_tasks=src.n_tasks, source=src.name, tool_format=src.tool_format)
        return [t for t in tasks if t["prompt"] not in exclude]
    if isinstance(src, SearchSource):
        from trajmesh.envs import search

        cfg = {"top_k": src.top_k, "max_searches": src.max_searches, "corpus_size": src.corpus_size,
               "corpus_seed": src.corpus_seed}
        return search.make_tasks(seed, n, search=cfg, source=src.name,
                                 exclude={p.split("\n", 1)[-1] for p in exclude}, tool_format=src.tool_format)
    if isinstance(src, ExternalAgentSource):
        from trajmesh.envs import reasoning_gym

        tasks = reasoning_gym.make_tasks(src.family, seed, n, dict(src.knobs), source=src.name, exclude=exclude)
        agent = {"environment": "external_agent", "grader": "external_agent", "agent": src.agent, "budget_s": src.budget_s,
                 "python_path": list(src.python_path)}
        return [{**t, "metadata": {**t["metadata"], **agent}} for t in tasks]
    raise ValueError(f"unknown task source type {type(src).__name__}")


def load_split(src: Any, n_train: int, n_heldout: int) -> tuple[list[TaskSpec], list[TaskSpec]]:
    """(train, held-out) tasks of one source; the two are disjoint by prompt."""
    if isinstance(src, ReasoningGymSource) and src.family == "chain_sum":
        from trajmesh.envs import chain_sum

        train_d, held_d = chain_sum.make_split(n_train, n_heldout, **src.knobs)
        env = "chain_sum"
    else:
        held_d = _draw(src, HELDOUT_SEED, n_heldout, set())
        held_prompts = {t["prompt"] for t in held_d}
        train_d = [t for t in _draw(src, TRAIN_SEED, n_train, held_prompts) if t["prompt"] not in held_prompts]
        if not train_d:
            raise ValueError(f"tasks.sources[{src.name}]: no training task outside the held-out split")
        env = ""

    def spec(t: dict[str, Any]) -> TaskSpec:
        environment = env or t["metadata"]["environment"]
        return TaskSpec(t["task_id"], src.name, src.revision, t["prompt"], t["answer"], environment, t["metadata"])

    return [spec(t) for t in train_d], [spec(t) for t in held_d]


class TaskSampler:
    """Weighted mixture over sources; each draw picks a source by weight, then a task uniformly."""

    def __init__(self, cfg: TasksConfig, seed: int) -> None:
        self.seed = seed
        self.sources = cfg.sources
        self.weights = [s.weight for s in cfg.sources]
        self.train: list[list[TaskSpec]] = []
        self.order: list[list[int]] = []
        for k, src in enumerate(cfg.sources):
            train, _ = load_split(src, cfg.train_size, cfg.heldout_size)
            self.train.append(train)
            order = list(range(len(train)))
            random.Random(seed * 7919 + k).shuffle(order)
            self.order.append(order)

    def task_at(self, cursor: int) -> TaskSpec:
        rng = random.Random(self.seed * 1_000_003 + cursor)
        k = rng.choices(range(len(self.sources)), weights=self.weights)[0]
        # A deterministic function of the cursor alone (so resume needs only the cursor).
        return self.train[k][self.order[k][rng.randrange(len(self.order[k]))]]
