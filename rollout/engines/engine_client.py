"""Async client for SGLang's native HTTP API — the subset trajmesh's rollout uses.

Works against SGLang 0.4.10.post2 and 0.5.x and against the built-in torch engine
(``trajmesh.rollout.engines.engine_server``). It depends only on documented fields: ``output_ids``,
``meta_info.finish_reason``, ``meta_info.output_token_logprobs`` (``[logprob, token_id, text]``
triples) and, when present, ``meta_info.weight_version`` (a string in SGLang ≥ 0.5: ``"default"``
until the first ``/update_weights_from_disk`` that names a version; absent in 0.4.10) and
``meta_info.weight_versions`` (0.5.x: ``[{"version", "start", "end"}, ...]`` spans over the output;
the torch engine: ``[start, end, version]`` spans or one version per token). No torch import.

``EngineClient.probe`` asks the server once what it is (``EngineCapabilities``: its version, the
longest prompt it takes, whether ``sampling_seed`` is a field it accepts, whether it reports weight
versions, its pause modes); ``TurnSampler`` (rollout/engines/generation.py) builds every request from that
record, so no request carries a field the server rejects or a prompt it refuses.

SGLang answers a batch request with one refused sample (a prompt too long, a bad field) with one
HTTP error for the whole batch while the samples sent before it keep running; ``CoalescingEngine``
refuses samples over the probed limits before sending, and on a 4xx aborts the batch's requests
(by ``rid``) before retrying them one request each, so only the offending sample fails and no
sample is generated twice.
"""

from __future__ import annotations

import asyncio
import uuid
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import aiohttp

if TYPE_CHECKING:
    from typing_extensions import Self


ANSWER_LOG_ENV = "TRAJMESH_ENGINE_ANSWER_LOG"
"""For tests: a directory where each torch engine server (rollout/engines/engine_server.py) writes every
answer it gives (prompt ids, output ids, log-probs, weight version) to ``engine-<pid>.jsonl``, so a
mesh test can check that the tokens the learner trained are the ones the engine sampled
(tests/mesh_checks.py `check_engine_tokens`)."""

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


SPANS_DICT, SPANS_LIST, PER_TOKEN, NO_VERSIONS = "spans_dict", "spans_list", "per_token", "none"


@dataclass(frozen=True)
class EngineCapabilities:
    """What the engine's server accepts and reports, probed once at engine start (``EngineClient.probe``;
    ``assumed`` for an engine that is not probed)."""

    server_version: str | None
    """The server's own version (SGLang's ``version`` in /server_info or /get_server_info, e.g.
    ``"0.4.10.post2"``; the torch engine's ``"trajmesh-torch-engine"``); None if it reports none."""
    context_len: int | None
    """Prompt + ``max_new_tokens`` must stay below this (exclusive). The smallest of the server's
    ``context_length`` (SGLang: a server argument, None unless set; the torch engine: its model's)
    and ``max_req_input_len + 5`` (SGLang's ``max_req_len = min(ctx - 1, kv_pool - 1)``: its
    scheduler caps ``max_new_tokens`` at ``max_req_len - 1 - prompt``). None: no limit known."""
    max_input_len: int | None
    """A prompt must be shorter than this (SGLang's ``max_req_input_len = max_req_len - 5``; a prompt
    at it is refused in the scheduler, HTTP 400). None: no limit known."""
    sampling_seed: bool
    """The server accepts the ``sampling_seed`` sampling field (SGLang 0.4.10.post2 does not: its
    ``SamplingParams.__init__`` has no such argument and the request is an HTTP 500)."""
    weight_versions: str
    """How responses carry the policy version of their tokens: ``spans_dict`` (SGLang 0.5.x
    ``weight_versions``), ``spans_list`` / ``per_token`` (the torch engine), ``none`` (only a
    ``weight_version`` string, or nothing: SGLang 0.4.10)."""
    reports_weight_version: bool
    """Responses and /model_info carry ``weight_version`` (SGLang ≥ 0.5, the torch engine; not 0.4.10)."""
    pause_modes: tuple[str, ...]
    """``/pause_generation`` modes: ``abort``, ``retract``, ``in_place`` on SGLang 0.5.x; ``("abort",)``
    elsewhere (0.4.10 takes no body: it aborts every request and parks new ones until
    ``/continue_generation``; the torch engine)."""

    @staticmethod
    def assumed(context_len: int | None) -> EngineCapabilities:
        """An engine this client does not probe (the synthetic engine, a test double): the torch
        engine's surface with the given context length."""
        return EngineCapabilities(server_version=None, context_len=context_len, max_input_len=None,
                                  sampling_seed=True, weight_versions=NO_VERSIONS, reports_weight_version=True,
                                  pause_modes=("abort",))

    def fits(self, prompt_len: int, max_new_tokens: int) -> bool:
        """Whether the server takes a prompt of `prompt_len` tokens asking `max_new_tokens`."""
        if self.max_input_len is not None and prompt_len >= self.max_input_len:
            return False
        return self.context_len is None or prompt_len + max_new_tokens < self.context_len

    def room(self, prompt_len: int) -> int | None:
        """The most ``max_new_tokens`` a prompt of `prompt_len` tokens may ask (0: the server refuses
        the prompt itself); None: no limit known."""
        if self.max_input_len is not None and prompt_len >= self.max_input_len:
            return 0
        return None if self.context_len is None else max(0, self.context_len - 1 - prompt_len)


def _version_tuple(version: str | None) -> tuple[int, ...] | None:
    """``"0.5.23"`` -> (0, 5, 23); ``"0.4.10.post2"`` -> (0, 4, 10); None for anything else."""
    if not version:
        return None
    parts: list[int] = []
    for piece in str(version).split(".")[:3]:
        digits = "".join(ch for ch in piece if ch.isdigit()) if piece[:1].isdigit() else ""
        if not digits:
            return None
        parts.append(int(digits))
    return tuple(parts)


def _weight_versions_format(meta: dict[str, Any]) -> str:
    reported = meta.get("weight_versions")
    if not isinstance(reported, list) or not reported:
        return NO_VERSIONS
    if all(isinstance(s, dict) for s in reported):
        return SPANS_DICT
    if all(isinstance(s, (list, tuple)) for s in reported):
        return SPANS_LIST
    return PER_TOKEN


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
    """The policy version of each output token: the server's ``weight_versions`` when it reports
    them (spans as SGLang 0.5.x's ``{"version", "start", "end"}`` dicts or ``[start, end, version]``
    lists, or one version per token), else the response's ``weight_version``, else `fallback` (the
    caller's version for tokens the engine does not label, see ``TurnSampler``)."""
    n = len(result.output_ids)
    reported: Any = result.meta_info.get("weight_versions")
    fmt = _weight_versions_format(result.meta_info)
    if fmt == SPANS_DICT:
        reported = _spans_to_tokens([(s.get("start"), s.get("end"), s.get("version")) for s in reported], n)
    elif fmt == SPANS_LIST:
        reported = _spans_to_tokens(reported, n)  # [[start, end, version], ...] over output positions
    if isinstance(reported, list) and len(reported) == n and n:
        return [v if v is not None else fallback for v in map(parse_weight_version, reported)]
    version = parse_weight_version(result.weight_version)
    return [fallback if version is None else version] * n


def _spans_to_tokens(spans: list[Any], n: int) -> list[Any] | None:
    """Per-token versions from ``(start, end, version)`` spans (end exclusive) that tile 0..n; a
    span past n is cut at n (SGLang cuts its spans at the tokens it returns). None if they do not tile."""
    out: list[Any] = []
    try:
        for start, end, version in spans:
            start, end = int(start), min(int(end), n)
            if start != len(out) or end < start:
                return None
            out += [version] * (end - start)
    except (TypeError, ValueError):
        return None
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


class HttpSession:
    """One aiohttp session to an engine's HTTP API, shared by the engine clients (this module's
    SGLang-style client, rollout/engines/vllm_engine.py's): generation requests have no total timeout (the
    caller bounds generation time without the time the engine spends paused for weight loads,
    services/rollout.py); control calls are bounded by `timeout_s`."""

    def __init__(self, base_url: str, *, timeout_s: float = 600.0) -> None:
        self.base_url = base_url.rstrip("/")
        self._timeout = aiohttp.ClientTimeout(total=None, sock_connect=30.0)
        self._control_timeout = aiohttp.ClientTimeout(total=timeout_s)
        self._session: aiohttp.ClientSession | None = None

    async def __aenter__(self) -> Self:
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


class EngineClient(HttpSession):
    """``async with EngineClient(url) as engine: await engine.generate(ids, {...})``."""

    def __init__(self, base_url: str, *, timeout_s: float = 600.0) -> None:
        super().__init__(base_url, timeout_s=timeout_s)
        self.capabilities: EngineCapabilities | None = None
        """What the server accepts and reports (None until ``probe``)."""

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
        return_logprob: bool = True, *, rid: str | list[str] | None = None,
    ) -> GenerateResult | list[GenerateResult]:
        """POST /generate. A list of prompts gives a list of results (one HTTP batch request).

        ``sampling`` is SGLang's ``sampling_params`` (temperature, top_p, top_k, max_new_tokens,
        stop_token_ids, ...): one dict for every prompt, or one per prompt of a batch. ``rid``: the
        request id(s) the server files them under (``abort`` takes them).
        """
        body: dict[str, Any] = {"input_ids": input_ids, "sampling_params": sampling, "return_logprob": return_logprob}
        if rid is not None:
            body["rid"] = rid
        data = await self._post("/generate", body, control=False)
        if isinstance(data, list):
            return [_parse_result(d, return_logprob) for d in data]
        return _parse_result(data, return_logprob)

    async def score(self, sequences: list[list[int]]) -> list[list[float]]:
        """The server's log-prob of each token of each sequence given the tokens before it (a
        teacher scoring a student's sample: on-policy distillation, rollout/engines/teacher.py), at
        temperature 1: one list of ``len(seq) - 1`` floats a sequence, for tokens 1..n-1. One batch
        request: SGLang's ``return_logprob`` with ``logprob_start_len`` 0 answers
        ``meta_info.input_token_logprobs``, ``[logprob, token_id, text]`` from the first input token
        on, the first ``None`` (nothing precedes it); 0.4.10.post2 and 0.5.x alike. One new token is
        asked (``max_new_tokens`` 1: 0.5.x would serve 0 prefill-only, 0.4.10 samples one anyway)."""
        if not sequences or any(len(s) < 2 for s in sequences):
            raise ValueError("each sequence to score needs at least two tokens")
        body: dict[str, Any] = {"input_ids": [list(map(int, s)) for s in sequences],
                                "sampling_params": {"max_new_tokens": 1, "temperature": 1.0},
                                "return_logprob": True, "logprob_start_len": 0}
        data = await self._post("/generate", body, control=False)
        if not isinstance(data, list) or len(data) != len(sequences):
            raise EngineError(f"/generate answered {type(data).__name__} for a batch of {len(sequences)}")
        out: list[list[float]] = []
        for seq, item in zip(sequences, data, strict=True):
            triples = (item.get("meta_info") or {}).get("input_token_logprobs") or []
            if len(triples) != len(seq) or any(t[0] is None for t in triples[1:]):
                raise EngineError(f"input_token_logprobs has {len(triples)} entries for {len(seq)} tokens")
            out.append([float(t[0]) for t in triples[1:]])
        return out

    async def abort(self, rid: str) -> bool:
        """POST /abort_request for one request id (SGLang 0.4.10 and 0.5.x); False when the server
        has no such endpoint or refuses (the torch engine: its requests end with their HTTP call)."""
        try:
            await self._post("/abort_request", {"rid": rid})
        except (EngineError, aiohttp.ClientError, TimeoutError):
            return False
        return True

    async def update_weights_from_disk(
        self,
        path: str,
        version: int | str | None = None,
        *,
        load_format: str | None = None,
        abort_all_requests: bool = False,
    ) -> str:
        """POST /update_weights_from_disk; raises ``EngineError`` unless ``success``. Returns the
        message. The version goes as ``weight_version`` unless the probed server keeps none (0.4.10)."""
        body: dict[str, Any] = {"model_path": path, "abort_all_requests": abort_all_requests}
        if version is not None and (self.capabilities is None or self.capabilities.reports_weight_version):
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
        """POST /pause_generation (mode abort): in-flight requests return partial output, finish_reason
        abort. SGLang 0.4.10 takes no mode (it always aborts) and parks requests that arrive while
        paused until /continue_generation."""
        await self._post("/pause_generation", {"mode": "abort"})

    async def resume(self) -> None:
        """POST /continue_generation."""
        await self._post("/continue_generation", {})

    async def flush_cache(self) -> None:
        await self._post("/flush_cache")

    async def _get_json(self, path: str) -> Any:
        async with self._http().get(self.base_url + path, timeout=self._control_timeout) as resp:
            if resp.status // 100 != 2:
                raise EngineError(f"GET {path} -> {resp.status}: {await resp.text()}", resp.status)
            return await resp.json(content_type=None)

    async def _get_first(self, *paths: str) -> dict[str, Any]:
        """The first of `paths` the server serves (a 404 moves on: SGLang 0.5.x renamed
        /get_server_info and /get_model_info to /server_info and /model_info, deprecating the old)."""
        for path in paths[:-1]:
            try:
                return dict(await self._get_json(path))
            except EngineError as exc:
                if exc.status != 404:
                    raise
        return dict(await self._get_json(paths[-1]))

    async def model_info(self) -> dict[str, Any]:
        """/model_info (SGLang 0.5.x), else /get_model_info (0.4.10, the torch engine)."""
        return await self._get_first("/model_info", "/get_model_info")

    async def server_info(self) -> dict[str, Any]:
        """/server_info (SGLang 0.5.x), else /get_server_info (0.4.10, the torch engine)."""
        return await self._get_first("/server_info", "/get_server_info")

    async def probe(self) -> EngineCapabilities:
        """What the server is (``EngineCapabilities``), asked once and kept in ``capabilities``:
        its server and model info, then a one-token greedy /generate with ``sampling_seed``; an HTTP
        error for it that the same request without the field does not get means the server rejects
        the field (SGLang 0.4.10.post2: HTTP 500). The answer shows the weight-version format."""
        if self.capabilities is not None:
            return self.capabilities
        server, model = await self.server_info(), await self.model_info()
        limits = [int(v) for v in (server.get("context_length"), model.get("context_length")) if v]
        max_input = server.get("max_req_input_len")
        if max_input:
            limits.append(int(max_input) + 5)  # max_req_len: the scheduler caps max_new_tokens below it
        sampling: dict[str, Any] = {"max_new_tokens": 1, "temperature": 0.0}
        try:
            answer = await self.generate([0], {**sampling, "sampling_seed": 0})
            seed_ok = True
        except EngineError as exc:
            if exc.status is None:
                raise
            answer, seed_ok = await self.generate([0], sampling), False
        assert isinstance(answer, GenerateResult)
        version = server.get("version")
        numeric = _version_tuple(version)
        self.capabilities = EngineCapabilities(
            server_version=None if version is None else str(version),
            context_len=min(limits) if limits else None,
            max_input_len=int(max_input) if max_input else None,
            sampling_seed=seed_ok,
            weight_versions=_weight_versions_format(answer.meta_info),
            reports_weight_version="weight_version" in model or answer.weight_version is not None,
            pause_modes=("abort", "retract", "in_place") if numeric is not None and numeric >= (0, 5) else ("abort",),
        )
        return self.capabilities

    async def context_length(self) -> int | None:
        """The longest prompt + ``max_new_tokens`` the engine accepts, exclusive
        (``EngineCapabilities.context_len``, probed); None if the engine says nothing."""
        return (await self.probe()).context_len

    async def load(self) -> EngineLoad:
        """The engine's load in one shape: SGLang 0.5.x's /v1/loads (``{"loads": [{num_running_reqs,
        num_waiting_reqs, num_used_tokens, ...}]}`` per data-parallel rank), 0.4.10's /get_load
        (``{"load": tokens}``: KV tokens in use plus waiting prompt tokens, no request counts), or
        the torch engine's /get_load (``[{num_reqs, num_waiting_reqs}]``)."""
        try:
            data = await self._get_json("/v1/loads")
        except EngineError as exc:
            if exc.status != 404:
                raise
            data = await self._get_json("/get_load")
        return EngineLoad.parse(data)

    async def health(self, *, generate: bool = False) -> bool:
        """GET /health (or /health_generate); False on any connection error or non-200."""
        path = "/health_generate" if generate else "/health"
        try:
            async with self._http().get(self.base_url + path, timeout=self._control_timeout) as resp:
                return resp.status == 200
        except (aiohttp.ClientError, TimeoutError):
            return False


@dataclass(frozen=True)
class EngineLoad:
    """An engine's load summed over its data-parallel ranks; None where the server does not say."""

    running_reqs: int | None
    """Requests being decoded."""
    waiting_reqs: int | None
    """Requests queued, not yet scheduled."""
    tokens: int | None
    """KV-cache tokens in use (SGLang 0.4.10: plus the waiting prompts' tokens)."""

    @staticmethod
    def parse(data: Any) -> EngineLoad:
        """From any of the three shapes ``EngineClient.load`` reads; EngineError for another."""
        if isinstance(data, dict) and isinstance(data.get("loads"), list):  # SGLang 0.5.x /v1/loads
            ranks = data["loads"]
            return EngineLoad(sum(int(r.get("num_running_reqs", 0)) for r in ranks),
                              sum(int(r.get("num_waiting_reqs", 0)) for r in ranks),
                              sum(int(r.get("num_used_tokens", 0)) for r in ranks))
        if isinstance(data, dict) and "load" in data:  # SGLang 0.4.10 /get_load
            return EngineLoad(None, None, int(data["load"]))
        if isinstance(data, list) and all(isinstance(r, dict) for r in data):  # the torch engine
            return EngineLoad(sum(int(r.get("num_reqs", 0)) for r in data),
                              sum(int(r.get("num_waiting_reqs", 0)) for r in data), None)
        raise EngineError(f"unknown load answer: {str(data)[:200]}")


class CoalescingEngine:
    """Sends the single-prompt ``generate`` calls made within `window_s` of each other as one batch
    request (SGLang and the torch engine both take a list of ``input_ids`` with one
    ``sampling_params`` per prompt), so G samples of a group cost one HTTP round trip, not G.

    Each caller still gets its own ``GenerateResult`` (aborted ones included: a pause aborts every
    prompt of a batch, and each caller resubmits its own). A sample over the probed limits
    (``EngineCapabilities.fits``) fails its caller with a 400 before anything is sent. An HTTP 4xx
    for a batch of several aborts the batch's requests by ``rid`` (SGLang keeps running those sent
    before the refused one) and retries them one request per sample, so one bad sample fails only
    its own caller; any other error fails every call of the batch it was in. Everything but
    ``generate`` is the wrapped client's.
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
        self.refused_unsent = 0
        """Samples failed before sending: over the probed input or context limit."""

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

    def _refuse_unfit(self, batch: list[tuple[list[int], dict[str, Any], asyncio.Future[GenerateResult]]]
                      ) -> list[tuple[list[int], dict[str, Any], asyncio.Future[GenerateResult]]]:
        """The samples of `batch` the probed server takes; the others fail now with a 400."""
        caps = self.client.capabilities
        if caps is None:
            return batch
        fit = []
        for ids, sp, fut in batch:
            max_new = int(sp.get("max_new_tokens") or 0)
            if caps.fits(len(ids), max_new):
                fit.append((ids, sp, fut))
            elif not fut.done():
                self.refused_unsent += 1
                fut.set_exception(EngineError(
                    f"prompt of {len(ids)} tokens + max_new_tokens {max_new} over the engine's limits "
                    f"(input < {caps.max_input_len}, total < {caps.context_len}); not sent", 400))
        return fit

    async def _send(self, batch: list[tuple[list[int], dict[str, Any], asyncio.Future[GenerateResult]]]) -> None:
        live = self._refuse_unfit([b for b in batch if not b[2].done()])  # a cancelled caller needs no tokens
        if not live:
            return
        self.requests_sent += 1
        rids = [f"trajmesh-{uuid.uuid4().hex}" for _ in live]
        try:
            results = await self.client.generate([ids for ids, _, _ in live], [sp for _, sp, _ in live], rid=rids)
            if not (isinstance(results, list) and len(results) == len(live)):
                raise EngineError("batch answer of the wrong length")
        except EngineError as exc:
            if len(live) > 1 and exc.status is not None and 400 <= exc.status < 500:
                self.isolated_batches += 1
                await asyncio.gather(*(self.client.abort(r) for r in rids))
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


def reported_version(url: str, path: str, timeout_s: float = 5.0) -> str:
    """The ``version`` field of the JSON an engine server answers at `path` (recorded in the run
    manifest); "unknown" without one, "unreachable" when it does not answer. Blocking (urllib)."""
    import json
    import urllib.request

    try:
        with urllib.request.urlopen(f"{url.rstrip('/')}{path}", timeout=timeout_s) as resp:  # noqa: S310
            return str(json.loads(resp.read()).get("version", "unknown"))
    except (OSError, ValueError):
        return "unreachable"
