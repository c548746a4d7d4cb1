"""A torch-free view of a Hugging Face tokenizer directory (the `tokenizers` library only).

Rollout tokenizes observations with it, the grader decodes responses, the store checks token ids
against the vocabulary. Token ids travel end to end; text is never re-tokenized for training.
"""

from __future__ import annotations

import json
import re
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
