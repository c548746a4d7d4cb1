"""A grader service for the grader's unit tests (tests/unit/services/test_grader_*.py)."""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path

from trajmesh.config import load_config
from trajmesh.services.grader import GraderService
from trajmesh.tokenizer import load_tokenizer


def grader_with_bpe(tok_dir: Path, texts: Iterable[str], *, vocab_size: int = 400) -> GraderService:
    """A `GraderService` (default config, not set up) whose tokenizer is a byte-level BPE trained here on
    `texts` and saved in `tok_dir` (any text round-trips; its EOS is ``<|im_end|>``)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    core = Tokenizer(models.BPE())
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    core.decoder = decoders.ByteLevel()
    core.train_from_iterator(list(texts), trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=["<|im_end|>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False))
    core.save(str(tok_dir / "tokenizer.json"))
    (tok_dir / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|im_end|>"}))
    svc = GraderService(load_config(None, {}))
    svc.tokenizer = load_tokenizer(tok_dir)
    return svc
