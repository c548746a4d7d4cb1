"""Held-out evaluation: every task played through the rollout's own episode layout, scored by its grader.

The episodes are played by ``play_episodes`` (rollout/episode.py): the same ``EpisodeFormat`` the
rollout service feeds its engine (chat template or BOS + text, tool/user observation messages,
every stop id), the same environment classes (`envs/`, in-process: tools and the sandbox included),
budgets and terminal reasons. Each episode is scored by its source's grader (`graders/`):
reasoning-gym ``score_answer``, math-verify, search normalized exact match, workplace final state.
The policy is a hook (`Policy`): the model sampled in-process with ``sample_batch``
(rollout/torch_sampler.py, ``ModelPolicy``), a scripted one in tests.

Log-probabilities of ``sample_batch``: for a sampled row (temperature T > 0) the recorded value is
``log_softmax(logits / T)[token]`` over the full vocabulary, before top-k/top-p truncation — the
distribution at the sampling temperature (SGLang's default). For a greedy row (T = 0) it is
``log_softmax(logits)[token]``.
"""

from __future__ import annotations

import math
from typing import Any

from trajmesh.rollout.episode import Episode, EpisodeFormat, ModelPolicy, Policy, play_episodes
from trajmesh.rollout.torch_sampler import GREEDY_EPS


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
    """Accuracy (mean reward over all episodes = pass@1 for 0/1 rewards) and unbiased pass@k.

    ``temperature=0`` is greedy (``samples`` is then forced to 1). A problem's sample counts as
    correct for pass@k when its reward is ≥ 1. Also returns the graders' and environments'
    revisions that ran, and the terminal reasons.
    """
    if temperature <= GREEDY_EPS:
        samples = 1
    params = fmt.sampling(temperature, top_p, max_new_tokens)
    episodes = play_episodes(policy, fmt, tasks, params, max_turns=max_turns, samples=samples, seed=seed)
    graders: dict[str, Any] = {}
    correct: dict[str, int] = {t["task_id"]: 0 for t in tasks}
    total, tokens = 0.0, 0
    reasons: dict[str, int] = {}
    for ep in episodes:
        reward = float(grade_episode(ep, fmt, graders).reward)
        total += reward
        tokens += sum(len(ids) for ids in ep.turn_ids)
        correct[ep.task["task_id"]] += int(reward >= 1.0)
        reasons[ep.terminal_reason] = reasons.get(ep.terminal_reason, 0) + 1
    n = max(1, len(episodes))
    return {
        "accuracy": total / n,
        "pass_at_k": {k: sum(pass_at_k(samples, c, k) for c in correct.values()) / max(1, len(correct))
                      for k in pass_at_ks(samples)},
        "n_tasks": len(correct),
        "samples": samples,
        "temperature": temperature,
        "top_p": top_p,
        "mean_response_tokens": tokens / n,
        "terminal_reasons": dict(sorted(reasons.items())),
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
