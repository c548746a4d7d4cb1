"""The model's own chat format for the agent loop, without torch or transformers.

A model directory with a chat template (``chat_template.jinja``, or ``chat_template`` in
``tokenizer_config.json``; ChatML for Qwen:
``<|im_start|>role\\n...<|im_end|>``) is driven through it: the first prompt is the template's
rendering of the task's observation as a user message with the generation prompt, and every later
observation enters as the text the template puts between the end of the assistant's turn and the
next generation prompt (a ``tool`` message after a tool call or code, a ``user`` message otherwise).
The tokens the engine generated stay as they are (never re-rendered); only observation text is
tokenized, and it is masked out of the loss. A directory without a template keeps the plain format
(BOS + observation text), as the character-tokenizer demo model does.

Templates are rendered the way Hugging Face renders them (a sandboxed Jinja environment with
``trim_blocks`` and ``lstrip_blocks``, ``tojson`` and ``raise_exception``).
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

from jinja2.sandbox import ImmutableSandboxedEnvironment

EOS_SOURCES = ("generation_config.json", "config.json")


def model_stop_ids(model_dir: str | Path, tokenizer_eos_id: int) -> set[int]:
    """Every id that ends a turn: the tokenizer's EOS and the ``eos_token_id`` (an int or a list)
    of ``generation_config.json`` and ``config.json`` — chat models stop on an end-of-turn token."""
    ids = {int(tokenizer_eos_id)}
    for name in EOS_SOURCES:
        path = Path(model_dir) / name
        if path.is_file():
            value = json.loads(path.read_text()).get("eos_token_id")
            ids |= {int(v) for v in (value if isinstance(value, list) else [value]) if v is not None}
    return ids


_TOOLS_IN_TEMPLATE = re.compile(r"<tool_call>|\btools?\b")


def native_tool_calls(model_dir: str | Path) -> bool:
    """True when the model has a chat template that knows tool calls: the template mentions
    ``<tool_call>``, ``tools`` or a ``tool`` role (Qwen2.5, Hermes), or the tokenizer has a
    ``<tool_call>`` token. A source's ``tool_format: auto`` resolves to ``native`` then, else ``tags``."""
    template = ChatFormat.template_text(model_dir)
    if template is None:
        return False
    if _TOOLS_IN_TEMPLATE.search(template):
        return True
    for name in ("tokenizer_config.json", "tokenizer.json", "added_tokens.json"):
        path = Path(model_dir) / name
        if path.is_file() and '"<tool_call>"' in path.read_text():
            return True
    return False


def _raise(message: str) -> None:
    raise ValueError(message)


class ChatFormat:
    """Renders a model's chat template; ``None`` from ``load`` when the model has none."""

    def __init__(self, template: str, special: dict[str, str]) -> None:
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        env.filters["tojson"] = lambda x, **kw: json.dumps(x, ensure_ascii=False, **kw)
        env.globals["raise_exception"] = _raise
        self.template = env.from_string(template)
        self.special = special
        """bos_token / eos_token strings the template may use."""

    @staticmethod
    def template_text(model_dir: str | Path) -> str | None:
        """The model's chat template source (None: it has none)."""
        root = Path(model_dir)
        path = root / "tokenizer_config.json"
        cfg = json.loads(path.read_text()) if path.is_file() else {}
        template = cfg.get("chat_template")
        if not template and (root / "chat_template.jinja").is_file():  # transformers >= 4.5x writes it here
            template = (root / "chat_template.jinja").read_text()
        if not template and (root / "chat_template.json").is_file():
            template = json.loads((root / "chat_template.json").read_text()).get("chat_template")
        return template if isinstance(template, str) and template else None

    @staticmethod
    def load(model_dir: str | Path) -> ChatFormat | None:
        template = ChatFormat.template_text(model_dir)
        if template is None:
            return None
        path = Path(model_dir) / "tokenizer_config.json"
        cfg = json.loads(path.read_text()) if path.is_file() else {}
        special = {}
        for key in ("bos_token", "eos_token"):
            value = cfg.get(key)
            special[key] = value.get("content", "") if isinstance(value, dict) else (value or "")
        return ChatFormat(template, special)

    def render(self, messages: list[dict[str, Any]], *, add_generation_prompt: bool,
               tools: list[dict[str, Any]] | None = None) -> str:
        return str(self.template.render(messages=messages, add_generation_prompt=add_generation_prompt,
                                        tools=tools or None, **self.special))

    def prompt(self, observation: str, tools: list[dict[str, Any]] | None = None) -> str:
        """The first context: the observation as a user message, then the generation prompt. `tools`:
        the task's tool JSON schemas (task metadata ``tools``, envs/base.py ``function_schemas``), for
        a template that renders them (Qwen2.5 lists them in its system turn)."""
        return self.render([{"role": "user", "content": observation}], add_generation_prompt=True, tools=tools)

    _PROBE = "\x00assistant-turn\x00"

    def _assistant_turn(self) -> tuple[list[dict[str, Any]], str, int]:
        convo = [{"role": "user", "content": "\x00task\x00"}, {"role": "assistant", "content": self._PROBE}]
        before = self.render(convo, add_generation_prompt=False)
        return convo, before, before.index(self._PROBE) + len(self._PROBE)

    def turn_end(self) -> str:
        """The text the template closes an assistant turn with (ChatML: ``<|im_end|>``), up to the
        line break; the model generates it as its end-of-turn token."""
        _, before, cut = self._assistant_turn()
        return before[cut:].split("\n", 1)[0]

    def observation(self, text: str, role: str, *, turn_closed: bool) -> str:
        """What follows an assistant turn when `text` arrives as a `role` message, up to and
        including the next generation prompt. `turn_closed`: the generated turn already ends with
        `turn_end()` (else the template's closing text is part of what follows)."""
        convo, before, cut = self._assistant_turn()
        after = self.render([*convo, {"role": role, "content": text}], add_generation_prompt=True)
        if not after.startswith(before[:cut]):
            raise ValueError("the chat template renders earlier turns differently once a message follows")
        return after[cut + (len(self.turn_end()) if turn_closed else 0):]
