"""A torch-free view of a Hugging Face tokenizer directory (the `tokenizers` library only).

Rollout tokenizes observations with it, the grader decodes responses, the store checks token ids
against the vocabulary. Token ids travel end to end; text is never re-tokenized for training.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from tokenizers import Tokenizer


@dataclass
class TextTokenizer:
    tokenizer: Tokenizer
    eos_token_id: int
    bos_token_id: int | None
    pad_token_id: int | None

    @property
    def vocab_size(self) -> int:
        return int(self.tokenizer.get_vocab_size(with_added_tokens=True))

    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=False).ids)

    def decode(self, ids: list[int]) -> str:
        return str(self.tokenizer.decode(ids, skip_special_tokens=True))


def _token_id(tok: Tokenizer, value: object) -> int | None:
    if isinstance(value, dict):
        value = value.get("content")
    if not isinstance(value, str):
        return None
    idx = tok.token_to_id(value)
    return int(idx) if idx is not None else None


def load_tokenizer(model_dir: str | Path) -> TextTokenizer:
    """Load `tokenizer.json` and the special tokens from `tokenizer_config.json` in a model dir."""
    root = Path(model_dir)
    path = root / "tokenizer.json"
    if not path.exists():
        raise FileNotFoundError(f"{path} not found: model dir must hold a fast tokenizer (tokenizer.json)")
    tok = Tokenizer.from_file(str(path))
    cfg: dict[str, object] = {}
    for name in ("tokenizer_config.json", "special_tokens_map.json"):
        if (root / name).exists():
            cfg.update({k: v for k, v in json.loads((root / name).read_text()).items() if k not in cfg})
    eos = _token_id(tok, cfg.get("eos_token"))
    if eos is None:
        raise ValueError(f"{root}: tokenizer has no eos_token")
    return TextTokenizer(tok, eos, _token_id(tok, cfg.get("bos_token")), _token_id(tok, cfg.get("pad_token")))
