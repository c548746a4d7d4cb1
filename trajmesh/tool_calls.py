"""Tool calls in the model's native format (Hermes / Qwen2.5), without torch or transformers.

A chat model trained on the Hermes format (Qwen2.5, Qwen3, Hermes) writes a tool call as

    <tool_call>
    {"name": "python", "arguments": {"code": "print(1)"}}
    </tool_call>

anywhere in its turn, possibly several in a row. `parse_tool_calls` splits a generated turn into
the text around the blocks and the calls; `render_tool_calls` writes calls back the way Qwen2.5's
chat template renders an assistant message's ``tool_calls`` (one block per call, joined by a line
break, arguments as compact JSON with ``", "``/``": "`` separators and non-ASCII kept).

A malformed block (not JSON, not an object, no string ``name``, ``arguments`` neither an object
nor a JSON string of one) never raises: it stays in the returned text, verbatim, and the caller
decides what a block that did not parse costs (`count_malformed` counts them). An unclosed
``<tool_call>`` is plain text too. Call ids are positional (``call_0``, ``call_1``, ... in the
order of the well-formed calls in the turn), so a replayed turn gets the same ids.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any

OPEN = "<tool_call>"
CLOSE = "</tool_call>"
_BLOCK = re.compile(re.escape(OPEN) + r"(.*?)" + re.escape(CLOSE), flags=re.DOTALL)


@dataclass(frozen=True)
class ToolCall:
    id: str
    name: str
    arguments: dict[str, Any] = field(default_factory=dict)


def _decode(body: str) -> tuple[str, dict[str, Any]] | None:
    """(name, arguments) of one block's JSON, or None when it is not a well-formed call."""
    try:
        obj = json.loads(body)
    except ValueError:
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
        return None
    args = obj.get("arguments", {})
    if isinstance(args, str):  # some models (and OpenAI's wire format) send the arguments as a JSON string
        try:
            args = json.loads(args) if args.strip() else {}
        except ValueError:
            return None
    if not isinstance(args, dict):
        return None
    return obj["name"], args


def parse_tool_calls(text: str) -> tuple[str, list[ToolCall]]:
    """(the text with every well-formed block removed and outer whitespace stripped, the calls).
    Malformed blocks stay in the text unchanged."""
    calls: list[ToolCall] = []
    kept: list[str] = []
    pos = 0
    for m in _BLOCK.finditer(text):
        decoded = _decode(m.group(1))
        kept.append(text[pos:m.start()])
        if decoded is None:
            kept.append(m.group(0))
        else:
            calls.append(ToolCall(f"call_{len(calls)}", decoded[0], decoded[1]))
        pos = m.end()
    kept.append(text[pos:])
    return "".join(kept).strip(), calls


def count_malformed(text: str) -> int:
    """How many ``<tool_call>`` blocks in `text` are not well-formed calls (closed blocks whose
    JSON does not decode to a call, plus an unclosed opening tag at the end)."""
    bad = sum(1 for m in _BLOCK.finditer(text) if _decode(m.group(1)) is None)
    tail = text[text.rfind(CLOSE) + len(CLOSE):] if CLOSE in text else text
    return bad + (1 if OPEN in tail else 0)


def render_tool_calls(calls: list[ToolCall]) -> str:
    """The calls as Qwen2.5's template writes an assistant turn's ``tool_calls``."""
    return "\n".join(
        f'{OPEN}\n{{"name": {json.dumps(c.name, ensure_ascii=False)}, '
        f'"arguments": {json.dumps(c.arguments, ensure_ascii=False)}}}\n{CLOSE}'
        for c in calls)
