"""A tiny chat model in the real format, built locally (imported by tests; not a test module).

A Qwen2-architecture causal LM with a byte-level BPE tokenizer trained here with Hugging Face
``tokenizers`` on the given texts, ``<|im_start|>``/``<|im_end|>`` special tokens, Qwen/Hermes
tool-call tokens (``<tool_call>``, ``<tool_response>``) and a ChatML chat template in which tool
results come back as ``tool`` messages (rendered, as Qwen2.5 does, inside a user turn wrapped in
``<tool_response>``). Saved as an ordinary HF directory: ``AutoTokenizer``/``AutoModelForCausalLM``
load it, and ``generation_config.json`` lists both end ids.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path

CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{% if loop.first and message['role'] != 'system' %}"
    "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"
    "{% endif %}"
    "{% if message['role'] == 'tool' %}"
    "<|im_start|>user\n<tool_response>\n{{ message['content'] }}\n</tool_response><|im_end|>\n"
    "{% else %}"
    "<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
TOOL_TOKENS = ["<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>"]


def build_chatml_model(out_dir: str | Path, texts: Iterable[str], *, vocab_size: int = 600, hidden: int = 32,
                       layers: int = 1, heads: int = 2, max_positions: int = 1024, seed: int = 0) -> Path:
    import torch
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

    core = Tokenizer(models.BPE())
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    core.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    core.train_from_iterator(list(texts), trainer)
    core.add_tokens([AddedToken(t, special=False, normalized=False) for t in TOOL_TOKENS])
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=core, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                                        padding_side="left", model_max_length=max_positions)
    tokenizer.chat_template = CHATML_TEMPLATE
    out = Path(out_dir)
    tokenizer.save_pretrained(str(out))
    end_ids = [tokenizer.convert_tokens_to_ids("<|im_end|>"), tokenizer.convert_tokens_to_ids("<|endoftext|>")]
    config = Qwen2Config(vocab_size=len(tokenizer), hidden_size=hidden, intermediate_size=2 * hidden,
                         num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=heads,
                         max_position_embeddings=max_positions, tie_word_embeddings=True,
                         pad_token_id=tokenizer.pad_token_id, bos_token_id=None, eos_token_id=end_ids[0])
    torch.manual_seed(seed)
    Qwen2ForCausalLM(config).float().eval().save_pretrained(str(out), safe_serialization=True)
    (out / "generation_config.json").write_text(json.dumps({"eos_token_id": end_ids, "pad_token_id": end_ids[1]}))
    return out
