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

Templates are rendered the way Hugging Face transformers renders them (a sandboxed Jinja
environment with ``trim_blocks`` and ``lstrip_blocks``, the ``loopcontrols`` extension
(``{% break %}``, ``{% continue %}``), the ``{% generation %}...{% endgeneration %}`` block that
marks assistant text (rendered as its body: the rollout masks by token, not by template span),
``tojson`` and the globals ``raise_exception`` and ``strftime_now``).
"""

from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path
from typing import Any

from jinja2 import nodes
from jinja2.ext import Extension, loopcontrols
from jinja2.parser import Parser
from jinja2.sandbox import ImmutableSandboxedEnvironment

from trajmesh.tokenizer import chat_template_text

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


def _raise(message: str) -> None:
    raise ValueError(message)


def _strftime_now(fmt: str) -> str:
    """The local time now in `fmt` (templates that write today's date into the system turn)."""
    return datetime.now().strftime(fmt)


class GenerationBlock(Extension):
    """``{% generation %}BODY{% endgeneration %}``: renders BODY unchanged."""

    tags = {"generation"}

    def parse(self, parser: Parser) -> nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return nodes.Scope(body).set_lineno(lineno)


class ChatFormat:
    """Renders a model's chat template; ``None`` from ``load`` when the model has none."""

    def __init__(self, template: str, special: dict[str, str]) -> None:
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                            extensions=[loopcontrols, GenerationBlock])
        env.filters["tojson"] = lambda x, **kw: json.dumps(x, **{"ensure_ascii": False, **kw})
        env.globals["raise_exception"] = _raise
        env.globals["strftime_now"] = _strftime_now
        self.template = env.from_string(template)
        self.special = special
        """bos_token / eos_token strings the template may use."""

    @staticmethod
    def template_text(model_dir: str | Path) -> str | None:
        """The model's chat template source (None: it has none; `trajmesh.tokenizer.chat_template_text`)."""
        return chat_template_text(model_dir)

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
