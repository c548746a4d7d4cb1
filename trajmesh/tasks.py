"""Task sources and the mixture sampler the store draws from (no torch).

`TaskSampler.task_at(i)` is a pure function of (config, seed, i): the store keeps only the cursor
i in Redis, so a restarted store continues the same sequence. Every source type's generator is its
plug-in's (`trajmesh.plugins`); `load_split` draws the held-out split first (its own seed) and keeps training disjoint.

Curriculum (a source's ``curriculum``, on the pass rates in ``tasks.profile``): `bucket` sorts a
task by its pass rate; all-pass / all-fail tasks can be dropped, and a ``target_band`` weights the
tasks inside it 1 and the others ``outside_band_weight``. With ``tasks.reprofile_every_versions``
the store feeds the run's graded outcomes to `TaskSampler.observe` and calls `maybe_reprofile`, so
the sequence is a function of the cursor and the profile in effect (RUN_DIR/task_profile.json, which
a restarted store reloads). `MixtureTracker` counts what the store admitted per source against the
normalised weights.
"""

from __future__ import annotations

import bisect
import itertools
import json
import random
from dataclasses import dataclass, field
from pathlib import Path
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


BUCKETS = ("all_fail", "below_band", "in_band", "above_band", "all_pass")


def bucket(pass_rate: float, band: tuple[float, float] | None) -> str:
    """A task's difficulty bucket: all_fail (0), all_pass (1), else where it lies against the
    target band [lo, hi] (in_band without one)."""
    if pass_rate <= 0.0:
        return "all_fail"
    if pass_rate >= 1.0:
        return "all_pass"
    if band is None or band[0] <= pass_rate <= band[1]:
        return "in_band"
    return "below_band" if pass_rate < band[0] else "above_band"


def profile_key(source: str, task_id: str) -> str:
    return f"{source}/{task_id}"


def profile_path(tasks_cfg: TasksConfig, run_dir: str | Path) -> Path:
    """The profile a run reads: `tasks.profile`, else RUN_DIR.task_profile.json beside the run dir
    (outside it: `trajmesh train` starts only in an empty run dir)."""
    if tasks_cfg.profile:
        return Path(tasks_cfg.profile)
    run = Path(run_dir)
    return run.with_name(run.name + ".task_profile.json")


def read_profile(path: str | Path) -> dict[str, tuple[int, int]]:
    """{source/task_id: (passes, samples)} from a profile file (`write_profile`); {} if absent."""
    p = Path(path)
    if not p.is_file():
        return {}
    return {k: (int(v["passes"]), int(v["samples"])) for k, v in json.loads(p.read_text())["tasks"].items()}


def write_profile(path: str | Path, counts: dict[str, tuple[int, int]], **meta: Any) -> None:
    """Writes {"tasks": {source/task_id: {"passes", "samples", "pass_rate"}}, **meta} (atomically)."""
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    body = {**meta, "tasks": {k: {"passes": n, "samples": m, "pass_rate": n / m if m else 0.0}
                              for k, (n, m) in sorted(counts.items())}}
    tmp = p.with_suffix(p.suffix + ".tmp")
    tmp.write_text(json.dumps(body, indent=1, sort_keys=True) + "\n")
    tmp.replace(p)


def curriculum_weights(tasks: list[TaskSpec], rates: dict[str, float], curriculum: Any) -> list[float]:
    """Sampling weight of each task: 0 for a dropped bucket, 1 inside the target band (or without
    one, or unprofiled), `outside_band_weight` outside it."""
    out = []
    for t in tasks:
        rate = rates.get(profile_key(t.source, t.task_id))
        if rate is None:
            out.append(1.0)
            continue
        b = bucket(rate, curriculum.target_band)
        out.append(0.0 if b in curriculum.drop else 1.0 if b == "in_band" or curriculum.target_band is None
                   else curriculum.outside_band_weight)
    return out


class TaskSampler:
    """Weighted mixture over sources; each draw picks a source by weight, then a task: uniformly,
    or by its curriculum weight when the source has a curriculum and profiled tasks."""

    def __init__(self, cfg: TasksConfig, seed: int, profile_out: str | Path | None = None,
                 profile_in: str | Path | None = None) -> None:
        self.seed = seed
        self.sources = cfg.sources
        self.weights = [s.weight for s in cfg.sources]
        self.pass_reward = cfg.profile_pass_reward
        self.reprofile_every = cfg.reprofile_every_versions
        self.min_samples = cfg.reprofile_min_samples
        self.profile_out = Path(profile_out) if profile_out is not None else None
        """Where `maybe_reprofile` writes the profile in effect (RUN_DIR/task_profile.json)."""
        self.profile: dict[str, tuple[int, int]] = {}
        """source/task_id → (passes, samples): `profile_in` (default `tasks.profile`), then the
        store's own re-profile at `profile_out` if one exists (a restarted store continues it)."""
        for path in (profile_in if profile_in is not None else cfg.profile, self.profile_out):
            if path:
                self.profile.update(read_profile(path))
        self.observed: dict[str, list[int]] = {}
        """source/task_id → [passes, samples] since the last re-profile."""
        self.profiled_at = 0
        """The policy version of the last re-profile (0: none yet)."""
        self.train: list[list[TaskSpec]] = []
        self.order: list[list[int]] = []
        self.cum_weights: list[list[float] | None] = []
        for k, src in enumerate(cfg.sources):
            train, _ = load_split(src, cfg.train_size, cfg.heldout_size)
            self.train.append(train)
            order = list(range(len(train)))
            random.Random(seed * 7919 + k).shuffle(order)
            self.order.append(order)
        self._reweight()

    def _uses_curriculum(self, k: int) -> bool:
        c = self.sources[k].curriculum
        return bool(c.drop or c.target_band is not None)

    def pass_rates(self) -> dict[str, float]:
        return {key: n / m for key, (n, m) in self.profile.items() if m}

    def _reweight(self) -> None:
        """Each source's cumulative task weights (in sampler order) from the profile in effect."""
        rates = self.pass_rates()
        self.cum_weights = []
        for k, src in enumerate(self.sources):
            if not self._uses_curriculum(k) or not rates:
                self.cum_weights.append(None)
                continue
            w = curriculum_weights([self.train[k][i] for i in self.order[k]], rates, src.curriculum)
            if not any(w):
                raise ValueError(f"tasks.sources[{src.name}].curriculum leaves no task to train on "
                                 f"(drop {src.curriculum.drop}, band {src.curriculum.target_band})")
            self.cum_weights.append(list(itertools.accumulate(w)))

    def task_at(self, cursor: int) -> TaskSpec:
        rng = random.Random(self.seed * 1_000_003 + cursor)
        k = rng.choices(range(len(self.sources)), weights=self.weights)[0]
        # A deterministic function of the cursor (and the profile in effect), so resume needs only the cursor.
        cum = self.cum_weights[k]
        if cum is None:
            return self.train[k][self.order[k][rng.randrange(len(self.order[k]))]]
        j = bisect.bisect_right(cum, rng.random() * cum[-1])
        return self.train[k][self.order[k][min(j, len(cum) - 1)]]

    def kept(self, k: int) -> list[TaskSpec]:
        """Source k's training tasks its curriculum keeps (weight above 0)."""
        cum = self.cum_weights[k]
        if cum is None:
            return list(self.train[k])
        return [self.train[k][i] for i, (a, b) in zip(self.order[k], itertools.pairwise([0.0, *cum]), strict=True)
                if b > a]

    def observe(self, source: str, task_id: str, reward: float) -> None:
        """One graded outcome of a training task in this run (`task_id`: the sampler's id); kept only
        when the run re-profiles."""
        if self.reprofile_every <= 0:
            return
        seen = self.observed.setdefault(profile_key(source, task_id), [0, 0])
        seen[0] += int(reward >= self.pass_reward)
        seen[1] += 1

    def maybe_reprofile(self, version: int) -> bool:
        """At every `reprofile_every_versions`-th version: tasks with at least
        `reprofile_min_samples` outcomes since the last re-profile take their observed pass rate,
        the weights are rebuilt and the profile written. True when it re-profiled."""
        if self.reprofile_every <= 0 or version < self.profiled_at + self.reprofile_every:
            return False
        self.profiled_at = version
        fresh = {key: (n, m) for key, (n, m) in self.observed.items() if m >= self.min_samples}
        self.profile.update(fresh)
        for key in fresh:
            del self.observed[key]
        self._reweight()
        if self.profile_out is not None:
            write_profile(self.profile_out, self.profile, version=version, source="run outcomes")
        return True


class MixtureTracker:
    """Admitted tasks per source against the normalised mixture weights."""

    def __init__(self, sources: list[Any]) -> None:
        total = sum(s.weight for s in sources)
        self.weight_share = {s.name: s.weight / total for s in sources}
        self.admitted = dict.fromkeys(self.weight_share, 0)

    def admit(self, source: str) -> None:
        self.admitted[source] = self.admitted.get(source, 0) + 1

    def admitted_share(self) -> dict[str, float]:
        n = sum(self.admitted.values())
        return {s: (c / n if n else 0.0) for s, c in self.admitted.items()}

    def drift(self) -> float:
        """The largest |admitted share − weight share| over sources."""
        share = self.admitted_share()
        return max((abs(share.get(s, 0.0) - w) for s, w in self.weight_share.items()), default=0.0)
