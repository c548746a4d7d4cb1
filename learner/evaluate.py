"""Batched sampling with a KV cache, and held-out evaluation (accuracy, pass@k).

``sample_batch`` is the one token loop used both here and by the CPU torch engine
(``trajmesh.rollout.engine_server``): prompts are left-padded into one batch, prefilled once,
then decoded token by token with ``past_key_values``.

Log-probabilities: for a sampled row (temperature T > 0) the recorded value is
``log_softmax(logits / T)[token]`` over the full vocabulary, before top-k/top-p truncation — the
distribution at the sampling temperature (SGLang's default). For a greedy row (T = 0) it is
``log_softmax(logits)[token]``. The demo samples at T = 1, where this equals the learner's
``log π_θ(token)``; at other temperatures the learner must scale its logits by the same T.
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

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
    rank = torch.arange(probs_BV.shape[-1]).unsqueeze(0)
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
    """
    B = len(prompts)
    width = max(len(p) for p in prompts)
    input_ids_BT = torch.full((B, width), pad_id, dtype=torch.long)
    mask_BT = torch.zeros((B, width), dtype=torch.long)
    for i, p in enumerate(prompts):
        input_ids_BT[i, width - len(p) :] = torch.tensor(p, dtype=torch.long)
        mask_BT[i, width - len(p) :] = 1
    pos_BT = (mask_BT.cumsum(-1) - 1).clamp(min=0)
    temp_B = torch.tensor([p.temperature for p in params], dtype=torch.float32)
    greedy_B = temp_B <= GREEDY_EPS
    scale_B = torch.where(greedy_B, torch.ones_like(temp_B), temp_B)
    top_k_B = torch.tensor([p.top_k for p in params], dtype=torch.long)
    top_p_B = torch.tensor([p.top_p for p in params], dtype=torch.float32)
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
        mask_BT = torch.cat([mask_BT, torch.ones((B, 1), dtype=torch.long)], dim=1)
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
    """Unbiased pass@k from n samples with c correct (Chen et al. 2021)."""
    if n - c < k:
        return 1.0
    return 1.0 - math.prod((n - c - i) / (n - i) for i in range(k))


def evaluate(
    model: Any,
    tokenizer: Any,
    tasks: list[dict],
    *,
    temperature: float,
    samples: int = 1,
    max_new_tokens: int = 8,
    seed: int = 0,
    batch_size: int = 512,
    score_fn: Callable[[str, dict], float] | None = None,
) -> dict[str, Any]:
    """Accuracy (mean score over all samples = pass@1) and unbiased pass@k for k = 1, 2, 4, ..., samples.

    ``temperature=0`` is greedy (``samples`` is then forced to 1). Deterministic given ``seed``.
    """
    from trajmesh.learner.models import encode_prompt

    if score_fn is None:
        from trajmesh.envs.chain_sum import score as chain_sum_score

        score_fn = chain_sum_score
    if temperature <= GREEDY_EPS:
        samples = 1
    generator = torch.Generator().manual_seed(seed)
    rows = [(t, encode_prompt(tokenizer, t["prompt"])) for t in tasks for _ in range(samples)]
    rows.sort(key=lambda r: len(r[1]))  # similar lengths share a batch: less padding
    correct: dict[str, int] = {}
    total_score, total_tokens = 0.0, 0
    params = SamplingParams(temperature=temperature, max_new_tokens=max_new_tokens)
    for start in range(0, len(rows), batch_size):
        chunk = rows[start : start + batch_size]
        outs = sample_batch(
            model,
            [ids for _, ids in chunk],
            [params] * len(chunk),
            pad_id=tokenizer.pad_token_id,
            eos_id=tokenizer.eos_token_id,
            generator=generator,
        )
        for (task, _), o in zip(chunk, outs, strict=True):
            text = tokenizer.decode(o.output_ids, skip_special_tokens=True)
            s = score_fn(text, task)
            total_score += s
            total_tokens += len(o.output_ids)
            correct[task["task_id"]] = correct.get(task["task_id"], 0) + int(s >= 1.0)
    ks = sorted({2**i for i in range(int(math.log2(samples)) + 1)} | {samples})
    return {
        "accuracy": total_score / len(rows),
        "pass_at_k": {k: sum(pass_at_k(samples, c, k) for c in correct.values()) / len(correct) for k in ks},
        "n_tasks": len(correct),
        "samples": samples,
        "temperature": temperature,
        "mean_response_tokens": total_tokens / len(rows),
    }
