"""Async client for SGLang's native HTTP API — the subset trajmesh's rollout uses.

Works against a real SGLang server and against the built-in torch engine
(``trajmesh.rollout.engine_server``). It depends only on documented fields: ``output_ids``,
``meta_info.finish_reason``, ``meta_info.output_token_logprobs`` (``[logprob, token_id, text]``
triples) and, when present, ``meta_info.weight_version`` (a string in SGLang; optional here).
No torch import.
"""

from __future__ import annotations

import asyncio
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
        self, input_ids: list[int] | list[list[int]], sampling: dict[str, Any] | list[dict[str, Any]],
        return_logprob: bool = True,
    ) -> GenerateResult | list[GenerateResult]:
        """POST /generate. A list of prompts gives a list of results (one HTTP batch request).

        ``sampling`` is SGLang's ``sampling_params`` (temperature, top_p, top_k, max_new_tokens,
        stop_token_ids, ...): one dict for every prompt, or one per prompt of a batch.
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


class CoalescingEngine:
    """Sends the single-prompt ``generate`` calls made within `window_s` of each other as one batch
    request (SGLang and the torch engine both take a list of ``input_ids`` with one
    ``sampling_params`` per prompt), so G samples of a group cost one HTTP round trip, not G.

    Each caller still gets its own ``GenerateResult`` (aborted ones included: a pause aborts every
    prompt of a batch, and each caller resubmits its own). An HTTP error fails every call of the
    batch it was in. Everything but ``generate`` is the wrapped client's.
    """

    def __init__(self, client: EngineClient, *, window_s: float = 0.002, max_batch: int = 256) -> None:
        self.client = client
        self.window_s = window_s
        self.max_batch = max_batch
        self._pending: list[tuple[list[int], dict[str, Any], asyncio.Future[GenerateResult]]] = []
        self._flush_scheduled = False
        self._sending: set[asyncio.Task[None]] = set()
        self.requests_sent = 0
        """HTTP /generate requests made (for tests and metrics)."""

    def __getattr__(self, name: str) -> Any:
        return getattr(self.client, name)

    async def generate(self, input_ids: list[int], sampling: dict[str, Any], return_logprob: bool = True
                       ) -> GenerateResult:
        if not return_logprob:
            raise ValueError("CoalescingEngine always requests log-probs")
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[GenerateResult] = loop.create_future()
        self._pending.append((list(input_ids), dict(sampling), fut))
        if len(self._pending) >= self.max_batch:
            self._flush()
        elif not self._flush_scheduled:
            self._flush_scheduled = True
            loop.call_later(self.window_s, self._flush)
        return await fut

    def _flush(self) -> None:
        self._flush_scheduled = False
        pending, self._pending = self._pending, []
        for i in range(0, len(pending), self.max_batch):
            task = asyncio.ensure_future(self._send(pending[i:i + self.max_batch]))
            self._sending.add(task)
            task.add_done_callback(self._sending.discard)

    async def _send(self, batch: list[tuple[list[int], dict[str, Any], asyncio.Future[GenerateResult]]]) -> None:
        live = [b for b in batch if not b[2].done()]  # a cancelled caller needs no tokens
        if not live:
            return
        self.requests_sent += 1
        try:
            results = await self.client.generate([ids for ids, _, _ in live], [sp for _, sp, _ in live])
            assert isinstance(results, list) and len(results) == len(live), "batch answer of the wrong length"
        except Exception as exc:  # noqa: BLE001 - handed to every caller of this batch
            for _, _, fut in live:
                if not fut.done():
                    fut.set_exception(exc)
            return
        for (_, _, fut), res in zip(live, results, strict=True):
            if not fut.done():
                fut.set_result(res)

    async def close(self) -> None:
        for task in list(self._sending):
            task.cancel()
        await self.client.close()
