"""The torch engine's token loop, with SGLang's request semantics (the ones the rollout relies on).

One left-padded batch, prefilled once, decoded token by token with the KV cache. Per row, after
each new token is appended, the finish checks run in SGLang's order (``Req.check_finished`` in
``python/sglang/srt/managers/schedule_batch.py``): **abort first** (a pause that lands on the
step that sampled EOS returns that EOS with ``finish_reason`` abort — the client must look at the
last token before resubmitting), then ``max_new_tokens``, then stop token ids / EOS, then string
``stop`` sequences (matched on the decoded tail; the token stays in ``output_ids``).

Seeds: a row with ``sampling_seed`` draws each token from a generator seeded by
(seed, absolute position), so the same weights, prompt and seed give the same tokens however
requests are batched, and a request resumed after an abort (prompt + partial output) continues
exactly as the uninterrupted one would have. Rows without a seed share the engine's generator.

Log-probs: ``log_softmax(logits / T)[token]`` over the full vocabulary (greedy: T = 1), the same
convention as ``sample_batch`` below (held-out evaluation's sampler, ``ModelPolicy`` in rollout/agents/episode.py) and the learner's ``token_logprobs`` at temperature T.
A row under a grammar constraint (SGLang's ``json_schema`` / ``regex`` / ``ebnf``) has its
disallowed tokens' logits set to -inf first, so its log-probs are of the masked distribution.
"""

from __future__ import annotations

import hashlib
import inspect
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from trajmesh.rollout.engines.grammar import constraint_of

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


DEFAULT_MAX_NEW_TOKENS = 128  # SGLang's default


@dataclass(frozen=True)
class RequestSampling:
    """SGLang ``sampling_params`` as the torch engine honours them (one request)."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    """-1: no limit."""
    max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS
    stop_token_ids: tuple[int, ...] = ()
    stop: tuple[str, ...] = ()
    """String stop sequences, matched on the decoded output."""
    ignore_eos: bool = False
    sampling_seed: int | None = None
    """Per-request seed (SGLang ``sampling_seed``); None: the engine's shared generator."""
    constraint: tuple[str, str] | None = None
    """(kind, text) of SGLang's ``json_schema`` / ``regex`` / ``ebnf`` (rollout/engines/grammar.py); None: free."""

    @staticmethod
    def parse(raw: dict[str, Any] | None) -> RequestSampling:
        """From a JSON ``sampling_params`` dict; ValueError on what the engine cannot honour."""
        raw = {k: v for k, v in (raw or {}).items() if v is not None}
        if int(raw.get("n", 1)) != 1:
            raise ValueError("n > 1 is not supported; send a batch of input_ids instead")
        stop = raw.get("stop") or ()
        top_k = int(raw.get("top_k", -1))
        seed = raw.get("sampling_seed")
        return RequestSampling(
            temperature=float(raw.get("temperature", 1.0)),
            top_p=float(raw.get("top_p", 1.0)),
            top_k=top_k if top_k > 0 else -1,
            max_new_tokens=int(raw.get("max_new_tokens", DEFAULT_MAX_NEW_TOKENS)),
            stop_token_ids=tuple(int(t) for t in (raw.get("stop_token_ids") or ())),
            stop=(stop,) if isinstance(stop, str) else tuple(str(s) for s in stop),
            ignore_eos=bool(raw.get("ignore_eos", False)),
            sampling_seed=None if seed is None else int(seed),
            constraint=constraint_of(raw),
        )


def position_generator(seed: int, position: int) -> torch.Generator:
    """The generator a seeded row draws the token at `position` from."""
    digest = hashlib.blake2b(f"{seed}:{position}".encode(), digest_size=8).digest()
    return torch.Generator().manual_seed(int.from_bytes(digest, "little") & ((1 << 63) - 1))


class _Rows:
    """Per-row decode state: outputs, stop sets and the finish checks in SGLang's order."""

    def __init__(self, prompts: list[list[int]], params: list[RequestSampling], eos_ids: set[int],
                 decode: Callable[[list[int]], str], constraints: list[Any] | None = None) -> None:
        self.prompts, self.params, self.decode = prompts, params, decode
        self.constraints = constraints or [None] * len(prompts)
        """Per row a grammar state (``grammar.RowConstraint``: ``mask``, ``accept``) or None."""
        self.out = [Sampled() for _ in prompts]
        self.stops = [set(p.stop_token_ids) | (set() if p.ignore_eos else eos_ids) for p in params]
        self.live = [p.max_new_tokens > 0 for p in params]
        for i, p in enumerate(params):
            if p.max_new_tokens <= 0:
                self.out[i].finish_reason = {"type": "length", "length": 0}

    def append(self, i: int, token: int, logp: float, aborted: bool) -> None:
        o, p = self.out[i], self.params[i]
        if self.constraints[i] is not None:
            self.constraints[i].accept(token)
        o.output_ids.append(token)
        o.logprobs.append(logp)
        if aborted:
            o.finish_reason = {"type": "abort", "message": "generation paused"}
        elif len(o.output_ids) >= p.max_new_tokens:
            o.finish_reason = {"type": "length", "length": p.max_new_tokens}
        elif token in self.stops[i]:
            o.finish_reason = {"type": "stop", "matched": token}
        elif p.stop:
            tail = self.decode(o.output_ids[-(max(len(s) for s in p.stop) + 1):])
            matched = next((s for s in p.stop if s in tail), None)
            if matched is not None:
                o.finish_reason = {"type": "stop", "matched": matched}
        if o.finish_reason is not None:
            self.live[i] = False

    def position(self, i: int) -> int:
        return len(self.prompts[i]) + len(self.out[i].output_ids)


def _sample_tokens(logits_BV: torch.Tensor, rows: _Rows, generator: torch.Generator | None
                   ) -> tuple[list[int], list[float]]:
    params = rows.params
    if any(c is not None for c in rows.constraints):  # disallowed tokens -inf before everything else
        logits_BV = torch.stack([c.mask(row) if c is not None and rows.live[i] else row
                                 for i, (c, row) in enumerate(zip(rows.constraints, logits_BV, strict=True))])
    temp_B = torch.tensor([p.temperature for p in params], dtype=torch.float32)
    greedy_B = temp_B <= GREEDY_EPS
    scale_B = torch.where(greedy_B, torch.ones_like(temp_B), temp_B)
    logp_BV = torch.log_softmax(logits_BV / scale_B.unsqueeze(1), dim=-1)
    probs_BV = _filter_top_k_top_p(logp_BV.exp(), torch.tensor([p.top_k for p in params]),
                                   torch.tensor([p.top_p for p in params], dtype=torch.float32))
    probs_BV = probs_BV.clamp(min=0) + 1e-30 * (probs_BV.sum(-1, keepdim=True) == 0)
    token_B = logits_BV.argmax(-1)
    shared = [i for i, p in enumerate(params) if rows.live[i] and not greedy_B[i] and p.sampling_seed is None]
    if shared:
        idx = torch.tensor(shared)
        token_B[idx] = torch.multinomial(probs_BV[idx], 1, generator=generator).squeeze(1)
    for i, p in enumerate(params):
        if rows.live[i] and not greedy_B[i] and p.sampling_seed is not None:
            gen = position_generator(p.sampling_seed, rows.position(i))
            token_B[i] = torch.multinomial(probs_BV[i], 1, generator=gen)[0]
    return token_B.tolist(), logp_BV.gather(1, token_B.unsqueeze(1)).squeeze(1).tolist()


@torch.no_grad()
def decode_batch(model: Any, prompts: list[list[int]], params: list[RequestSampling], *, pad_id: int,
                 eos_ids: set[int], decode: Callable[[list[int]], str], generator: torch.Generator | None = None,
                 should_abort: Callable[[], bool] | None = None, constraints: list[Any] | None = None
                 ) -> list[Sampled]:
    """Generate for every prompt; ``should_abort`` is polled after each decode step's tokens are
    appended (rows still running then end with finish_reason abort, their tokens kept).
    ``constraints``: per row a grammar state or None (structured outputs, rollout/engines/grammar.py); a
    constrained row's logits are masked before sampling and its log-probs are of the masked
    distribution, as SGLang's and vLLM's."""
    B, width = len(prompts), max(len(p) for p in prompts)
    ids_BT = torch.full((B, width), pad_id, dtype=torch.long)
    mask_BT = torch.zeros((B, width), dtype=torch.long)
    for i, p in enumerate(prompts):
        ids_BT[i, width - len(p):] = torch.tensor(p, dtype=torch.long)
        mask_BT[i, width - len(p):] = 1
    pos_BT = (mask_BT.cumsum(-1) - 1).clamp(min=0)
    rows = _Rows(prompts, params, eos_ids, decode, constraints)
    if not any(rows.live):
        return rows.out
    result = model(input_ids=ids_BT, attention_mask=mask_BT, position_ids=pos_BT, use_cache=True)
    cache_kw = _cache_kwarg(model)
    cache, next_pos_B = _returned_cache(result), pos_BT[:, -1] + 1
    logits_BV = result.logits[:, -1].float()
    while True:
        tokens, logps = _sample_tokens(logits_BV, rows, generator)
        aborted = should_abort is not None and should_abort()
        for i in range(B):
            if rows.live[i]:
                rows.append(i, tokens[i], logps[i], aborted)
        if not any(rows.live):
            return rows.out
        mask_BT = torch.cat([mask_BT, torch.ones((B, 1), dtype=torch.long)], dim=1)
        result = model(input_ids=torch.tensor(tokens).unsqueeze(1), attention_mask=mask_BT,
                       position_ids=next_pos_B.unsqueeze(1), use_cache=True, **{cache_kw: cache})
        cache, next_pos_B = _returned_cache(result), next_pos_B + 1
        logits_BV = result.logits[:, -1].float()
