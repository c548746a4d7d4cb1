"""On-policy distillation's teacher, seen from a rollout process (survey §4.7/§4.9, multi-teacher MOPD).

```
 run_episode ×G ──▶ Teacher.score_all(trajs) ──▶ one sequence a segment ──▶ batch (max_batch,
   (the student's own samples)                   (token_ids split at        batch_window_ms)
                                                  sequence_starts)                │
 TRAJ_RAW ◀── traj.teacher_logprobs, traj.teacher ◀── log π_T(token | before) ◀── engine.score()
```

Each task source may have one teacher (`distill.teachers`): an engine serving another model that
shares the student's tokenizer — the built-in torch engine (a child of this process), SGLang or
vLLM at a URL. The teacher scores every token the student sampled by its log-prob given the tokens
before it (prompt log-probs, temperature 1: ``EngineClient.score`` / ``VLLMEngine.score``), and the
learner turns ``log π_T − log π_behavior`` (the per-token reverse KL's negation) into advantage
(learner/step.py). The scores travel on the trajectory (contract fields ``teacher_logprobs`` and
``teacher``, archived), so the learner needs no teacher of its own: on a cluster the teacher is one
more inference deployment, sized apart from the rollouts.

A failed scoring request is retried with backoff for ``distill.retry_s``; after that, or for a
sequence longer than the teacher's context, the trajectory ends as INFRA_FAILURE (excluded from
training, counted by reason in ``trajmesh_rollout_teacher_failures_total``), never trained unscored.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import numpy as np
from prometheus_client import Counter, Histogram

from trajmesh.config import DistillConfig, TeacherConfig
from trajmesh.contract import Trajectory
from trajmesh.rollout.engines.engine_client import EngineError
from trajmesh.v1 import trajectory_pb2

log = logging.getLogger("trajmesh.rollout.engines.teacher")

TEACHER_SECONDS = Histogram("trajmesh_rollout_teacher_request_seconds",
                            "Wall time of one teacher scoring request (a batch of sequences)", ["teacher"],
                            buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30))
TEACHER_BATCH = Histogram("trajmesh_rollout_teacher_batch_sequences", "Sequences in one teacher scoring request",
                          ["teacher"], buckets=(1, 2, 4, 8, 16, 32, 64, 128))
TEACHER_TOKENS = Counter("trajmesh_rollout_teacher_scored_tokens_total", "Tokens a teacher scored", ["teacher"])
TEACHER_FAILURES = Counter("trajmesh_rollout_teacher_failures_total",
                           "Trajectories ended INFRA_FAILURE because their teacher could not score them, by reason",
                           ["teacher", "reason"])


FAILURE_REASONS = ("too_long", "unavailable")
"""Why a teacher could not score a trajectory: a sequence past its context, or requests failing
for longer than ``distill.retry_s``."""


def teacher_identity(t: TeacherConfig) -> str:
    """``name@revision``: the name (default: the model directory's last part, else the source) and
    the revision (default: the first 16 hex digits of model.safetensors' sha256, as the manifest's
    model_revision)."""
    name = t.name or (Path(t.model_path).name if t.model_path else t.source)
    revision = t.revision
    if not revision:
        assert t.model_path is not None  # TeacherConfig refuses neither
        weights = Path(t.model_path) / "model.safetensors"
        revision = hashlib.sha256(weights.read_bytes()).hexdigest()[:16] if weights.exists() else "unknown"
    return f"{name}@{revision}"


class TeacherUnavailable(RuntimeError):
    """A scoring request failed for longer than ``distill.retry_s``."""


@dataclass
class _Pending:
    seq: list[int]
    future: asyncio.Future[list[float]] = field(repr=False)


class Teacher:
    """One teacher engine: batches the sequences handed to it and scores them.

    ``engine`` has ``score(sequences) -> [[logprob of token k given tokens < k, k ≥ 1], ...]`` and
    ``context_length()`` (``EngineClient``, ``VLLMEngine``)."""

    def __init__(self, cfg: TeacherConfig, engine: Any, distill: DistillConfig, *, identity: str | None = None) -> None:
        self.cfg, self.engine = cfg, engine
        self.identity = identity or teacher_identity(cfg)
        self.max_batch, self.window_s, self.retry_s = distill.max_batch, distill.batch_window_ms / 1000, distill.retry_s
        self.context_len: int | None = None
        self._queue: asyncio.Queue[_Pending] = asyncio.Queue()
        self._loop_task: asyncio.Task[None] | None = None
        self._sends: set[asyncio.Task[None]] = set()
        for reason in FAILURE_REASONS:  # exported at 0, so rates exist before the first failure
            TEACHER_FAILURES.labels(self.identity, reason)
        TEACHER_TOKENS.labels(self.identity)

    async def start(self) -> None:
        """Reads the teacher's context length and starts the batching loop."""
        self.context_len = await self.engine.context_length()
        self._loop_task = asyncio.create_task(self._batch_loop(), name=f"teacher-{self.cfg.source}")

    async def close(self) -> None:
        for task in [t for t in (self._loop_task, *self._sends) if t is not None]:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
        await self.engine.close()

    def fits(self, n: int) -> bool:
        """Whether the teacher takes a sequence of `n` tokens (plus the one token a score asks)."""
        return self.context_len is None or n + 1 < self.context_len

    async def score_trajectory(self, traj: Trajectory) -> None:
        """Sets ``teacher_logprobs`` (each segment scored on its own: sequence_starts) and
        ``teacher``; ends the trajectory INFRA_FAILURE when the teacher cannot score it."""
        ids_T = traj.token_ids_T
        bounds = [(a, e) for a, e in traj.segment_bounds() if e - a >= 2]  # one token: nothing to score
        if not all(self.fits(end - start) for start, end in bounds):
            self._fail(traj, "too_long")
            return
        try:
            scored = await asyncio.gather(*(self._score(ids_T[s:e].tolist()) for s, e in bounds))
        except TeacherUnavailable:
            self._fail(traj, "unavailable")
            return
        lp_T = np.zeros(ids_T.size, dtype=np.float32)
        for (start, end), lps in zip(bounds, scored, strict=True):
            lp_T[start + 1:end] = lps  # a segment's first token is a prompt token: nothing scores it
        traj.set_teacher_logprobs(lp_T, self.identity)
        TEACHER_TOKENS.labels(self.identity).inc(int((traj.loss_mask_T == 1).sum()))

    def _fail(self, traj: Trajectory, reason: str) -> None:
        TEACHER_FAILURES.labels(self.identity, reason).inc()
        log.warning("teacher %s could not score %s (%s): INFRA_FAILURE", self.identity, traj.trajectory_id, reason)
        traj.fail_infra(trajectory_pb2.INFRA_TEACHER)

    async def _score(self, seq: list[int]) -> list[float]:
        pending = _Pending(seq, asyncio.get_running_loop().create_future())
        await self._queue.put(pending)
        return await pending.future

    async def _batch_loop(self) -> None:
        while True:
            batch = [await self._queue.get()]
            deadline = time.monotonic() + self.window_s
            while len(batch) < self.max_batch:
                left = deadline - time.monotonic()
                try:
                    batch.append(self._queue.get_nowait() if left <= 0 else
                                 await asyncio.wait_for(self._queue.get(), left))
                except (asyncio.QueueEmpty, TimeoutError):
                    break
            task = asyncio.create_task(self._send([p for p in batch if not p.future.done()]))
            self._sends.add(task)
            task.add_done_callback(self._sends.discard)

    async def _send(self, batch: list[_Pending]) -> None:
        """One scoring request, retried with backoff for ``retry_s``; its result or TeacherUnavailable
        reaches every sequence of the batch."""
        if not batch:
            return
        deadline, delay = time.monotonic() + self.retry_s, 0.2
        while True:
            t0 = time.perf_counter()
            try:
                scores = await self.engine.score([p.seq for p in batch])
                break
            except (EngineError, aiohttp.ClientError, TimeoutError, OSError) as exc:
                if time.monotonic() + delay > deadline:
                    for p in batch:
                        if not p.future.done():
                            p.future.set_exception(TeacherUnavailable(f"{self.identity}: {exc!r}"))
                    return
                log.warning("teacher %s scoring failed (%r); retrying in %.1fs", self.identity, exc, delay)
                await asyncio.sleep(delay)
                delay = min(delay * 2, 5.0)
        TEACHER_SECONDS.labels(self.identity).observe(time.perf_counter() - t0)
        TEACHER_BATCH.labels(self.identity).observe(len(batch))
        for p, lps in zip(batch, scores, strict=True):
            if not p.future.done():
                p.future.set_result(lps)


def scorable(traj: Trajectory) -> bool:
    """A trajectory worth a teacher's call: sampled tokens, not already excluded (infrastructure
    failure) or cut short as stale (the store filters it)."""
    return traj.pb.terminal_reason not in (trajectory_pb2.INFRA_FAILURE, trajectory_pb2.STALE) \
        and bool((traj.loss_mask_T == 1).any())
