"""Structured-output checks shared by the engine conformance suite and the real-model tests
(imported by tests; not a test module): the agent endpoint's three constraint kinds, each with a
check of the decoded output, and the masked log-probs the learner would recompute for them."""

from __future__ import annotations

from typing import Any

import pytest

CONSTRAINED_TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "parameters": {"type": "object", "required": ["city", "celsius"], "properties": {
        "city": {"type": "string", "enum": ["Paris", "Oslo"]}, "celsius": {"type": "boolean"}}}}}]
CONSTRAINED_JSON = {"type": "object", "properties": {"answer": {"type": "integer", "minimum": 0, "maximum": 99}},
                    "required": ["answer"], "additionalProperties": False}
CONSTRAINED_REGEX = r"\([a-z]{2}\+[0-9]\)=[0-9]{2}\."


def constraint(kind: str) -> tuple[dict[str, str], Any]:
    """(the sampling field the agent endpoint sends for `kind`, a check of the decoded output)."""
    import json
    import re

    from trajmesh.rollout.engines.grammar import json_ebnf, tool_calls_ebnf
    from trajmesh.tool_calls import parse_tool_calls

    def tool_call(text: str) -> bool:
        rest, calls = parse_tool_calls(text)
        return (rest, [c.name for c in calls]) == ("", ["get_weather"]) and \
            calls[0].arguments.get("city") in ("Paris", "Oslo") and isinstance(calls[0].arguments.get("celsius"), bool)

    def answer(text: str) -> bool:
        try:
            value = json.loads(text)
        except ValueError:
            return False
        return isinstance(value, dict) and set(value) == {"answer"} and isinstance(value["answer"], int)

    if kind == "tool_call":
        return {"ebnf": tool_calls_ebnf(CONSTRAINED_TOOLS, one_call=True)}, tool_call
    if kind == "json":
        return {"ebnf": json_ebnf(CONSTRAINED_JSON)}, answer
    return {"regex": CONSTRAINED_REGEX}, lambda text: re.fullmatch(CONSTRAINED_REGEX, text) is not None


def masked_logprobs(model: Any, tok: Any, prompt: list[int], output: list[int], grammar: dict[str, str],
                     stop_ids: list[int]) -> list[float]:
    """log_softmax of the sampled tokens over the logits with the grammar's disallowed tokens at
    -inf (xgrammar's mask, recomputed here with the learner's forward)."""
    import torch
    xgr = pytest.importorskip("xgrammar")
    with torch.no_grad():
        logits = model(torch.tensor([prompt + output])).logits[0, len(prompt) - 1:-1].float()
    info = xgr.TokenizerInfo.from_huggingface(tok, vocab_size=logits.shape[1], stop_token_ids=stop_ids)
    compiler = xgr.GrammarCompiler(info)
    kind, spec = next(iter(grammar.items()))
    matcher = xgr.GrammarMatcher(compiler.compile_regex(spec) if kind == "regex" else compiler.compile_grammar(spec))
    bitmask = xgr.allocate_token_bitmask(1, logits.shape[1])
    out = []
    for row, token in zip(logits, output, strict=True):
        matcher.fill_next_token_bitmask(bitmask)
        masked = row.clone().unsqueeze(0)
        xgr.apply_token_bitmask_inplace(masked, bitmask)
        out.append(float(torch.log_softmax(masked[0], -1)[token]))
        assert matcher.accept_token(token) or matcher.is_terminated()
    return out
