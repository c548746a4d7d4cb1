"""A synthetic engine for load tests and benchmarks: answers /generate-shaped calls instantly.

It samples uniform token ids (never EOS, so every response runs to `max_new_tokens`) with a fixed
log-prob, and tracks the weight version it was told about. It measures the mesh, not a model; the
rollout service selects it with `rollout.engine.type: synthetic`.
"""

from __future__ import annotations

import math
import random
from typing import Any

from trajmesh.rollout.engine_client import GenerateResult


class SyntheticEngine:
    base_url = "synthetic://"

    def __init__(self, vocab_size: int, eos_token_id: int, *, seed: int = 0, version: int = 0) -> None:
        self.ids = [i for i in range(vocab_size) if i != eos_token_id]
        self.logprob = -math.log(len(self.ids))
        self.rng = random.Random(seed)
        self.version = version

    async def generate(self, input_ids: list[int], sampling: dict[str, Any], return_logprob: bool = True
                       ) -> GenerateResult:
        n = int(sampling.get("max_new_tokens", 16))
        out = self.rng.choices(self.ids, k=n)
        return GenerateResult(output_ids=out, logprobs=[self.logprob] * n,
                              finish_reason={"type": "length", "length": n}, weight_version=str(self.version))

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
        return None
