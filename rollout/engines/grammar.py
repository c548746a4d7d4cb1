"""The torch engine's structured outputs: SGLang's ``json_schema`` / ``regex`` / ``ebnf`` sampling
params, compiled with xgrammar (the grammar library SGLang and vLLM use) and applied per decode step.

::

    /generate sampling_params {"ebnf": "root ::= ..."}  ──▶ Grammars.compile (xgrammar, cached per text)
        decode_batch, each step, per constrained row:  logits[disallowed] = -inf  (the token bitmask)
                                                        sample, then matcher.accept_token(token)

As in SGLang (``SamplingBatchInfo.apply_logits_bias`` before the sampler) and vLLM (the grammar
bitmask applied to the logits before its sampler), the mask is applied to the logits, so the
log-prob reported for a constrained token is of the **masked** distribution, the one it was drawn
from. Once the grammar is complete only the engine's stop tokens are allowed. One kind per request
(SGLang: "Only one of regex, json_schema, or ebnf can be set").

xgrammar is imported on the first constrained request (it imports torch and takes seconds).
"""

from __future__ import annotations

import json
import threading
from typing import Any

CONSTRAINT_KEYS = ("json_schema", "regex", "ebnf")
"""SGLang's ``sampling_params`` keys for a grammar constraint (``srt/sampling/sampling_params.py``)."""


def constraint_of(raw: dict[str, Any]) -> tuple[str, str] | None:
    """(kind, text) of the request's constraint; None without one; ValueError for two or a non-string
    (a ``json_schema`` object is taken as its JSON text)."""
    given = [(k, raw[k]) for k in CONSTRAINT_KEYS if raw.get(k) is not None]
    if not given:
        return None
    if len(given) > 1:
        raise ValueError("Only one of regex, json_schema, or ebnf can be set.")
    kind, spec = given[0]
    if kind == "json_schema" and isinstance(spec, dict):
        spec = json.dumps(spec)
    if not isinstance(spec, str) or not spec:
        raise ValueError(f"{kind} must be a non-empty string")
    return kind, spec


class Grammars:
    """Compiles constraints for one tokenizer (xgrammar ``GrammarCompiler``, cached) and makes the
    per-row matchers `decode_batch` steps with."""

    def __init__(self, tokenizer: Any, vocab_size: int, stop_ids: set[int]) -> None:
        self._tokenizer, self._vocab_size, self._stop_ids = tokenizer, vocab_size, sorted(stop_ids)
        self._compiler: Any = None
        self._lock = threading.Lock()

    def _get_compiler(self) -> Any:
        with self._lock:
            if self._compiler is None:
                import xgrammar as xgr

                info = xgr.TokenizerInfo.from_huggingface(self._tokenizer, vocab_size=self._vocab_size,
                                                          stop_token_ids=self._stop_ids)
                self._compiler = xgr.GrammarCompiler(info, max_threads=1)
            return self._compiler

    def compile(self, constraint: tuple[str, str]) -> Any:
        """The compiled grammar of (kind, text); ValueError when it does not compile."""
        compiler = self._get_compiler()
        kind, spec = constraint
        try:
            if kind == "json_schema":
                return compiler.compile_json_schema(spec)
            if kind == "regex":
                return compiler.compile_regex(spec)
            return compiler.compile_grammar(spec)
        except (RuntimeError, ValueError) as exc:
            raise ValueError(f"invalid {kind}: {exc}") from None


class RowConstraint:
    """One row's grammar state: masks its logits, advances on each sampled token."""

    def __init__(self, compiled: Any) -> None:
        import xgrammar as xgr

        self._xgr = xgr
        self.matcher = xgr.GrammarMatcher(compiled)
        self._vocab_size = compiled.tokenizer_info.vocab_size
        self._bitmask = xgr.allocate_token_bitmask(1, self._vocab_size)

    def mask(self, logits_V: Any) -> Any:
        """`logits_V` (float, CPU) with every token the grammar does not allow next set to -inf."""
        self.matcher.fill_next_token_bitmask(self._bitmask)
        out = logits_V.clone().unsqueeze(0)
        self._xgr.apply_token_bitmask_inplace(out, self._bitmask, vocab_size=self._vocab_size)
        return out.squeeze(0)

    def accept(self, token: int) -> None:
        if not self.matcher.is_terminated() and not self.matcher.accept_token(int(token)):
            raise RuntimeError(f"the grammar rejected sampled token {token}")


# ----------------------------------------------------------------- the agent endpoint's constraints

_BUILT: dict[str, str] = {}
_BUILT_LOCK = threading.Lock()


def _literal(text: str) -> str:
    """`text` as an EBNF string literal."""
    return '"' + text.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n") + '"'


def _json_grammar(xgr: Any, schema: dict[str, Any] | None) -> Any:
    """JSON for `schema` (None: any JSON object) in the layout the model's tool calls are rendered
    in (``json.dumps``: no line breaks, ``", "`` and ``": "``): a bounded choice of whitespace, so a
    constrained sample cannot spend its budget on blanks."""
    if schema is None:
        return xgr.Grammar.from_json_schema(json.dumps({"type": "object"}), strict_mode=False, any_whitespace=False,
                                            separators=(", ", ": "))
    return xgr.Grammar.from_json_schema(json.dumps(schema), any_whitespace=False, separators=(", ", ": "))


def _cached(key: Any, build: Any) -> str:
    text = json.dumps(key, sort_keys=True)
    with _BUILT_LOCK:
        if text in _BUILT:
            return _BUILT[text]
    try:
        import xgrammar as xgr
    except ImportError:  # pragma: no cover - xgrammar is a dependency
        raise ValueError("constrained decoding needs the xgrammar package") from None
    try:
        grammar = str(build(xgr))
    except (RuntimeError, ValueError, TypeError) as exc:
        raise ValueError(f"cannot build a grammar for it: {exc}") from None
    with _BUILT_LOCK:
        _BUILT[text] = grammar
    return grammar


def json_ebnf(schema: dict[str, Any] | None) -> str:
    """EBNF (xgrammar's dialect, which SGLang's ``ebnf`` and vLLM's ``grammar`` take) of a JSON value
    of `schema` (None: any JSON object; ``response_format`` ``json_object``). ValueError: it does
    not convert."""
    return _cached(["json", schema], lambda xgr: _json_grammar(xgr, schema))


def tool_calls_ebnf(tools: list[dict[str, Any]], *, one_call: bool) -> str:
    """EBNF of a turn that is only tool calls in the model's native (Hermes) format, as
    ``trajmesh.tool_calls.render_tool_calls`` writes them: one ``<tool_call>`` block (`one_call`) or
    several joined by a line break, each ``{"name": <one of tools>, "arguments": <that tool's
    JSON-schema parameters>}``. `tools`: OpenAI chat shape ({type, function: {name, parameters}})."""

    def build(xgr: Any) -> Any:
        calls = []
        for tool in tools:
            fn = tool["function"]
            params = fn.get("parameters") or {"type": "object"}
            if "type" not in params and "properties" in params:
                params = {"type": "object", **params}
            head = '<tool_call>\n{"name": ' + json.dumps(fn["name"], ensure_ascii=False) + ', "arguments": '
            tail = "}\n</tool_call>"
            calls.append(xgr.Grammar.concat(xgr.Grammar.from_ebnf("root ::= " + _literal(head)),
                                            _json_grammar(xgr, params),
                                            xgr.Grammar.from_ebnf("root ::= " + _literal(tail))))
        one = calls[0] if len(calls) == 1 else xgr.Grammar.union(*calls)
        if one_call:
            return one
        text = str(one)
        lines = ["tool_call ::= " + line[len("root ::= "):] if line.startswith("root ::= ") else line
                 for line in text.splitlines()]
        return xgr.Grammar.from_ebnf("\n".join([*lines, 'root ::= tool_call ("\\n" tool_call)*']))

    return _cached(["tools", tools, one_call], build)
