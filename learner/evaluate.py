"""Batched sampling with a KV cache, and held-out evaluation through the environment loop (accuracy, pass@k).

``sample_batch`` (rollout/torch_sampler.py, beside the CPU torch engine's own loop that shares its
helpers) is held-out evaluation's token loop: prompts are left-padded into one batch, prefilled once,
then decoded token by token with ``past_key_values``.

Log-probabilities: for a sampled row (temperature T > 0) the recorded value is
``log_softmax(logits / T)[token]`` over the full vocabulary, before top-k/top-p truncation — the
distribution at the sampling temperature (SGLang's default). For a greedy row (T = 0) it is
``log_softmax(logits)[token]``. The demo samples at T = 1, where this equals the learner's
``log π_θ(token)``; at other temperatures the learner must scale its logits by the same T.

Held-out evaluation (``evaluate_tasks``) plays every task through its own environment (`envs/`,
in-process: tools and the sandbox included) for up to the turn budget and scores it with its own
grader (`graders/`): reasoning-gym ``score_answer``, math-verify, search normalized exact match,
workplace final state. The policy is a hook (`Policy`): the model here, a scripted one in tests.
"""

from __future__ import annotations

import math
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
from trajmesh.rollout.torch_sampler import GREEDY_EPS, Sampled, SamplingParams, sample_batch


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


# --------------------------------------------------------------------------- the evaluation loop
#
#   held-out task ── env.reset (envs/ registry, in-process) ── <bos> + observation tokens
#        ▲                                                        │ policy.generate (one turn, batched)
#        └── observation tokens (loss mask 0 in training) ◀── env.step(decoded turn) ── done?
#                                                                 │ yes / budget spent
#                                            source's grader (graders/ registry) ── reward ≥ 1: correct
#
# The same loop as rollout's `run_episode` (services/rollout.py), without the mesh: the same
# environment classes and graders, the same context layout, budgets and terminal reasons.


class TextCodec(Protocol):
    """What the loop needs of a tokenizer (`trajmesh.tokenizer.TextTokenizer` has it)."""

    eos_token_id: int
    bos_token_id: int | None

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: list[int]) -> str: ...


class Policy(Protocol):
    """One sampled turn per context: the hook a scripted policy replaces the model with in tests."""

    def generate(self, contexts: list[list[int]], params: SamplingParams) -> list[Sampled]: ...


class ModelPolicy:
    """A causal LM sampled with `sample_batch`; contexts of similar length share a batch."""

    def __init__(self, model: Any, *, pad_id: int, eos_id: int, seed: int, batch_size: int = 512) -> None:
        self.model = model
        self.pad_id, self.eos_id, self.batch_size = pad_id, eos_id, batch_size
        self.generator = torch.Generator(device=next(model.parameters()).device).manual_seed(seed)

    def generate(self, contexts: list[list[int]], params: SamplingParams) -> list[Sampled]:
        order = sorted(range(len(contexts)), key=lambda i: len(contexts[i]))
        out: list[Sampled] = [Sampled() for _ in contexts]
        for start in range(0, len(order), self.batch_size):
            idx = order[start : start + self.batch_size]
            rows = sample_batch(self.model, [contexts[i] for i in idx], [params] * len(idx), pad_id=self.pad_id,
                                eos_id=self.eos_id, generator=self.generator)
            for i, row in zip(idx, rows, strict=True):
                out[i] = row
        return out


@dataclass
class Episode:
    """One held-out attempt: the policy's turns, the environment's state hashes, how it ended."""

    task: dict[str, Any]
    env: Any
    context: list[int]
    state_hashes: list[str]
    turn_ids: list[list[int]] = field(default_factory=list)
    terminal_reason: str = ""
    """EOS, ENV_DONE, MAX_TOKENS, MAX_TURNS or what the environment reports (SANDBOX_ERROR); "" while live."""


def _start(task: dict[str, Any], seed: int, codec: TextCodec) -> Episode:
    from trajmesh.envs.base import make_environment

    env = make_environment(str(task.get("environment") or "single_answer"))
    obs, h = env.reset(task, seed)
    bos = [codec.bos_token_id] if codec.bos_token_id is not None else []
    return Episode(task, env, bos + codec.encode(obs), [h])


def _advance(ep: Episode, out: Sampled, codec: TextCodec) -> None:
    """Applies one sampled turn: a turn cut by the token budget ends the episode unseen by the
    environment (MAX_TOKENS); otherwise the environment steps and either ends it or answers."""
    ids = list(out.output_ids)
    ep.context += ids
    ep.turn_ids.append(ids)
    if (out.finish_reason or {}).get("type") != "stop":
        ep.terminal_reason = "MAX_TOKENS"
        return
    res = ep.env.step(codec.decode(ids))
    ep.state_hashes.append(res.state_hash)
    if res.done:
        info = res.info or {}
        ep.terminal_reason = str(info.get("terminal_reason") or
                                 ("EOS" if ids and ids[-1] == codec.eos_token_id else "ENV_DONE"))
        return
    ep.context += codec.encode(res.observation)


def run_episodes(policy: Policy, codec: TextCodec, tasks: list[dict[str, Any]], params: SamplingParams, *,
                 max_turns: int, samples: int = 1, seed: int = 0, workers: int = 4) -> list[Episode]:
    """`samples` episodes per task, played turn by turn in lock step (one batched generate per turn).

    Steps of environments that block (sandboxed code: no `inline` attribute, as in the environment
    service) run on `workers` threads; each step touches only its own episode."""
    episodes = [_start(t, seed + k, codec) for t in tasks for k in range(samples)]
    with ThreadPoolExecutor(max_workers=max(1, workers)) as pool:
        for _ in range(max(1, max_turns)):
            live = [e for e in episodes if not e.terminal_reason]
            if not live:
                break
            pairs = list(zip(live, policy.generate([e.context for e in live], params), strict=True))
            for ep, out in pairs:
                if getattr(ep.env, "inline", False):
                    _advance(ep, out, codec)
            blocking = [(ep, out) for ep, out in pairs if not getattr(ep.env, "inline", False)]
            list(pool.map(lambda pair: _advance(pair[0], pair[1], codec), blocking))
    for ep in episodes:
        ep.terminal_reason = ep.terminal_reason or "MAX_TURNS"
    return episodes


def grade_episode(ep: Episode, codec: TextCodec, graders: dict[str, Any]) -> Any:
    """The task's own grader on what the policy sampled (as the grader service decodes it)."""
    from trajmesh.graders import Sample, grader_kind, make_grader

    turns = [ids for ids in ep.turn_ids if ids]
    flat = [t for ids in turns for t in ids]
    kind = grader_kind(ep.task)
    grader = graders.get(kind) or graders.setdefault(kind, make_grader(kind))
    sample = Sample(codec.decode(flat), [codec.decode(ids) for ids in turns],
                    bool(flat) and flat[-1] == codec.eos_token_id, list(ep.state_hashes), ep.terminal_reason)
    return grader.grade(sample, ep.task)


def evaluate_tasks(policy: Policy, codec: TextCodec, tasks: list[dict[str, Any]], *, temperature: float,
                   top_p: float = 1.0, samples: int = 1, max_new_tokens: int = 8, max_turns: int = 1,
                   seed: int = 0) -> dict[str, Any]:
    """Accuracy (mean reward over all episodes = pass@1 for 0/1 rewards) and unbiased pass@k.

    ``temperature=0`` is greedy (``samples`` is then forced to 1). A problem's sample counts as
    correct for pass@k when its reward is ≥ 1. Also returns the graders' and environments'
    revisions that ran, and the terminal reasons.
    """
    if temperature <= GREEDY_EPS:
        samples = 1
    params = SamplingParams(temperature=temperature, top_p=top_p, max_new_tokens=max_new_tokens,
                            stop_token_ids=(codec.eos_token_id,))
    episodes = run_episodes(policy, codec, tasks, params, max_turns=max_turns, samples=samples, seed=seed)
    graders: dict[str, Any] = {}
    correct: dict[str, int] = {t["task_id"]: 0 for t in tasks}
    total, tokens = 0.0, 0
    reasons: dict[str, int] = {}
    for ep in episodes:
        reward = float(grade_episode(ep, codec, graders).reward)
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


class _HFCodec:
    """A Hugging Face tokenizer seen as a `TextCodec` (special tokens skipped on decode)."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.eos_token_id = int(tokenizer.eos_token_id)
        self.bos_token_id = tokenizer.bos_token_id

    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def decode(self, ids: list[int]) -> str:
        return str(self.tokenizer.decode(ids, skip_special_tokens=True))


def evaluate(
    model: Any,
    tokenizer: Any,
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
    """`evaluate_tasks` with a model and its Hugging Face tokenizer. Deterministic given ``seed``."""
    policy = ModelPolicy(model, pad_id=tokenizer.pad_token_id, eos_id=tokenizer.eos_token_id, seed=seed,
                         batch_size=batch_size)
    return evaluate_tasks(policy, _HFCodec(tokenizer), tasks, temperature=temperature, top_p=top_p,
                          samples=samples, max_new_tokens=max_new_tokens, max_turns=max_turns, seed=seed)
