"""Batched sampling with a KV cache, and held-out evaluation through the environment loop (accuracy, pass@k).

``sample_batch`` is held-out evaluation's token loop (the CPU torch engine's own loop,
``trajmesh.rollout.torch_sampler``, shares its helpers): prompts are left-padded into one batch,
prefilled once, then decoded token by token with ``past_key_values``.

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

import inspect
import math
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

GREEDY_EPS = 1e-5


def _cache_kwarg(model: Any) -> str:
    """``cache`` on transformers >= 5.2x, ``past_key_values`` before (the old name warns)."""
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


@dataclass
class SamplingParams:
    """Per-request sampling settings (SGLang ``sampling_params`` subset)."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1  # -1: no limit
    max_new_tokens: int = 16
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False


@dataclass
class Sampled:
    """One finished row: generated ids (stop token included), their log-probs, why it ended."""

    output_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    finish_reason: dict[str, Any] | None = None


def _filter_top_k_top_p(probs_BV: torch.Tensor, top_k_B: torch.Tensor, top_p_B: torch.Tensor) -> torch.Tensor:
    """Zero out tokens outside each row's top-k / nucleus; rows are renormalised by multinomial."""
    sorted_p, order = probs_BV.sort(dim=-1, descending=True)
    rank = torch.arange(probs_BV.shape[-1], device=probs_BV.device).unsqueeze(0)
    drop = (top_k_B.unsqueeze(1) > 0) & (rank >= top_k_B.unsqueeze(1))
    drop |= (sorted_p.cumsum(-1) - sorted_p) > top_p_B.unsqueeze(1)
    sorted_p = sorted_p.masked_fill(drop, 0.0)
    return torch.zeros_like(probs_BV).scatter(-1, order, sorted_p)


@torch.no_grad()
def sample_batch(
    model: Any,
    prompts: list[list[int]],
    params: list[SamplingParams],
    *,
    pad_id: int,
    eos_id: int,
    generator: torch.Generator | None = None,
    should_abort: Callable[[], bool] | None = None,
) -> list[Sampled]:
    """Generate for every prompt in one left-padded batch; each row stops on its own.

    ``should_abort`` is polled before every decode step; when it returns True the unfinished rows
    end with ``finish_reason={"type": "abort", ...}`` and keep the tokens they already have.
    Tensors live on the model's device (a GPU model samples there; ``generator`` must be on it).
    """
    B = len(prompts)
    width = max(len(p) for p in prompts)
    dev = next(model.parameters()).device
    input_ids_BT = torch.full((B, width), pad_id, dtype=torch.long)
    mask_BT = torch.zeros((B, width), dtype=torch.long)
    for i, p in enumerate(prompts):
        input_ids_BT[i, width - len(p) :] = torch.tensor(p, dtype=torch.long)
        mask_BT[i, width - len(p) :] = 1
    input_ids_BT, mask_BT = input_ids_BT.to(dev), mask_BT.to(dev)
    pos_BT = (mask_BT.cumsum(-1) - 1).clamp(min=0)
    temp_B = torch.tensor([p.temperature for p in params], dtype=torch.float32, device=dev)
    greedy_B = temp_B <= GREEDY_EPS
    scale_B = torch.where(greedy_B, torch.ones_like(temp_B), temp_B)
    top_k_B = torch.tensor([p.top_k for p in params], dtype=torch.long, device=dev)
    top_p_B = torch.tensor([p.top_p for p in params], dtype=torch.float32, device=dev)
    stops = [set(p.stop_token_ids) | (set() if p.ignore_eos else {eos_id}) for p in params]
    out = [Sampled() for _ in range(B)]
    live = [p.max_new_tokens > 0 for p in params]
    for i, sp in enumerate(params):
        if sp.max_new_tokens <= 0:
            out[i].finish_reason = {"type": "length", "length": 0}

    result = model(input_ids=input_ids_BT, attention_mask=mask_BT, position_ids=pos_BT, use_cache=True)
    cache_kw = _cache_kwarg(model)
    cache, next_pos_B = _returned_cache(result), pos_BT[:, -1] + 1
    logits_BV = result.logits[:, -1].float()
    while any(live):
        if should_abort is not None and should_abort():
            for i in range(B):
                if live[i]:
                    out[i].finish_reason = {"type": "abort", "message": "generation paused"}
                    live[i] = False
            break
        logp_BV = torch.log_softmax(logits_BV / scale_B.unsqueeze(1), dim=-1)
        probs_BV = _filter_top_k_top_p(logp_BV.exp(), top_k_B, top_p_B)
        sampled_B = torch.multinomial(
            probs_BV.clamp(min=0) + 1e-30 * (probs_BV.sum(-1, keepdim=True) == 0), 1, generator=generator
        ).squeeze(1)
        token_B = torch.where(greedy_B, logits_BV.argmax(-1), sampled_B)
        token_logp_B = logp_BV.gather(1, token_B.unsqueeze(1)).squeeze(1)
        tokens, token_logps = token_B.tolist(), token_logp_B.tolist()
        for i in range(B):
            if not live[i]:
                continue
            out[i].output_ids.append(tokens[i])
            out[i].logprobs.append(token_logps[i])
            if tokens[i] in stops[i]:
                out[i].finish_reason = {"type": "stop", "matched": tokens[i]}
                live[i] = False
            elif len(out[i].output_ids) >= params[i].max_new_tokens:
                out[i].finish_reason = {"type": "length", "length": params[i].max_new_tokens}
                live[i] = False
        if not any(live):
            break
        mask_BT = torch.cat([mask_BT, torch.ones((B, 1), dtype=torch.long, device=dev)], dim=1)
        result = model(
            input_ids=token_B.unsqueeze(1),
            attention_mask=mask_BT,
            position_ids=next_pos_B.unsqueeze(1),
            use_cache=True,
            **{cache_kw: cache},
        )
        cache, next_pos_B = _returned_cache(result), next_pos_B + 1
        logits_BV = result.logits[:, -1].float()
    return out


def _returned_cache(result: Any) -> Any:
    cache = getattr(result, "cache", None)
    return cache if cache is not None else result.past_key_values


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
