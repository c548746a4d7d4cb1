"""A synthetic engine for load tests and benchmarks: answers /generate-shaped calls without a model.

It samples uniform token ids with a fixed log-prob and tracks the weight version it was told
about; the rollout service selects it with `rollout.engine.type: synthetic`. By default it answers
instantly and every response runs to `max_new_tokens` (it measures the mesh, not a model).

With a timing model (`rollout.engine.synthetic`, `SyntheticTiming` below) it
stands in for a GPU engine in the systems benchmark (bench/bench_systems.py):

- response lengths are log-normal around `length_median` (long-tailed), capped at the turn's
  budget; a response shorter than the budget ends with EOS (finish "stop");
- running sequences decode together, one token each per step, as under continuous batching: a
  step of B sequences takes ``decode_step_s + step_s_per_sequence·B`` seconds (:meth:`step_seconds`),
  a new request joins at the next step boundary, at most `max_batch` run at once (the rest queue);
- it sleeps the modelled time, so it takes no CPU from the other services, and counts the modelled
  busy time (steps × their step time) in ``trajmesh_rollout_synthetic_busy_seconds_total``.
"""

from __future__ import annotations

import asyncio
import math
import random
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Literal

from prometheus_client import Counter
from pydantic import Field

from trajmesh.config import EngineConfig, StrictModel
from trajmesh.rollout.engines.engine_client import GenerateResult


class SyntheticTiming(StrictModel):
    """Benchmark model of a GPU inference engine for the synthetic engine (bench/bench_systems.py):
    it sleeps the modelled time instead of computing, so it takes no CPU from the other services.
    Running sequences decode together, one token each per step (continuous batching: a request
    joins at the next step boundary); a step of B sequences takes
    decode_step_s + step_s_per_sequence·B seconds. All zero: instant answers (load tests)."""

    decode_step_s: float = Field(0.0, ge=0)
    """Seconds of one decode step, whatever the batch (a memory-bound GPU step); 0: no decode time."""
    step_s_per_sequence: float = Field(0.0, ge=0)
    """Extra seconds per running sequence in each decode step (the batch's share of compute)."""
    max_batch: int = Field(256, ge=1)
    """Sequences decoded at once; further requests queue until one finishes."""
    length_median: int = Field(0, ge=0)
    """Median response length in tokens, log-normal (long-tailed), capped at the turn's
    max_new_tokens; a shorter response ends with EOS. 0: every response runs to max_new_tokens."""
    length_sigma: float = Field(1.0, ge=0)
    """Log-normal shape of the response length (p99 ≈ median·e^(2.33σ) before the cap)."""


class SyntheticEngineConfig(EngineConfig):
    """Uniform random tokens, no model (rollout/engines/synthetic_engine.py), for load tests and benchmarks.
    It runs in the rollout process, answers at once and never aborts, so it has no url, batch window,
    startup wait or abort retries."""

    type: Literal["synthetic"] = "synthetic"
    """Selects the synthetic engine."""
    synthetic: SyntheticTiming = Field(default_factory=lambda: SyntheticTiming())
    """Timing and length model (all zero: instant answers running to max_new_tokens)."""


BUSY_SECONDS = Counter("trajmesh_rollout_synthetic_busy_seconds_total",
                       "Modelled seconds the synthetic engine spent decoding (steps x step time)")
DECODE_STEPS = Counter("trajmesh_rollout_synthetic_decode_steps_total", "Decode steps the synthetic engine modelled")
DECODED_TOKENS = Counter("trajmesh_rollout_synthetic_decoded_tokens_total",
                         "Tokens the synthetic engine decoded (steps x running sequences: / steps = mean batch)")


@dataclass
class _Seq:
    remaining: int
    done: asyncio.Future[None] = field(repr=False)


class SyntheticEngine:
    base_url = "synthetic://"

    def __init__(self, vocab_size: int, eos_token_id: int, *, seed: int = 0, version: int = 0,
                 timing: SyntheticTiming | None = None) -> None:
        self.ids = [i for i in range(vocab_size) if i != eos_token_id]
        self.eos_token_id = eos_token_id
        self.logprob = -math.log(len(self.ids))
        self.rng = random.Random(seed)
        self.version = version
        self.timing = timing or SyntheticTiming()
        self.busy_seconds = 0.0
        """Modelled decode time so far: the sum over steps of step_seconds(batch of that step)."""
        self.decode_steps = 0
        self._waiting: deque[_Seq] = deque()
        self._running: list[_Seq] = []
        self._wake = asyncio.Event()
        self._scheduler: asyncio.Task[None] | None = None

    # ------------------------------------------------------------------ the timing model
    @property
    def timed(self) -> bool:
        return self.timing.decode_step_s > 0 or self.timing.step_s_per_sequence > 0

    def step_seconds(self, batch: int) -> float:
        """Modelled duration of one decode step with ``batch`` running sequences."""
        return self.timing.decode_step_s + self.timing.step_s_per_sequence * batch

    def response_length(self, budget: int) -> tuple[int, bool]:
        """(tokens, ends with EOS) of the next response under a budget of ``budget`` tokens."""
        t = self.timing
        if t.length_median <= 0:
            return budget, False
        n = max(1, round(t.length_median * math.exp(t.length_sigma * self.rng.gauss(0.0, 1.0))))
        return (n, True) if n < budget else (budget, False)

    # ------------------------------------------------------------------ the engine API
    async def generate(self, input_ids: list[int], sampling: dict[str, Any], return_logprob: bool = True
                       ) -> GenerateResult:
        budget = int(sampling.get("max_new_tokens", 16))
        n, stop = self.response_length(budget)
        out = self.rng.choices(self.ids, k=n - 1 if stop else n) + ([self.eos_token_id] if stop else [])
        version = self.version  # the weights the response starts under (no abort on a weight load)
        if self.timed and n > 0:
            await self._decode(n)
        finish = {"type": "stop"} if stop else {"type": "length", "length": n}
        return GenerateResult(output_ids=out, logprobs=[self.logprob] * n, finish_reason=finish,
                              weight_version=str(version))

    async def _decode(self, tokens: int) -> None:
        """Returns when a sequence of ``tokens`` tokens has been decoded in the shared batch."""
        seq = _Seq(tokens, asyncio.get_running_loop().create_future())
        if self._scheduler is None or self._scheduler.done():
            self._wake = asyncio.Event()  # of this event loop
            self._scheduler = asyncio.ensure_future(self._schedule())
            self._scheduler.add_done_callback(self._fail_pending)
        self._waiting.append(seq)
        self._wake.set()
        await seq.done

    def _fail_pending(self, task: asyncio.Task[None]) -> None:
        """The scheduler ended by an error or cancellation: no request waits forever."""
        exc = None if task.cancelled() else task.exception()
        if not task.cancelled() and exc is None:
            return  # it ran out of work (a newer scheduler may already own new requests)
        for s in [*self._running, *self._waiting]:
            if not s.done.done():
                s.done.set_exception(exc or RuntimeError("synthetic engine closed"))
        self._running, self._waiting = [], deque()

    def _admit(self) -> None:
        while self._waiting and len(self._running) < self.timing.max_batch:
            self._running.append(self._waiting.popleft())

    async def _schedule(self) -> None:
        """Decodes the running batch until no sequence is left; new requests join at step boundaries."""
        loop = asyncio.get_running_loop()
        while True:
            self._admit()
            if not self._running:
                return
            batch = len(self._running)
            dt = self.step_seconds(batch)
            steps = min(s.remaining for s in self._running)  # until the first one finishes
            self._wake.clear()
            start = loop.time()
            try:
                async with asyncio.timeout(steps * dt):
                    await self._wake.wait()
                # A request arrived: finish the step in progress, then admit it.
                elapsed = loop.time() - start
                steps = min(steps, int(elapsed / dt) + 1)
                await asyncio.sleep(max(0.0, start + steps * dt - loop.time()))
            except asyncio.TimeoutError:
                pass
            self.decode_steps += steps
            self.busy_seconds += steps * dt
            DECODE_STEPS.inc(steps)
            DECODED_TOKENS.inc(steps * batch)
            BUSY_SECONDS.inc(steps * dt)
            still = []
            for s in self._running:
                s.remaining -= steps
                if s.remaining <= 0:
                    if not s.done.done():
                        s.done.set_result(None)
                else:
                    still.append(s)
            self._running = still

    async def update_weights_from_disk(self, path: str, version: int | str | None = None, **_: Any) -> str:
        if version is not None:
            self.version = int(version)
        return "synthetic engine: version updated, no weights loaded"

    async def pause(self) -> None:
        return None

    async def context_length(self) -> int | None:
        return None  # no model: no context limit

    async def resume(self) -> None:
        return None

    async def health(self, *, generate: bool = False) -> bool:
        return True

    async def close(self) -> None:
        if self._scheduler is not None:
            self._scheduler.cancel()
        return None
