"""Chunked token log-probs and entropy equal the naive fp32 [B, T, V] computation (values and grads)."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from trajmesh.learner.logprobs import PolicyLogprobs, chunked_token_stats, naive_token_stats


def _model(hidden: int = 32) -> LlamaForCausalLM:
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=37, hidden_size=hidden, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=64,
                      tie_word_embeddings=True)
    return LlamaForCausalLM(cfg).float()


def _inputs() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    ids_BT = torch.randint(0, 37, (3, 13), generator=g)
    att_BT = torch.ones_like(ids_BT)
    att_BT[1, 9:] = 0  # right padding on one row
    ids_BT[1, 9:] = 0
    return ids_BT, att_BT


def _grads(model: torch.nn.Module, loss: torch.Tensor) -> list[torch.Tensor]:
    model.zero_grad()
    loss.backward()
    return [p.grad.clone() for p in model.parameters()]


@pytest.mark.parametrize("chunk", [5, 1000])
@pytest.mark.parametrize("split_head", [True, False])
@pytest.mark.parametrize("hidden", [32, 64])  # vocab 37 > 32: chunks recomputed in the backward; < 64: kept
def test_chunked_equals_naive_values_and_gradients(chunk: int, split_head: bool, hidden: int) -> None:
    model = _model(hidden)
    ids_BT, att_BT = _inputs()
    weights_BT = torch.linspace(-1.0, 2.0, ids_BT.numel()).view_as(ids_BT) * att_BT
    net = PolicyLogprobs(model, chunk_tokens=chunk)
    assert net.split_head  # a Llama's logits are lm_head(last hidden state)
    net.split_head = split_head  # False: the plain-forward path other architectures take
    logp_BT, ent_BT = net(ids_BT, att_BT, temperature=0.7)
    grads = _grads(model, (logp_BT * weights_BT).sum() + (ent_BT * weights_BT).sum())
    ref_logp_BT, ref_ent_BT = naive_token_stats(model(input_ids=ids_BT, attention_mask=att_BT).logits, ids_BT, 0.7)
    ref_grads = _grads(model, (ref_logp_BT * weights_BT).sum() + (ref_ent_BT * weights_BT).sum())
    assert logp_BT.shape == ent_BT.shape == ids_BT.shape
    assert (logp_BT[:, 0] == 0).all() and (ent_BT[:, 0] == 0).all()
    torch.testing.assert_close(logp_BT, ref_logp_BT, rtol=0, atol=1e-6)
    torch.testing.assert_close(ent_BT, ref_ent_BT, rtol=0, atol=1e-6)
    for a, b in zip(grads, ref_grads, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=2e-6)  # float32 sums in another order


def test_hand_computed_values_on_a_fixed_logit_table() -> None:
    # V = 3, one sequence [0, 2]: position 1 is scored by logits z = (0, 0, ln 2) at position 0:
    # softmax = (1/4, 1/4, 1/2) → log p(2) = ln(1/2); entropy = −Σ p ln p = ln 4 / 2 + ln 2 / 2.
    logits_BTV = torch.tensor([[[0.0, 0.0, 0.6931471805599453], [5.0, 1.0, 0.0]]], dtype=torch.float64)
    ids_BT = torch.tensor([[0, 2]])
    logp_BT, ent_BT = chunked_token_stats(logits_BTV, ids_BT, None, 1.0, 1)
    assert logp_BT.tolist()[0] == pytest.approx([0.0, -0.6931471805599453], abs=1e-6)
    assert ent_BT.tolist()[0] == pytest.approx([0.0, 0.6931471805599453 * 1.5], abs=1e-6)


def test_models_with_a_logit_transform_take_the_plain_forward() -> None:
    model = _model()
    model.config.final_logit_softcapping = 30.0  # Gemma-2 style: logits != lm_head(hidden)
    assert not PolicyLogprobs(model).split_head
