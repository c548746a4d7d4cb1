"""Async client for SGLang's native HTTP API — the subset trajmesh's rollout uses.

Works against a real SGLang server and against the built-in torch engine
(``trajmesh.rollout.engine_server``). It depends only on documented fields: ``output_ids``,
``meta_info.finish_reason``, ``meta_info.output_token_logprobs`` (``[logprob, token_id, text]``
triples) and, when present, ``meta_info.weight_version`` (a string in SGLang; optional here).
No torch import.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import aiohttp


@dataclass
class GenerateResult:
    """One generated continuation."""

    output_ids: list[int]
    """Generated token ids, the stop token (e.g. EOS) included when it ended the request."""
    logprobs: list[float] | None
    """Behavior log-prob of each output token under the sampling distribution; None if not requested."""
    finish_reason: dict[str, Any]
    """SGLang finish reason: ``{"type": "stop"|"length"|"abort", ...}``."""
    weight_version: str | None
    """Policy version that produced the tokens (``meta_info.weight_version``); None if the server omits it."""
    text: str = ""
    meta_info: dict[str, Any] = field(default_factory=dict)

    @property
    def aborted(self) -> bool:
        return self.finish_reason.get("type") == "abort"


class EngineError(RuntimeError):
    """The engine answered with a non-2xx status or an unsuccessful weight update."""


def _parse_result(item: dict[str, Any], return_logprob: bool) -> GenerateResult:
    meta = item.get("meta_info") or {}
    output_ids = [int(t) for t in item.get("output_ids") or []]
    logprobs = None
    if return_logprob:
        triples = meta.get("output_token_logprobs") or []
        ids = [int(t[1]) for t in triples]
        if output_ids and ids != output_ids:
            raise EngineError("output_token_logprobs token ids disagree with output_ids")
        output_ids = output_ids or ids
        logprobs = [float(t[0]) for t in triples]
    version = meta.get("weight_version")
    return GenerateResult(
        output_ids=output_ids,
        logprobs=logprobs,
        finish_reason=dict(meta.get("finish_reason") or {"type": "abort", "message": "no finish_reason"}),
        weight_version=None if version is None else str(version),
        text=item.get("text") or "",
        meta_info=meta,
    )


class EngineClient:
    """``async with EngineClient(url) as engine: await engine.generate(ids, {...})``."""

    def __init__(self, base_url: str, *, timeout_s: float = 600.0) -> None:
        self.base_url = base_url.rstrip("/")
        self._timeout = aiohttp.ClientTimeout(total=timeout_s)
        self._session: aiohttp.ClientSession | None = None

    async def __aenter__(self) -> EngineClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    def _http(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            self._session = aiohttp.ClientSession(timeout=self._timeout)
        return self._session

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    async def _post(self, path: str, body: dict[str, Any] | None = None) -> Any:
        async with self._http().post(self.base_url + path, json=body or {}) as resp:
            if resp.status // 100 != 2:
                raise EngineError(f"POST {path} -> {resp.status}: {await resp.text()}")
            if resp.content_type == "application/json":
                return await resp.json()
            return await resp.text()

    async def generate(
        self, input_ids: list[int] | list[list[int]], sampling: dict[str, Any], return_logprob: bool = True
    ) -> GenerateResult | list[GenerateResult]:
        """POST /generate. A list of prompts gives a list of results (one HTTP batch request).

        ``sampling`` is SGLang's ``sampling_params`` (temperature, top_p, top_k, max_new_tokens,
        stop_token_ids, ...).
        """
        body = {"input_ids": input_ids, "sampling_params": sampling, "return_logprob": return_logprob}
        data = await self._post("/generate", body)
        if isinstance(data, list):
            return [_parse_result(d, return_logprob) for d in data]
        return _parse_result(data, return_logprob)

    async def update_weights_from_disk(
        self,
        path: str,
        version: int | str | None = None,
        *,
        load_format: str | None = None,
        abort_all_requests: bool = False,
    ) -> str:
        """POST /update_weights_from_disk; raises ``EngineError`` unless ``success``. Returns the message."""
        body: dict[str, Any] = {"model_path": path, "abort_all_requests": abort_all_requests}
        if version is not None:
            body["weight_version"] = str(version)
        if load_format is not None:
            body["load_format"] = load_format
        async with self._http().post(self.base_url + "/update_weights_from_disk", json=body) as resp:
            data = await resp.json(content_type=None)
        if not data.get("success"):
            raise EngineError(f"weight update from {path} failed: {data.get('message')}")
        return str(data.get("message", ""))

    async def pause(self) -> None:
        """POST /pause_generation (mode abort): in-flight requests return partial output, finish_reason abort."""
        await self._post("/pause_generation", {"mode": "abort"})

    async def resume(self) -> None:
        """POST /continue_generation."""
        await self._post("/continue_generation", {})

    async def flush_cache(self) -> None:
        await self._post("/flush_cache")

    async def model_info(self) -> dict[str, Any]:
        async with self._http().get(self.base_url + "/get_model_info") as resp:
            return await resp.json(content_type=None)

    async def health(self, *, generate: bool = False) -> bool:
        """GET /health (or /health_generate); False on any connection error or non-200."""
        path = "/health_generate" if generate else "/health"
        try:
            async with self._http().get(self.base_url + path) as resp:
                return resp.status == 200
        except (aiohttp.ClientError, TimeoutError):
            return False
