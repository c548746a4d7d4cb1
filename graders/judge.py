"""The judge grader (GenRM / LLM-as-judge; survey § on Qwen3, Seed1.5, Nemotron): a trajectory is
scored by asking an engine, not by a program. No torch.

```
 pointwise:  Sample ── render_pointwise(rubric) ──▶ JudgeClient.ask ──▶ "… Score: 7" ── parse_score ──▶ 7/10
 pairwise:   n Samples ── circular_pairs(n): (0,1) (1,2) … (n-1,0) ──▶ n asks ── parse_winner ──▶
             pairwise_rewards: each member's share of its two comparisons won
```

The judge engine is any server of SGLang's native ``/generate`` (SGLang, the torch engine:
``judge.type`` sglang / torch) or vLLM's OpenAI ``/v1/completions`` (``vllm``), at ``judge.urls``
(round-robin). Text in, text out: the judge's tokenizer is its own, the rubric is sent as raw text
(no chat template).

Failures are never a reward. A request that times out (``judge.timeout_s``) or fails is retried
(``judge.attempts``); then, or when the verdict cannot be parsed, `JudgeError` carries the reason
(`ERROR_REASONS`) and the grader service ends the trajectory INFRA_FAILURE with a ``judge_error:``
verifier output, counted in ``trajmesh_grader_judge_errors_total{reason}``.

Pairwise positions: member i is answer A against member i+1 (mod n) as answer B, so each member is
shown once first and once second with n calls (not n(n-1)/2); a judge that always names one
position gives every member 0.5 (no advantage), so positional bias cannot become a signal.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import re
import time
from pathlib import Path
from typing import Any

import aiohttp
from prometheus_client import Counter, Histogram

from trajmesh.config import JudgeConfig
from trajmesh.graders.base import Grade, Sample

ERROR_REASONS = ("timeout", "unavailable", "unparseable", "no_pair")
"""Why the judge could not score a trajectory: a request past ``timeout_s``, a request that failed
(connection refused, an HTTP error, a malformed body), a verdict without a readable score or winner,
a pairwise group with fewer than two gradable members."""
JUDGE_ERROR = "judge_error"
"""Prefix of the verifier output of a trajectory the judge could not score (INFRA_FAILURE)."""
SCORE_COMPONENT = "judge_score"
"""The reward component of a judged trajectory (its reward: pointwise score / max_score, pairwise share won)."""

JUDGE_SECONDS = Histogram("trajmesh_grader_judge_request_seconds", "Wall time of one judge request (one verdict)",
                          buckets=(0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30))
JUDGE_REQUESTS = Counter("trajmesh_grader_judge_requests_total",
                         "Judge requests by result (ok: an answer came back, readable or not)", ["result"])
JUDGE_ERRORS = Counter("trajmesh_grader_judge_errors_total",
                       "Trajectories ended INFRA_FAILURE because the judge could not score them, by reason", ["reason"])
for _reason in ERROR_REASONS:  # exported at 0, so rates exist before the first failure
    JUDGE_ERRORS.labels(_reason)
for _result in ("ok", "timeout", "unavailable"):
    JUDGE_REQUESTS.labels(_result)

_SCORE_RE = re.compile(r"score\s*[:=]\s*(-?\d+(?:\.\d+)?)", re.IGNORECASE)
_WINNER_RE = re.compile(r"winner\s*[:=]\s*\**\s*([AB])\b", re.IGNORECASE)


class JudgeError(RuntimeError):
    """The judge could not score: ``reason`` one of `ERROR_REASONS`, ``raw`` its answer if any."""

    def __init__(self, reason: str, detail: str, raw: str = "") -> None:
        assert reason in ERROR_REASONS, reason
        super().__init__(f"{reason}: {detail}")
        self.reason, self.raw = reason, raw

    def verifier_output(self) -> str:
        return f"{JUDGE_ERROR}: {self}" + (f" raw={json.dumps(self.raw[:500])}" if self.raw else "")


def _fill(template: str, fields: dict[str, str]) -> str:
    """``{name}`` replaced by its value for the given names only (a rubric may hold other braces)."""
    for name, value in fields.items():
        template = template.replace("{" + name + "}", value)
    return template


def render_pointwise(cfg: JudgeConfig, prompt: str, response: str) -> str:
    return _fill(cfg.rubric, {"prompt": prompt, "response": response, "max_score": str(cfg.max_score)})


def render_pairwise(cfg: JudgeConfig, prompt: str, response_a: str, response_b: str) -> str:
    return _fill(cfg.pairwise_rubric, {"prompt": prompt, "response_a": response_a, "response_b": response_b})


def parse_score(raw: str, max_score: int, prefix: str = "") -> float:
    """The last ``Score: <number>`` of ``prefix + raw`` whose number the judge wrote (it starts in
    `raw`), in [0, max_score]; else `JudgeError` (unparseable): a verdict that cannot be read is not
    a 0. `prefix`: the rubric's own text after its last field (`rubric_tail`), so a rubric ending in
    ``Score:`` takes an answer of just the number."""
    text = prefix + raw
    found = [m.group(1) for m in _SCORE_RE.finditer(text) if m.start(1) >= len(prefix)]
    if not found:
        raise JudgeError("unparseable", "no 'Score: <number>' in the judge's answer", raw)
    score = float(found[-1])
    if not 0.0 <= score <= max_score:
        raise JudgeError("unparseable", f"score {score:g} outside [0, {max_score}]", raw)
    return score


def rubric_tail(template: str) -> str:
    """The rubric's literal text after its last ``{field}`` (the operator's words, never the policy's)."""
    return re.split(r"\{(?:prompt|response|response_a|response_b|max_score)\}", template)[-1]


def parse_winner(raw: str, prefix: str = "") -> str:
    """``"A"`` or ``"B"``: the last ``Winner: A|B`` of ``prefix + raw`` whose letter the judge wrote
    (as `parse_score`); else `JudgeError` (unparseable)."""
    text = prefix + raw
    found = [m.group(1) for m in _WINNER_RE.finditer(text) if m.start(1) >= len(prefix)]
    if not found:
        raise JudgeError("unparseable", "no 'Winner: A' or 'Winner: B' in the judge's answer", raw)
    return str(found[-1]).upper()


def circular_pairs(n: int) -> list[tuple[int, int]]:
    """The pairwise schedule of a group of n: (A, B) member indices, member i against i+1 mod n,
    n comparisons (n = 2: both orders of the one pair); none for n < 2."""
    return [(i, (i + 1) % n) for i in range(n)] if n >= 2 else []


def pairwise_rewards(n: int, pairs: list[tuple[int, int]], winners: list[str]) -> list[float]:
    """Each member's share of the comparisons it was in that it won."""
    won, seen = [0] * n, [0] * n
    for (a, b), winner in zip(pairs, winners, strict=True):
        seen[a] += 1
        seen[b] += 1
        won[a if winner == "A" else b] += 1
    return [w / s if s else 0.0 for w, s in zip(won, seen, strict=True)]


def judge_identity(cfg: JudgeConfig) -> str:
    """``name@revision``: the name (default: the model directory's last part, else ``judge``) and the
    revision (default: the first 16 hex digits of model.safetensors' sha256, as the manifest's
    model_revision)."""
    name = cfg.name or (Path(cfg.model_path).name if cfg.model_path else "judge")
    revision = cfg.revision
    if not revision:
        weights = Path(cfg.model_path or "") / "model.safetensors"
        revision = hashlib.sha256(weights.read_bytes()).hexdigest()[:16] if weights.is_file() else "unknown"
    return f"{name}@{revision}"


class JudgeClient:
    """Asks the judge engines (round-robin over ``judge.urls``) for one verdict's text."""

    def __init__(self, cfg: JudgeConfig) -> None:
        self.cfg = cfg
        self._session: aiohttp.ClientSession | None = None
        self._next = 0

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()

    async def ask(self, prompt: str) -> str:
        """The judge's answer; each try bounded by ``timeout_s``, ``attempts`` tries; then
        `JudgeError` (timeout or unavailable, the last try's)."""
        last = JudgeError("unavailable", "no attempt")
        for _ in range(self.cfg.attempts):
            url = self.cfg.urls[self._next % len(self.cfg.urls)]
            self._next += 1
            t0 = time.perf_counter()
            try:
                async with asyncio.timeout(self.cfg.timeout_s):
                    text = await self._post(url, prompt)
            except TimeoutError:
                last = JudgeError("timeout", f"{url} gave no verdict in {self.cfg.timeout_s:g} s")
            except (aiohttp.ClientError, OSError, ValueError, KeyError, IndexError, TypeError) as exc:
                last = JudgeError("unavailable", f"{url}: {type(exc).__name__}: {exc}"[:300])
            else:
                JUDGE_SECONDS.observe(time.perf_counter() - t0)
                JUDGE_REQUESTS.labels("ok").inc()
                return text
            JUDGE_SECONDS.observe(time.perf_counter() - t0)
            JUDGE_REQUESTS.labels(last.reason).inc()
        raise last

    async def _post(self, url: str, prompt: str) -> str:
        if self._session is None:
            self._session = aiohttp.ClientSession()
        if self.cfg.type == "vllm":
            path, body = "/v1/completions", {"prompt": prompt, "max_tokens": self.cfg.max_new_tokens,
                                              "temperature": self.cfg.temperature}
        else:
            path, body = "/generate", {"text": prompt, "sampling_params": {
                "max_new_tokens": self.cfg.max_new_tokens, "temperature": self.cfg.temperature}}
        async with self._session.post(url.rstrip("/") + path, json=body) as resp:
            if resp.status >= 400:
                raise aiohttp.ClientResponseError(resp.request_info, (), status=resp.status,
                                                  message=(await resp.text())[:200])
            data: Any = await resp.json()
        return str(data["choices"][0]["text"] if self.cfg.type == "vllm" else data["text"])


class JudgeGrader:
    """Scores samples by asking the judge: `grade` (pointwise) and `grade_group` (pairwise)."""

    def __init__(self, cfg: JudgeConfig, client: JudgeClient | None = None) -> None:
        self.cfg = cfg
        self.client = client or JudgeClient(cfg)
        self.identity = judge_identity(cfg)
        self.revision = f"judge-{cfg.mode}:{self.identity}"
        """The trajectory's ``grader_revision``: mode and the judge model's ``name@revision``."""

    async def close(self) -> None:
        await self.client.close()

    def judges(self, source: str) -> bool:
        return source in self.cfg.sources

    async def grade(self, sample: Sample, task: dict[str, Any]) -> Grade:
        """Pointwise: ``score / max_score``, the judge's raw answer in the verifier output (JSON)."""
        raw = await self.client.ask(render_pointwise(self.cfg, str(task.get("prompt", "")), _answer(sample)))
        score = parse_score(raw, self.cfg.max_score, rubric_tail(self.cfg.rubric))
        reward = score / self.cfg.max_score
        out = {"judge": self.identity, "mode": "pointwise", "score": score, "raw": raw}
        return Grade(reward, {SCORE_COMPONENT: reward}, json.dumps(out), self.revision)

    async def grade_group(self, samples: list[Sample], task: dict[str, Any]) -> list[Grade]:
        """Pairwise over the group's gradable members (`circular_pairs`), one Grade per sample in
        order. One comparison that fails fails the group (`JudgeError`): the rewards are relative,
        and a member missing a comparison would be scored on half the evidence of the rest."""
        pairs = circular_pairs(len(samples))
        if not pairs:
            raise JudgeError("no_pair", f"{len(samples)} gradable member(s): nothing to compare")
        prompt = str(task.get("prompt", ""))
        raws = await asyncio.gather(*(self.client.ask(render_pairwise(
            self.cfg, prompt, _answer(samples[a]), _answer(samples[b]))) for a, b in pairs))
        winners = [parse_winner(raw, rubric_tail(self.cfg.pairwise_rubric)) for raw in raws]
        rewards = pairwise_rewards(len(samples), pairs, winners)
        grades = []
        for i, reward in enumerate(rewards):
            mine = [{"a": a, "b": b, "winner": w, "raw": raw}
                    for (a, b), w, raw in zip(pairs, winners, raws, strict=True) if i in (a, b)]
            out = {"judge": self.identity, "mode": "pairwise", "member": i, "members": len(samples),
                   "comparisons": mine}
            grades.append(Grade(reward, {SCORE_COMPONENT: reward}, json.dumps(out), self.revision))
        return grades


def _answer(sample: Sample) -> str:
    """What the judge reads: an external agent's final answer, else the sampled text."""
    return sample.final_answer if sample.final_answer is not None else sample.text
