"""Task sources and the mixture sampler the store draws from (no torch).

`TaskSampler.task_at(i)` is a pure function of (config, seed, i): the store keeps only the cursor
i in Redis, so a restarted store continues the same sequence.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Any

from trajmesh.config import ReasoningGymSource, TasksConfig


@dataclass(frozen=True)
class TaskSpec:
    task_id: str
    source: str
    revision: str
    prompt: str
    answer: str
    environment: str
    metadata: dict[str, Any] = field(default_factory=dict)


def load_split(src: ReasoningGymSource, n_train: int, n_heldout: int) -> tuple[list[TaskSpec], list[TaskSpec]]:
    """(train, held-out) tasks of one source; the two are disjoint by prompt."""
    if src.family != "chain_sum":
        raise ValueError(
            f"tasks.sources[{src.name}]: family {src.family!r} is not supported yet (supported: chain_sum)"
        )
    from trajmesh.envs import chain_sum

    train, heldout = chain_sum.make_split(n_train, n_heldout, **src.knobs)

    def spec(t: dict[str, Any]) -> TaskSpec:
        return TaskSpec(t["task_id"], src.name, src.revision, t["prompt"], t["answer"], src.family, t["metadata"])

    return [spec(t) for t in train], [spec(t) for t in heldout]


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
