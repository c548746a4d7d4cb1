"""Held-out evaluation: every task played through the rollout's own episode layout, scored by its grader.

The episodes are played by ``play_episodes`` (rollout/agents/episode.py): the same ``EpisodeFormat`` the
rollout service feeds its engine (chat template or BOS + text, tool/user observation messages,
every stop id), the same environment classes (`envs/`, in-process), budgets and terminal reasons.
Each episode is scored by its source's grader (`graders/`): reasoning-gym ``score_answer``,
math-verify, search normalized exact match, workplace final state. The policy is a hook
(`Policy`): the model sampled in-process with ``sample_batch`` (rollout/engines/torch_sampler.py,
``ModelPolicy``) in `trajmesh train` with ``eval.in_mesh: false`` (evaluation in the launcher's
process, before any service is up), a scripted one in tests. This in-process loop is not the
mesh's: the evaluator service (services/evaluator.py) plays its episodes through the environment
service and has them graded by the grader service, as training does, and hands `source_figures`
its own pass runner. A run's held-out score comes from this loop only for what the rollout
itself plays in its own process (stateless environments, graders without the sandbox:
trajmesh/run/train.py `check_in_process` refuses the rest).

Above the episodes sits what both callers share: the held-out split of every source
(`heldout_tasks`), one pass's figures from its episodes' outcomes (`pass_figures`: an episode that
ended INFRA_FAILURE — environment or engine error, a sandbox that could not be set up, a grader
crash — is counted in ``infra_failures`` and left out of accuracy and pass@k, never scored as a
wrong answer), one source's greedy and sampled figures (`source_figures`, `evaluate_source`), the
pooled record and its selection score (`heldout_result`), the best-score tracker and regression
stop (`HeldoutTracker`) and the best-checkpoint snapshot (`keep_best`). The module imports without
torch (the launcher and `trajmesh inspect` read it).

Log-probabilities of ``sample_batch``: for a sampled row (temperature T > 0) the recorded value is
``log_softmax(logits / T)[token]`` over the full vocabulary, before top-k/top-p truncation — the
distribution at the sampling temperature (SGLang's default). For a greedy row (T = 0) it is
``log_softmax(logits)[token]``.
"""

from __future__ import annotations

import math
import os
import shutil
import statistics
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from trajmesh.rollout.agents.episode import Episode, EpisodeFormat, ModelPolicy, Policy, play_episodes

if TYPE_CHECKING:
    from trajmesh.config import RunConfig

PolicyFactory = Callable[[int], Policy]
"""A policy for one evaluation pass, given the pass's sampling seed."""
PassRunner = Callable[[float, int, int], dict[str, Any]]
"""One evaluation pass of a source: (temperature, samples per task, seed) -> its `pass_figures`."""
INFRA_FAILURE = "INFRA_FAILURE"
"""The terminal reason of an episode the infrastructure failed (never graded, never scored)."""


@dataclass(frozen=True)
class Outcome:
    """One held-out episode as the figures count it."""

    task_id: str
    """The held-out task's id."""
    reward: float | None
    """The grader's reward; None: an infra failure (not graded, not in accuracy or pass@k)."""
    tokens: int
    """Sampled tokens of the episode (every turn)."""
    terminal_reason: str
    """A `TerminalReason` name."""


def pass_figures(outcomes: list[Outcome], task_ids: list[str], samples: int) -> dict[str, Any]:
    """One pass's figures: accuracy (mean reward over the graded episodes = pass@1 for 0/1
    rewards; None when none was graded), unbiased pass@k per k over the tasks with at least k graded
    samples (a sample is correct when its reward is ≥ 1), the infra failures left out of both, the
    terminal reasons of every episode and the mean sampled tokens."""
    ids = list(dict.fromkeys(task_ids))
    graded = [o for o in outcomes if o.reward is not None]
    n = {t: 0 for t in ids}
    correct = {t: 0 for t in ids}
    for o in graded:
        n[o.task_id] += 1
        correct[o.task_id] += int(float(o.reward or 0.0) >= 1.0)
    reasons: dict[str, int] = {}
    for o in outcomes:
        reasons[o.terminal_reason] = reasons.get(o.terminal_reason, 0) + 1
    at_k: dict[int, float | None] = {}
    for k in pass_at_ks(samples):
        rows = [pass_at_k(n[t], correct[t], k) for t in ids if n[t] >= k]
        at_k[k] = sum(rows) / len(rows) if rows else None
    return {
        "accuracy": sum(float(o.reward or 0.0) for o in graded) / len(graded) if graded else None,
        "pass_at_k": at_k,
        "n_tasks": len(ids),
        "samples": samples,
        "graded": len(graded),
        "infra_failures": len(outcomes) - len(graded),
        "mean_response_tokens": sum(o.tokens for o in outcomes) / max(1, len(outcomes)),
        "terminal_reasons": dict(sorted(reasons.items())),
    }


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k from n samples with c correct (Chen et al. 2021): 1 − C(n−c, k) / C(n, k)."""
    if not 0 <= c <= n or not 1 <= k <= n:
        raise ValueError(f"pass@k needs 0 <= c <= n and 1 <= k <= n, got n={n} c={c} k={k}")
    if n - c < k:
        return 1.0
    return 1.0 - math.prod((n - c - i) / (n - i) for i in range(k))


def pass_at_ks(samples: int) -> list[int]:
    """The k reported for `samples` per problem: 1, 2, 4, ... up to `samples`, and `samples` itself."""
    return sorted({2**i for i in range(int(math.log2(samples)) + 1)} | {samples})


def grade_episode(ep: Episode, fmt: EpisodeFormat, graders: dict[str, Any]) -> Any:
    """The task's own grader on what the policy sampled (as the grader service decodes it)."""
    from trajmesh.graders import Sample, grader_kind, make_grader

    turns = [ids for ids in ep.turn_ids if ids]
    flat = [t for ids in turns for t in ids]
    kind = grader_kind(ep.task)
    grader = graders.get(kind) or graders.setdefault(kind, make_grader(kind))
    tok = fmt.tokenizer
    sample = Sample(tok.decode(flat), [tok.decode(ids) for ids in turns],
                    bool(flat) and flat[-1] == tok.eos_token_id, list(ep.state_hashes), ep.terminal_reason)
    return grader.grade(sample, ep.task)


def evaluate_tasks(policy: Policy, fmt: EpisodeFormat, tasks: list[dict[str, Any]], *, temperature: float,
                   top_p: float = 1.0, samples: int = 1, max_new_tokens: int = 8, max_turns: int = 1,
                   seed: int = 0) -> dict[str, Any]:
    """`pass_figures` of `tasks` played in-process (an episode ended INFRA_FAILURE is not graded).

    ``temperature=0`` is greedy (``samples`` is then forced to 1). Also returns the graders' and
    environments' revisions that ran.
    """
    from trajmesh.rollout.engines.torch_sampler import GREEDY_EPS

    if temperature <= GREEDY_EPS:
        samples = 1
    params = fmt.sampling(temperature, top_p, max_new_tokens)
    episodes = play_episodes(policy, fmt, tasks, params, max_turns=max_turns, samples=samples, seed=seed)
    graders: dict[str, Any] = {}
    outcomes = [Outcome(ep.task["task_id"],
                        None if ep.terminal_reason == INFRA_FAILURE else float(grade_episode(ep, fmt, graders).reward),
                        sum(len(ids) for ids in ep.turn_ids), ep.terminal_reason) for ep in episodes]
    return {
        **pass_figures(outcomes, [t["task_id"] for t in tasks], samples),
        "temperature": temperature,
        "top_p": top_p,
        "grader_revisions": {k: g.revision for k, g in sorted(graders.items())},
        "environment_revisions": dict(sorted({str(e.task.get("environment") or "single_answer"): e.env.revision
                                              for e in episodes}.items())),
    }


def evaluate(
    model: Any,
    model_dir: str,
    tasks: list[dict],
    *,
    temperature: float,
    samples: int = 1,
    max_new_tokens: int = 8,
    max_turns: int = 1,
    top_p: float = 1.0,
    seed: int = 0,
    batch_size: int = 512,
) -> dict[str, Any]:
    """`evaluate_tasks` with a model and the episode format of `model_dir` (its tokenizer, chat
    template and stop ids, as the rollout loads them). Deterministic given ``seed``."""
    fmt = EpisodeFormat.load(model_dir)
    tok = fmt.tokenizer
    policy = ModelPolicy(model, pad_id=tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id,
                         eos_id=tok.eos_token_id, seed=seed, batch_size=batch_size)
    return evaluate_tasks(policy, fmt, tasks, temperature=temperature, top_p=top_p,
                          samples=samples, max_new_tokens=max_new_tokens, max_turns=max_turns, seed=seed)


def heldout_tasks(cfg: RunConfig) -> dict[str, list[dict[str, Any]]]:
    """The held-out split of every source, by source name (each evaluated and reported on its own)."""
    from trajmesh.tasks import load_split

    out: dict[str, list[dict[str, Any]]] = {}
    for src in cfg.tasks.sources:
        _, held = load_split(src, 8, cfg.tasks.heldout_size)
        out[src.name] = [{"prompt": t.prompt, "answer": t.answer, "task_id": t.task_id, "source": t.source,
                          "environment": t.environment, "metadata": t.metadata} for t in held]
    return out


def eval_budgets(cfg: RunConfig) -> tuple[int, int]:
    """(tokens per turn, turns per episode) of the held-out evaluation."""
    sp = cfg.tasks.sampling
    return cfg.eval.max_new_tokens or sp.max_new_tokens, cfg.eval.max_turns or sp.max_turns


def evaluate_source(make_policy: PolicyFactory, fmt: EpisodeFormat, tasks: list[dict[str, Any]], cfg: RunConfig,
                    samples: int, noise_seeds: int = 0) -> dict[str, Any]:
    """`source_figures` of one source played in-process: `make_policy(seed)` gives the policy of
    each pass, `fmt` the rollout's `EpisodeFormat`."""
    max_new_tokens, max_turns = eval_budgets(cfg)

    def run(temperature: float, n: int, seed: int) -> dict[str, Any]:
        return evaluate_tasks(make_policy(seed), fmt, tasks, temperature=temperature, top_p=cfg.eval.top_p,
                              samples=n, max_new_tokens=max_new_tokens, max_turns=max_turns, seed=seed)

    return source_figures(run, cfg, samples, noise_seeds)


def source_figures(run: PassRunner, cfg: RunConfig, samples: int, noise_seeds: int = 0) -> dict[str, Any]:
    """Greedy and sampled figures of one source (plus `noise_seeds` one-sample sampled accuracies),
    each pass played by `run` (in-process, or through the services: services/evaluator.py). The
    infra failures of each pass are reported beside its accuracy (`greedy_infra_failures`,
    `sampled_infra_failures`); an accuracy is None when every episode of its pass failed so."""
    greedy = run(0.0, 1, cfg.seed)
    sampled = run(cfg.eval.temperature, samples, cfg.seed + 1)
    out: dict[str, Any] = {"greedy_accuracy": greedy["accuracy"], "sampled_accuracy": sampled["accuracy"],
                           "n_tasks": sampled["n_tasks"], "samples": sampled["samples"],
                           "greedy_infra_failures": greedy["infra_failures"],
                           "sampled_infra_failures": sampled["infra_failures"],
                           "terminal_reasons": sampled["terminal_reasons"],
                           "mean_response_tokens": sampled["mean_response_tokens"]}
    for k, v in sampled["pass_at_k"].items():
        out[f"sampled_pass_at_{k}"] = v
    if noise_seeds:
        out["sampled_accuracy_seeds"] = [run(cfg.eval.temperature, 1, cfg.seed + 100 + i)["accuracy"]
                                         for i in range(noise_seeds)]
    return out


def pooled(per_source: dict[str, dict[str, Any]], key: str) -> float | None:
    """Problem-weighted mean of a per-source figure (the pooled headline numbers)."""
    rows = [(r[key], r["n_tasks"]) for r in per_source.values() if r.get(key) is not None]
    n = sum(w for _, w in rows)
    return sum(v * w for v, w in rows) / n if n else None


def heldout_score(result: dict[str, Any], metric: str) -> float | None:
    """The selection score of an evaluation: the mean over sources of `<metric>_accuracy`, over the
    sources that have one (None: no source graded a single episode, every one an infra failure)."""
    accs = [float(r[f"{metric}_accuracy"]) for r in result["heldout"].values() if r.get(f"{metric}_accuracy") is not None]
    return sum(accs) / len(accs) if accs else None


def heldout_result(per: dict[str, dict[str, Any]], metric: str, noise_seeds: int = 0) -> dict[str, Any]:
    """One evaluation's record from its per-source figures (`heldout.<source>`): the pooled headline
    keys, the infra failures, the seed noise with `noise_seeds`, and the selection `score` by
    `metric` (absent when no source has a figure for it)."""
    out: dict[str, Any] = {"heldout": per}
    for key in ("greedy_accuracy", "sampled_accuracy", *(k for k in next(iter(per.values())) if "pass_at" in k)):
        out[key] = pooled(per, key)
    for key in ("greedy_infra_failures", "sampled_infra_failures"):
        out[key] = sum(int(r.get(key, 0)) for r in per.values())
    if noise_seeds:
        accs = [a for a in (pooled({name: {"seed": r["sampled_accuracy_seeds"][i], "n_tasks": r["n_tasks"]}
                                       for name, r in per.items()}, "seed") for i in range(noise_seeds))
                if a is not None]
        out["sampled_accuracy_seeds"] = accs
        out["sampled_accuracy_seed_std"] = statistics.stdev(accs) if len(accs) > 1 else 0.0
    score = heldout_score(out, metric)
    if score is not None:  # absent: no source graded an episode (nothing to compare or stop on)
        out["score"] = score
    return out


class HeldoutTracker:
    """The best held-out score so far and the regression stop (pure: no I/O).

    A regression is a score more than `margin` below the best; `confirmations` consecutive ones
    stop the run (one noisy evaluation does not). A new best resets the count."""

    def __init__(self, margin: float | None, confirmations: int) -> None:
        self.margin = margin
        self.confirmations = confirmations
        self.best: dict[str, Any] | None = None
        self.below = 0

    def observe(self, version: int, score: float) -> tuple[bool, bool]:
        """(new best?, stop?) after an evaluation of `version` scoring `score`."""
        if self.best is None or score > self.best["score"]:
            self.best = {"version": version, "score": score}
            self.below = 0
            return True, False
        if self.margin is not None and score < self.best["score"] - self.margin:
            self.below += 1
        else:
            self.below = 0
        return False, self.margin is not None and self.below >= self.confirmations

    def regression_message(self, metric: str, score: float) -> str:
        """What a confirmed regression stop says (stop_reason.json)."""
        best = self.best or {}
        return (f"held-out {metric} score {score:.4f} more than {self.margin} below the best "
                f"{best.get('score', float('nan')):.4f} (version {best.get('version')}) "
                f"on {self.below} consecutive evaluations")


def _link_or_copy(src: str, dst: str) -> None:
    """Hard link (the learner never rewrites a published file: each version is a new directory,
    so a link is a snapshot and costs no space); a copy across file systems."""
    try:
        os.link(src, dst)
    except OSError:
        shutil.copy2(src, dst)


def keep_best(run_dir: Path, weights: Path) -> Path:
    """Snapshots a weights dir as RUN_DIR/best (temp dir + rename): the learner prunes old versions."""
    best, tmp = run_dir / "best", run_dir / ".best.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    shutil.copytree(weights, tmp, copy_function=_link_or_copy)
    shutil.rmtree(best, ignore_errors=True)
    tmp.replace(best)
    return best
