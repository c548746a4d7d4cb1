"""Token log-probs and entropy of a causal LM, computed in chunks along the sequence (docs/DESIGN.md §4b).

The naive computation materializes ``logits.float()``, ``log_softmax`` and ``softmax`` as fp32
``[B, T, V]`` tensors (with a 151,936-token vocabulary, ≈ 40 GB for 64 × 1k tokens). Here the
backbone runs once, then the output head, the fp32 upcast, log-softmax and entropy run on
``chunk_tokens`` positions at a time under activation checkpointing, so the extra memory is
O(chunk × V) in the forward and in the backward (the head is recomputed per chunk)::

    input_ids_BT ── backbone ──▶ hidden_BTH ──▶ for each chunk of N positions:
                                                  head(h_NH).float() / temperature → logits_NV
                                                  → log p(token), entropy   (checkpointed)

:class:`PolicyLogprobs` wraps an HF causal LM so that the train engine (DeepSpeed included) calls
this computation as the module's forward: ZeRO-3's parameter hooks and the engine's backward
bookkeeping see an ordinary forward. Models whose logits are not exactly ``lm_head(hidden)``
(Gemma-2's soft-capping, Cohere's ``logit_scale``, Granite's ``logits_scaling``) take the plain
forward, and only the log-softmax and entropy are chunked.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

from trajmesh.learner.microbatch import max_over_ranks

__all__ = ["DEFAULT_CHUNK_TOKENS", "PolicyLogprobs", "chunked_token_stats", "naive_token_stats", "policy_of"]

DEFAULT_CHUNK_TOKENS = 1024
# Config attributes that make an HF model's logits differ from lm_head(last hidden state).
_LOGIT_TRANSFORMS = ("final_logit_softcapping", "logit_scale", "logits_scaling")


def _chunk_stats(h_NH: Tensor, target_N: Tensor, head: nn.Module | None, temperature: float) -> tuple[Tensor, Tensor]:
    """(log p(target), entropy) of N positions; ``head`` None means ``h_NH`` already holds logits."""
    logits_NV = (head(h_NH) if head is not None else h_NH).float() / temperature
    logz_N = torch.logsumexp(logits_NV, dim=-1)
    logp_N = logits_NV.gather(-1, target_N[:, None]).squeeze(-1) - logz_N
    entropy_N = logz_N - (torch.softmax(logits_NV, dim=-1) * logits_NV).sum(-1)
    return logp_N, entropy_N


def _worth_recomputing(head: nn.Module | None, hidden: int) -> bool:
    """Whether a chunk's saved fp32 logits outweigh its hidden states (``head`` None: the input is
    the logits already, and the fp32 copies are what recomputation saves)."""
    weight = getattr(head, "weight", None)
    vocab = int(getattr(weight, "ds_shape", weight.shape)[0]) if weight is not None else hidden + 1
    return head is None or vocab > hidden


def chunked_token_stats(
    hidden_BTH: Tensor, input_ids_BT: Tensor, head: nn.Module | None, temperature: float, chunk_tokens: int,
    min_chunks: int = 0,
) -> tuple[Tensor, Tensor]:
    """(logp_BT, entropy_BT): position t scored by the output at t−1, position 0 gets 0.

    ``hidden_BTH`` is the last hidden state (``head`` maps it to logits) or, with ``head=None``,
    the logits themselves. Chunks of ``chunk_tokens`` flattened positions are checkpointed when
    grad is on and the vocabulary is wider than the hidden state (every real LM), so only
    ``hidden_BTH`` is kept for the backward; with a vocabulary narrower than the hidden state (the
    demo's 50 characters vs 128) the chunk's fp32 logits are smaller than its hidden states, and the
    recomputation would only cost time.

    ``min_chunks``: run at least that many chunks (the ones past the last position are empty): under
    ZeRO-3 every call of ``head`` gathers its weight, so every rank must make as many calls.
    """
    b, t = input_ids_BT.shape
    h_NH = hidden_BTH[:, :-1].reshape(b * (t - 1), hidden_BTH.shape[-1])
    target_N = input_ids_BT[:, 1:].reshape(-1)
    temp = max(float(temperature), 1e-6)
    step = max(int(chunk_tokens), 1)
    recompute = torch.is_grad_enabled() and h_NH.requires_grad and _worth_recomputing(head, h_NH.shape[-1])
    logps, ents = [], []
    n = h_NH.shape[0]
    for i in range(max(-(-n // step), int(min_chunks))):
        start = min(i * step, n)
        h, tgt = h_NH[start:start + step], target_N[start:start + step]
        if recompute:
            lp, en = checkpoint(_chunk_stats, h, tgt, head, temp, use_reentrant=False)
        else:
            lp, en = _chunk_stats(h, tgt, head, temp)
        logps.append(lp)
        ents.append(en)
    zeros_B1 = torch.zeros((b, 1), dtype=torch.float32, device=hidden_BTH.device)
    if not logps:
        return zeros_B1, zeros_B1.clone()
    logp_BT = torch.cat([zeros_B1, torch.cat(logps).view(b, t - 1)], dim=1)
    entropy_BT = torch.cat([zeros_B1, torch.cat(ents).view(b, t - 1)], dim=1)
    return logp_BT, entropy_BT


def naive_token_stats(logits_BTV: Tensor, input_ids_BT: Tensor, temperature: float) -> tuple[Tensor, Tensor]:
    """The reference computation over full fp32 ``[B, T, V]`` tensors (tests and benchmarks only)."""
    logits = logits_BTV[:, :-1].float() / max(temperature, 1e-6)
    logp_all = torch.log_softmax(logits, dim=-1)
    logp = logp_all.gather(-1, input_ids_BT[:, 1:].unsqueeze(-1)).squeeze(-1)
    p = torch.softmax(logits, dim=-1)
    ent = torch.logsumexp(logits, dim=-1) - (p * logits).sum(-1)
    zeros = torch.zeros_like(logp[:, :1])
    return torch.cat([zeros, logp], dim=1), torch.cat([zeros, ent], dim=1)


def _splittable(model: Any) -> bool:
    """Whether logits == get_output_embeddings()(get_decoder()(...).last_hidden_state)."""
    if not (hasattr(model, "get_decoder") and hasattr(model, "get_output_embeddings")):
        return False
    config = getattr(model, "config", None)
    if any(getattr(config, name, None) not in (None, 1.0) for name in _LOGIT_TRANSFORMS):
        return False
    return model.get_decoder() is not None and model.get_output_embeddings() is not None


class PolicyLogprobs(nn.Module):
    """An HF causal LM whose forward returns the log-probs and entropy of the input tokens (``[2, B, T]``).

    The train engine wraps this module; ``policy`` is the HF model (saved, exported, evaluated).
    """

    def __init__(self, policy: nn.Module, chunk_tokens: int = DEFAULT_CHUNK_TOKENS) -> None:
        super().__init__()
        self.policy: Any = policy  # the HF model (typed Any: nn.Module attributes type as Tensor | Module)
        self.chunk_tokens = int(chunk_tokens)
        self.split_head = _splittable(policy)

    def forward(self, input_ids: Tensor, attention_mask: Tensor, temperature: float = 1.0) -> Tensor:
        """``[2, B, T]``: log p(token) and entropy, stacked (unpack as ``logp_BT, entropy_BT = ...``).

        One output tensor, not a tuple: ZeRO-3 hooks each output of a module with a pre-backward
        fetch, so a loss using only the log-probs and a loss using both (a rank's zero-loss filler)
        would record different module traces on different ranks, and ranks whose traces disagree
        run different collectives (a hang)."""
        if self.split_head:
            out = self.policy.get_decoder()(input_ids=input_ids, attention_mask=attention_mask, use_cache=False)
            hidden = out[0] if isinstance(out, tuple) else out.last_hidden_state
            head = self.policy.get_output_embeddings()
            positions = input_ids.shape[0] * max(input_ids.shape[1] - 1, 0)
            chunks = -(-positions // max(self.chunk_tokens, 1))
            if _zero3_partitioned(head):  # every rank calls the head (a ZeRO-3 gather each) as often
                chunks = max_over_ranks(chunks)
            return torch.stack(chunked_token_stats(hidden, input_ids, head, temperature, self.chunk_tokens,
                                                   min_chunks=chunks))
        logits = self.policy(input_ids=input_ids, attention_mask=attention_mask, use_cache=False).logits
        return torch.stack(chunked_token_stats(logits, input_ids, None, temperature, self.chunk_tokens))


def _zero3_partitioned(module: nn.Module) -> bool:
    """Whether ``module``'s parameters are ZeRO-3 partitions (gathered by a collective per call)."""
    return any(hasattr(p, "ds_id") for p in module.parameters(recurse=False))


def policy_of(model: Any) -> nn.Module:
    """The HF model inside a train engine's module, a :class:`PolicyLogprobs`, or ``model`` itself."""
    inner = getattr(model, "module", model)  # a DeepSpeed engine wraps the module
    return inner.policy if isinstance(inner, PolicyLogprobs) else inner
