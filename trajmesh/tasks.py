"""Task sources and the mixture sampler the store draws from (no torch).

`TaskSampler.task_at(i)` is a pure function of (config, seed, i): the store keeps only the cursor
i in Redis, so a restarted store continues the same sequence. Every source type's generator is its
plug-in's (`trajmesh.plugins`); `load_split` draws the held-out split first (its own seed) and keeps training disjoint.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Any

from trajmesh import plugins
from trajmesh.config import TasksConfig

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
    """``n`` task dicts of one source (its plug-in's generator); ``exclude`` holds prompts that must not appear."""
    return plugins.source(src.type).draw(src, seed, n, exclude)


def load_split(src: Any, n_train: int, n_heldout: int) -> tuple[list[TaskSpec], list[TaskSpec]]:
    """(train, held-out) tasks of one source; the two are disjoint by prompt. A plug-in with a
    `split` of its own draws both (chain_sum); otherwise the held-out split is drawn first with its
    own seed and training tasks exclude its prompts."""
    plugin = plugins.source(src.type)
    own = plugin.split(src, n_train, n_heldout) if plugin.split is not None else None
    if own is not None:
        train_d, held_d = own
    else:
        held_d = _draw(src, HELDOUT_SEED, n_heldout, set())
        held_prompts = {t["prompt"] for t in held_d}
        train_d = [t for t in _draw(src, TRAIN_SEED, n_train, held_prompts) if t["prompt"] not in held_prompts]
        if not train_d:
            raise ValueError(f"tasks.sources[{src.name}]: no training task outside the held-out split")

    def spec(t: dict[str, Any]) -> TaskSpec:
        environment = t["metadata"].get("environment") or plugin.default_environment
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
