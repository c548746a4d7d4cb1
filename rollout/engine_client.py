"""Async client for SGLang's native HTTP API — the subset trajmesh's rollout uses.

Works against a real SGLang server and against the built-in torch engine
(``trajmesh.rollout.engine_server``). It depends only on documented fields: ``output_ids``,
``meta_info.finish_reason``, ``meta_info.output_token_logprobs`` (``[logprob, token_id, text]``
triples) and, when present, ``meta_info.weight_version`` (a string in SGLang ≥ 0.5: ``"default"``
until the first ``/update_weights_from_disk`` that names a version; absent in 0.4.10) and a
per-token ``meta_info.weight_versions`` list. No torch import.

SGLang answers a request it cannot take (a prompt plus ``max_new_tokens`` longer than the
context) with HTTP 400 for the whole batch request; ``CoalescingEngine`` then retries that
batch's samples one request each, so only the offending sample fails.
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

    def __init__(self, message: str, status: int | None = None) -> None:
        super().__init__(message)
        self.status = status
        """HTTP status of the answer (None: no answer, or a malformed one)."""


def parse_weight_version(raw: str | int | None) -> int | None:
    """SGLang's ``weight_version`` as a policy version: ``"default"`` (SGLang ≥ 0.5 before any
    update names one) is version 0, a numeric string its number, None (SGLang 0.4.10) None.
    Anything else is an EngineError: the engine was given versions by someone else."""
    if raw is None:
        return None
    text = str(raw).strip()
    if text == "default":
        return 0
    try:
        return int(text)
    except ValueError:
        raise EngineError(f"weight_version {text!r} is neither 'default' nor an integer") from None


def token_versions(result: GenerateResult, fallback: int) -> list[int]:
    """The policy version of each output token: SGLang's per-token ``weight_versions`` when the
    server reports them, else the response's ``weight_version``, else `fallback` (the version the
    caller had loaded when it sent the request)."""
    n = len(result.output_ids)
    reported = result.meta_info.get("weight_versions")
    if isinstance(reported, list) and reported and all(isinstance(s, (list, tuple)) for s in reported):
        reported = _spans_to_tokens(reported, n)  # [[start, end, version], ...] over output positions
    if isinstance(reported, list) and len(reported) == n and n:
        return [v if v is not None else fallback for v in map(parse_weight_version, reported)]
    version = parse_weight_version(result.weight_version)
    return [fallback if version is None else version] * n


def _spans_to_tokens(spans: list[Any], n: int) -> list[Any] | None:
    """Per-token versions from ``[start, end, version]`` spans (end exclusive) that tile 0..n."""
    out: list[Any] = []
    for start, end, version in spans:
        if int(start) != len(out) or int(end) < int(start):
            return None
        out += [version] * (int(end) - int(start))
    return out if len(out) == n else None


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
        # /generate has no total timeout here: the caller bounds generation time without the time
        # the engine spends paused for weight loads (services/rollout.py). Control calls do.
        self._timeout = aiohttp.ClientTimeout(total=None, sock_connect=30.0)
        self._control_timeout = aiohttp.ClientTimeout(total=timeout_s)
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

    async def _post(self, path: str, body: dict[str, Any] | None = None, *, control: bool = True) -> Any:
        timeout = self._control_timeout if control else self._timeout
        async with self._http().post(self.base_url + path, json=body or {}, timeout=timeout) as resp:
            if resp.status // 100 != 2:
                raise EngineError(f"POST {path} -> {resp.status}: {await resp.text()}", resp.status)
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
        data = await self._post("/generate", body, control=False)
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
        async with self._http().post(self.base_url + "/update_weights_from_disk", json=body,
                                     timeout=aiohttp.ClientTimeout(total=None)) as resp:
            data = await resp.json(content_type=None)
            status = resp.status
        if not data.get("success"):
            raise EngineError(f"weight update from {path} failed: {data.get('message')}", status)
        return str(data.get("message", ""))

    async def pause(self) -> None:
        """POST /pause_generation (mode abort): in-flight requests return partial output, finish_reason abort."""
        await self._post("/pause_generation", {"mode": "abort"})

    async def resume(self) -> None:
        """POST /continue_generation."""
        await self._post("/continue_generation", {})

    async def flush_cache(self) -> None:
        await self._post("/flush_cache")

    async def _get_json(self, path: str) -> dict[str, Any]:
        async with self._http().get(self.base_url + path, timeout=self._control_timeout) as resp:
            if resp.status // 100 != 2:
                raise EngineError(f"GET {path} -> {resp.status}: {await resp.text()}", resp.status)
            return await resp.json(content_type=None)

    async def model_info(self) -> dict[str, Any]:
        return await self._get_json("/get_model_info")

    async def context_length(self) -> int | None:
        """The longest prompt + ``max_new_tokens`` the engine accepts, exclusive: ``context_length``
        of /get_model_info when served, else /get_server_info's ``context_length`` (SGLang's server
        argument, None unless set) or ``max_req_input_len`` + 1; None if the engine says neither."""
        info = await self.model_info()
        if info.get("context_length"):
            return int(info["context_length"])
        server = await self._get_json("/get_server_info")
        if server.get("context_length"):
            return int(server["context_length"])
        if server.get("max_req_input_len"):
            return int(server["max_req_input_len"]) + 1
        return None

    async def health(self, *, generate: bool = False) -> bool:
        """GET /health (or /health_generate); False on any connection error or non-200."""
        path = "/health_generate" if generate else "/health"
        try:
            async with self._http().get(self.base_url + path, timeout=self._control_timeout) as resp:
                return resp.status == 200
        except (aiohttp.ClientError, TimeoutError):
            return False


class CoalescingEngine:
    """Sends the single-prompt ``generate`` calls made within `window_s` of each other as one batch
    request (SGLang and the torch engine both take a list of ``input_ids`` with one
    ``sampling_params`` per prompt), so G samples of a group cost one HTTP round trip, not G.

    Each caller still gets its own ``GenerateResult`` (aborted ones included: a pause aborts every
    prompt of a batch, and each caller resubmits its own). An HTTP 4xx for a batch of several is
    retried one request per sample, so one bad sample fails only its own caller; any other error
    fails every call of the batch it was in. Everything but ``generate`` is the wrapped client's.
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
        self.isolated_batches = 0
        """Batch requests refused with a 4xx and retried one request per sample."""

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
            if not (isinstance(results, list) and len(results) == len(live)):
                raise EngineError("batch answer of the wrong length")
        except EngineError as exc:
            if len(live) > 1 and exc.status is not None and 400 <= exc.status < 500:
                self.isolated_batches += 1
                await asyncio.gather(*(self._send([b]) for b in live))
                return
            self._fail(live, exc)
            return
        except Exception as exc:  # noqa: BLE001 - handed to every caller of this batch
            self._fail(live, exc)
            return
        for (_, _, fut), res in zip(live, results, strict=True):
            if not fut.done():
                fut.set_result(res)

    @staticmethod
    def _fail(batch: list[tuple[list[int], dict[str, Any], asyncio.Future[GenerateResult]]],
              exc: BaseException) -> None:
        for _, _, fut in batch:
            if not fut.done():
                fut.set_exception(exc)

    async def close(self) -> None:
        for task in list(self._sending):
            task.cancel()
        await self.client.close()
