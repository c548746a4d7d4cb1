"""One turn of sampling that survives the engine: the rollout's side of the SGLang contract.

```
 run_episode ──▶ TurnSampler.sample(context) ──▶ engine /generate (prompt + tokens so far)
                    ▲  │ waits for PauseClock.ready (cleared while weights load)
                    │  ▼
                    │  stop token last?  ── yes ─▶ done "stop" (even if finish_reason says abort:
                    │        │ no                   SGLang checks abort before EOS)
                    │  abort? ─ our pause (epoch moved) ─▶ resubmit after the load, no count
                    └──────── other origin ─▶ backoff, resubmit; past max_abort_retries: EngineFailed
 An HTTP error or a timeout (counted without the time the engine spent paused) is EngineFailed:
 the caller ends that one trajectory as INFRA_FAILURE, counted under the reason.
```

Every request is built from the engine's probed ``EngineCapabilities`` (rollout/engines/engine_client.py):
``max_new_tokens`` is capped so prompt + output stays below its context limit, a prompt at its
input limit (SGLang's ``max_req_input_len``) is not sent (SGLang refuses it with HTTP 400) — no
room left ends the turn as ``length`` — and ``sampling_seed`` goes only to a server that accepts it.

Tokens the engine does not label with a version (SGLang 0.4.10) get the version loaded when the
request was sent, except an answer that was not aborted although a pause began while it was out:
SGLang 0.4.10 aborts what runs at a pause and parks what arrives during it until
``/continue_generation``, so such an answer ran after the load and gets the version loaded when it
arrived.
"""

from __future__ import annotations

import asyncio
import hashlib
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from prometheus_client import Counter, Histogram

from trajmesh.config import EngineConfig
from trajmesh.rollout.engines import HttpEngineConfig
from trajmesh.rollout.engines.base import Engine
from trajmesh.rollout.engines.engine_client import (
    EngineCapabilities,
    EngineError,
    GenerateResult,
    token_versions,
)

TOKENS = Counter("trajmesh_rollout_generated_tokens_total", "Tokens sampled by the engine")
INTERRUPTIONS = Counter("trajmesh_rollout_interrupted_requests_total", "Generations resumed after an abort")
ENGINE_FAILURES = Counter("trajmesh_rollout_engine_failures_total",
                          "Trajectories ended as INFRA_FAILURE by the engine, by reason", ["reason"])
GENERATE_SECONDS = Histogram("trajmesh_rollout_generate_seconds", "Latency of one engine /generate request",
                             buckets=(0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60))
ENGINE_REQUESTS = Counter("trajmesh_rollout_engine_requests_total", "Engine /generate requests by finish reason",
                          ["finish_reason"])
FAILURE_REASONS = ("http_4xx", "http_5xx", "timeout", "aborted", "bad_response")
for _reason in FAILURE_REASONS:
    ENGINE_FAILURES.labels(reason=_reason)
for _finish in ("stop", "length", "abort"):
    ENGINE_REQUESTS.labels(finish_reason=_finish)
MAX_ABORT_BACKOFF_S = 30.0


class EngineFailed(Exception):
    """This sample cannot be generated; ``reason`` is one of FAILURE_REASONS."""

    def __init__(self, reason: str, detail: str = "") -> None:
        super().__init__(f"{reason}: {detail}" if detail else reason)
        self.reason = reason


def sampling_seed(run_seed: int, task_id: str, sample_index: int) -> int:
    """The engine ``sampling_seed`` of one trajectory: a hash of (run seed, task id, sample index),
    31 bits (fits every engine's integer seed)."""
    digest = hashlib.sha256(f"{run_seed}/{task_id}/{sample_index}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & 0x7FFFFFFF


WAIT_SLICE_S = 0.5
"""A request's wait for its answer is cut into slices this long, to see a frozen process."""
FROZEN_AFTER_S = 0.25
"""A slice that overran by more than this: the process was frozen (or its loop blocked) meanwhile,
and the overrun does not count against the request's timeout."""


class PauseClock:
    """Whether the engine is paused for a weight load, how often it was, and for how long."""

    def __init__(self) -> None:
        self.ready = asyncio.Event()
        """Set while generation may be submitted."""
        self.ready.set()
        self.epoch = 0
        """Pauses begun so far: a request that sees it move was aborted by our own pause."""
        self._paused_total_s = 0.0
        self._paused_since: float | None = None

    def pause(self) -> None:
        self.epoch += 1
        self.ready.clear()
        self._paused_since = time.monotonic()

    def resume(self) -> None:
        if self._paused_since is not None:
            self._paused_total_s += time.monotonic() - self._paused_since
            self._paused_since = None
        self.ready.set()

    def paused_seconds(self) -> float:
        """Total seconds paused so far, the pause in progress included."""
        ongoing = 0.0 if self._paused_since is None else time.monotonic() - self._paused_since
        return self._paused_total_s + ongoing


@dataclass
class Turn:
    """One turn's sampled tokens with their behavior log-probs and policy versions."""

    ids: list[int]
    logps: list[float]
    versions: list[int]
    finish: str
    """stop (a stop token or EOS ended it) or length (budget or context exhausted)."""


class TurnSampler:
    """Samples one turn on an engine; the owner wires the engine, the pause clock and versions."""

    def __init__(self, engine: Engine, cfg: EngineConfig, *, stop_ids: set[int], pause: PauseClock,
                 context_len: int | None, loaded_version: Callable[[], int]) -> None:
        self.engine, self.cfg, self.pause = engine, cfg, pause
        self.stop_ids = set(stop_ids)
        """Ids that end a turn (every EOS id of the model; checked on the last token returned)."""
        self.context_len = context_len
        """The engine's context length when it was not probed (None: no cap known)."""
        self.loaded_version = loaded_version
        """The version the owner has loaded: the tokens' version when the engine reports none."""

    async def sample(self, context: list[int], params: Any, seed: int | None = None) -> Turn:
        """`params`: temperature, top_p, top_k, max_new_tokens (the task's SamplingParams); optional
        ``stop`` (strings) and ``stop_token_ids`` go to the engine too, which ends the turn on them
        (the token that completes a stop string stays in the output, as SGLang and vLLM keep it);
        optional ``constraint``: SGLang's structured-output key and value (``{"ebnf": ...}``,
        ``json_schema``, ``regex``), sent as is; a constrained turn an abort cut is generated again
        from its start (the engine's grammar cannot resume mid-output)."""
        turn = Turn([], [], [], "length")
        budget, aborts = int(params.max_new_tokens), 0
        while True:
            await self.pause.ready.wait()
            caps = self.capabilities()
            room = budget - len(turn.ids)
            limit = caps.room(len(context) + len(turn.ids))
            if limit is not None:
                room = min(room, limit)
            if room <= 0:
                return turn
            epoch, version = self.pause.epoch, self.loaded_version()
            res = await self._request(context + turn.ids, self._sampling(params, room, seed, caps))
            if not res.aborted and self.pause.epoch != epoch:
                version = self.loaded_version()  # parked by the pause, run after it (see the module doc)
            try:
                versions = token_versions(res, version)
            except EngineError as exc:
                raise EngineFailed("bad_response", str(exc)) from None
            turn.ids += res.output_ids
            turn.logps += res.logprobs or []
            turn.versions += versions
            TOKENS.inc(len(res.output_ids))
            finish = str(res.finish_reason.get("type", "abort"))
            ENGINE_REQUESTS.labels(finish_reason=finish if finish in ("stop", "length") else "abort").inc()
            if res.output_ids and res.output_ids[-1] in self.stop_ids | _request_stop_ids(params):
                turn.finish = "stop"  # before the abort check: SGLang aborts after appending EOS
                return turn
            if finish != "abort" or len(turn.ids) >= budget:
                turn.finish = "stop" if finish == "stop" else "length"
                return turn
            INTERRUPTIONS.inc()
            if getattr(params, "constraint", None):
                # A grammar starts at its root on every request: a resubmitted prefix would be
                # matched as a fresh start, so a constrained turn is generated again from scratch.
                turn = Turn([], [], [], "length")
            if self.pause.epoch == epoch and self.pause.ready.is_set():
                # Not our weight load: an abort of other origin, retried with a bound (an engine
                # without abort retries in its config, e.g. synthetic, never aborts: it fails at once).
                aborts += 1
                http = self.cfg if isinstance(self.cfg, HttpEngineConfig) else None
                if http is None or aborts > http.max_abort_retries:
                    raise EngineFailed("aborted", str(res.finish_reason.get("message", "")))
                await asyncio.sleep(min(http.abort_backoff_s * 2 ** (aborts - 1), MAX_ABORT_BACKOFF_S))

    def capabilities(self) -> EngineCapabilities:
        """The engine's probed capabilities (``engine.capabilities``), else the torch engine's
        surface with ``context_len``."""
        probed = getattr(self.engine, "capabilities", None)
        return probed if isinstance(probed, EngineCapabilities) else EngineCapabilities.assumed(self.context_len)

    def _sampling(self, params: Any, room: int, seed: int | None, caps: EngineCapabilities) -> dict[str, Any]:
        sampling: dict[str, Any] = {
            "temperature": params.temperature, "top_p": params.top_p or 1.0, "top_k": params.top_k or -1,
            "max_new_tokens": room, "stop_token_ids": sorted(self.stop_ids | _request_stop_ids(params))}
        stop = list(getattr(params, "stop", None) or ())
        if stop:
            sampling["stop"] = stop
        sampling.update(getattr(params, "constraint", None) or {})
        if seed is not None and caps.sampling_seed:
            sampling["sampling_seed"] = seed
        return sampling

    async def _request(self, input_ids: list[int], sampling: dict[str, Any]) -> GenerateResult:
        """One /generate; times out after cfg.request_timeout_s of generation time: time paused
        for a weight load does not count, nor time this process itself was frozen (SIGSTOP, a
        blocked event loop), seen as a wait that overran its slice (the engine kept going; its
        answer is read on resume instead of the request failing the moment the process thaws)."""
        task = asyncio.ensure_future(self.engine.generate(input_ids, sampling))
        start, paused_at_start = time.monotonic(), self.pause.paused_seconds()
        frozen = 0.0
        try:
            while True:
                now = time.monotonic()
                active = now - start - (self.pause.paused_seconds() - paused_at_start) - frozen
                if active >= self.cfg.request_timeout_s:
                    raise EngineFailed("timeout", f"no answer in {self.cfg.request_timeout_s}s of generation")
                wait_s = min(WAIT_SLICE_S, self.cfg.request_timeout_s - active)
                done, _ = await asyncio.wait({task}, timeout=wait_s)
                if done:
                    break
                overrun = time.monotonic() - now - wait_s
                if overrun > FROZEN_AFTER_S:
                    frozen += overrun
            res = task.result()
        except EngineError as exc:
            kind = "http_4xx" if exc.status is not None and exc.status < 500 else "http_5xx"
            raise EngineFailed(kind if exc.status is not None else "bad_response", str(exc)) from None
        finally:
            if not task.done():
                task.cancel()
        GENERATE_SECONDS.observe(time.monotonic() - start)
        if not isinstance(res, GenerateResult) or res.logprobs is None or len(res.logprobs) != len(res.output_ids):
            raise EngineFailed("bad_response", "no per-token log-probs")
        return res


def _request_stop_ids(params: Any) -> set[int]:
    """The request's own stop token ids (``params.stop_token_ids``), beside the model's."""
    return {int(t) for t in getattr(params, "stop_token_ids", None) or ()}


class NewestOnly:
    """A one-slot mailbox: ``offer`` replaces what is pending, ``take`` waits for it. Weight
    announcements go through it, so a rollout busy loading v skips v+1 when v+2 has arrived."""

    def __init__(self) -> None:
        self._item: Any = None
        self._pending = asyncio.Event()
        self.replaced = 0
        """Offers overwritten before anyone took them (versions skipped)."""

    def offer(self, item: Any) -> None:
        if self._pending.is_set():
            self.replaced += 1
        self._item = item
        self._pending.set()

    async def take(self) -> Any:
        await self._pending.wait()
        self._pending.clear()
        item, self._item = self._item, None
        return item
