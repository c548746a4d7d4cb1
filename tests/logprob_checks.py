"""The learner's own log-probs of sampled tokens, for tests that hold an engine's against them
(imported by tests; not a test module)."""

from __future__ import annotations

from typing import Any

import torch

from trajmesh.learner.step import Batch, token_logprobs


def learner_logprobs(model: Any, prompt: list[int], output: list[int], temperature: float = 1.0) -> list[float]:
    """log π(output | prompt) per output token at `temperature`, by the learner's own forward
    (learner/step.py `token_logprobs`)."""
    ids = torch.tensor([prompt + output])
    n = ids.shape[1]
    zeros = torch.zeros((1, n))
    batch = Batch(ids, torch.ones_like(ids), zeros, zeros, zeros.long(), torch.zeros(1),
                  torch.zeros(1, dtype=torch.long), ["probe"], zeros.long())
    with torch.no_grad():
        logp_BT, _ = token_logprobs(model, batch, temperature)
    return [float(x) for x in logp_BT[0, len(prompt):]]
