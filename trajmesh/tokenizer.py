"""A torch-free view of a Hugging Face tokenizer directory (the `tokenizers` library only).

Rollout tokenizes observations with it, the grader decodes responses, the store checks token ids
against the vocabulary. Token ids travel end to end; text is never re-tokenized for training.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Any

import numpy as np
from tokenizers import Tokenizer


@dataclass
class TextTokenizer:
    tokenizer: Tokenizer
    eos_token_id: int
    bos_token_id: int | None
    pad_token_id: int | None

    @cached_property
    def table(self) -> TokenBytes | None:
        """Each id's bytes, where the tokenizer's decoding is their concatenation (`TokenBytes.of`),
        built at the first decode (0.36 s for SmolLM2's 49,152 ids on this machine; processes that
        never decode do not pay it): `decode` joins them without the tokenizer. None: every decode
        goes through the tokenizer."""
        return TokenBytes.of(self.tokenizer)

    @property
    def vocab_size(self) -> int:
        return int(self.tokenizer.get_vocab_size(with_added_tokens=True))

    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=False).ids)

    def decode(self, ids: Sequence[int] | np.ndarray) -> str:
        """The text of `ids`, special tokens skipped: what ``Tokenizer.decode(ids,
        skip_special_tokens=True)`` returns, from the byte table where there is one."""
        if self.table is not None:
            text = self.table.decode(ids)
            if text is not None:
                return text
        return str(self.tokenizer.decode(ids.tolist() if isinstance(ids, np.ndarray) else ids,
                                         skip_special_tokens=True))


def _byte_level_chars() -> dict[str, int]:
    """The ByteLevel pre-tokenizer's alphabet: the character standing for each byte (GPT-2's map:
    printable Latin-1 bytes stand for themselves, the rest for code points from 256 on)."""
    keep = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAC + 1), *range(0xAE, 0xFF + 1)]
    chars, extra = {}, 0
    for b in range(256):
        if b in keep:
            chars[chr(b)] = b
        else:
            chars[chr(256 + extra)] = b
            extra += 1
    return chars


_DECODERS_BY_CONCATENATION = ("ByteLevel", "Fuse")


class TokenBytes:
    """A tokenizer's decoding as a table of bytes per id, for the tokenizers whose ``decode`` is
    the concatenation of each kept token's bytes, read as UTF-8 with invalid bytes replaced: a
    ``ByteLevel`` decoder (GPT-2, Llama 3, Qwen, SmolLM2: each token's characters map to bytes) or
    ``Fuse`` (the demo's character tokenizer). Special tokens (skipped) and ids the vocabulary does
    not know (dropped by the tokenizer) are empty. The grader decodes every sampled token of every
    trajectory; the library spends ~0.36 us a token on SmolLM2's vocabulary, the table a fifth of
    that (`python bench/run.py decode`, docs/RESULTS.md). Other decoders (Metaspace, ByteFallback:
    Llama 2, Gemma) have none."""

    def __init__(self, data: bytes, lengths: np.ndarray) -> None:
        self.buf = np.frombuffer(data, np.uint8)
        self.lengths = lengths.astype(np.int64)
        self.starts = np.cumsum(self.lengths) - self.lengths

    @classmethod
    def of(cls, tok: Tokenizer) -> TokenBytes | None:
        """The table of `tok`, or None where its decoding may not be a concatenation of bytes per
        token: another decoder, or an added token that is not special and not ASCII (whether the
        tokenizer passes such a token through its decoder or not, ASCII content gives the same
        bytes: ByteLevel maps printable ASCII to itself and keeps a token it cannot map as UTF-8)."""
        spec: dict[str, Any] = json.loads(tok.to_str())
        decoder = (spec.get("decoder") or {}).get("type")
        if decoder not in _DECODERS_BY_CONCATENATION:
            return None
        added = spec.get("added_tokens") or []
        if any(not a.get("special") and not str(a.get("content", "")).isascii() for a in added):
            return None
        special = {int(a["id"]) for a in added if a.get("special")}
        chars = _byte_level_chars() if decoder == "ByteLevel" else None
        pieces: list[bytes] = []
        for i in range(tok.get_vocab_size(with_added_tokens=True)):
            token = tok.id_to_token(i)
            if token is None or i in special:
                pieces.append(b"")
            elif chars is not None and all(c in chars for c in token):
                pieces.append(bytes(chars[c] for c in token))
            else:  # Fuse; or a ByteLevel token outside its alphabet, which it keeps as UTF-8
                pieces.append(token.encode())
        return cls(b"".join(pieces), np.fromiter(map(len, pieces), np.int64, len(pieces)))

    def decode(self, ids: Sequence[int] | np.ndarray) -> str | None:
        """The text of `ids`; None when an id is outside the table (the tokenizer decides those)."""
        a = np.asarray(ids, dtype=np.int64)
        if a.size == 0:
            return ""
        if int(a.min()) < 0 or int(a.max()) >= self.lengths.size:
            return None
        lengths = self.lengths[a]
        total = int(lengths.sum())
        # Each output byte's index into buf: its token's start, plus its place within the token.
        shift = np.repeat(self.starts[a] - (np.cumsum(lengths) - lengths), lengths)
        return self.buf[shift + np.arange(total)].tobytes().decode("utf-8", "replace")


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


def chat_template_text(model_dir: str | Path) -> str | None:
    """The model's chat template source: ``chat_template`` in ``tokenizer_config.json``, else
    ``chat_template.jinja`` (transformers >= 4.5x writes it there), else ``chat_template.json``
    (None: it has none). The rollout renders it (rollout/agents/chat_format.py)."""
    root = Path(model_dir)
    path = root / "tokenizer_config.json"
    cfg = json.loads(path.read_text()) if path.is_file() else {}
    template = cfg.get("chat_template")
    if not template and (root / "chat_template.jinja").is_file():
        template = (root / "chat_template.jinja").read_text()
    if not template and (root / "chat_template.json").is_file():
        template = json.loads((root / "chat_template.json").read_text()).get("chat_template")
    return template if isinstance(template, str) and template else None


_TOOLS_IN_TEMPLATE = re.compile(r"<tool_call>|\btools?\b")


def native_tool_calls(model_dir: str | Path) -> bool:
    """True when the model has a chat template that knows tool calls: the template mentions
    ``<tool_call>``, ``tools`` or a ``tool`` role (Qwen2.5, Hermes), or the tokenizer has a
    ``<tool_call>`` token. A source's ``tool_format: auto`` resolves to ``native`` then, else ``tags``."""
    template = chat_template_text(model_dir)
    if template is None:
        return False
    if _TOOLS_IN_TEMPLATE.search(template):
        return True
    for name in ("tokenizer_config.json", "tokenizer.json", "added_tokens.json"):
        path = Path(model_dir) / name
        if path.is_file() and '"<tool_call>"' in path.read_text():
            return True
    return False
