"""The learner tests' model: a tiny Llama (vocab 30, hidden 32, 2 layers, tied head), seeded, fp32."""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import LlamaConfig, LlamaForCausalLM


def tiny_llama(seed: int = 0) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=30, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=64,
                      tie_word_embeddings=True)
    return LlamaForCausalLM(cfg).float()


def tiny_llama_dir(tmp_path: Path) -> str:
    """A one-layer tiny Llama (vocab 24, tied head), seeded, saved under `tmp_path`/model: the model
    the learner-service tests start a `LearnerService` on."""
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=24, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                      num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=32,
                      tie_word_embeddings=True)
    path = tmp_path / "model"
    LlamaForCausalLM(cfg).save_pretrained(str(path))
    return str(path)
