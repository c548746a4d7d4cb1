"""Reward shaping, truncation policy and the MAGIC entropy controller (docs/DESIGN.md §4, survey §3.7, §7.5).

The truncation policy is explicit config because the peers disagree (survey §7.5): DAPO drops
overlong responses from the loss and adds a soft length penalty; Skywork's MAGIC keeps truncated
responses with zero correctness so that they receive a negative group-relative advantage.
"""

from __future__ import annotations

from typing import Literal

import torch
from torch import Tensor

__all__ = ["MagicEntropyController", "TruncationPolicy", "apply_truncation_policy", "dapo_overlong_penalty"]

TruncationPolicy = Literal["keep", "mask", "zero_reward", "dapo_soft"]
"""The values of `learner.truncation.policy` (trajmesh/config.py TruncationConfig)."""


def dapo_overlong_penalty(length_B: Tensor, max_length: int, cache_length: int) -> Tensor:
    """DAPO's soft overlong reward r_len(|y|) (survey §3.7), float, shape _B.

        0                                   if |y| ≤ L_max − L_cache
        ((L_max − L_cache) − |y|) / L_cache if L_max − L_cache < |y| ≤ L_max
        −1                                  if |y| > L_max

    It is added to the task reward. DAPO's run: L_max = 20,480, L_cache = 4,096.
    """
    if not 0 < cache_length <= max_length:
        raise ValueError(f"need 0 < cache_length <= max_length, got {cache_length}, {max_length}")
    length_B = length_B.to(torch.float64)
    soft_start = max_length - cache_length
    ramp_B = (soft_start - length_B) / cache_length
    penalty_B = torch.where(length_B <= soft_start, torch.zeros_like(length_B), ramp_B)
    return torch.where(length_B > max_length, torch.full_like(length_B, -1.0), penalty_B)


def apply_truncation_policy(
    reward_B: Tensor,
    truncated_B: Tensor,
    mask_BT: Tensor,
    policy: TruncationPolicy,
    *,
    length_B: Tensor | None = None,
    max_length: int | None = None,
    cache_length: int | None = None,
) -> tuple[Tensor, Tensor]:
    """Apply a truncation policy → ``(reward_B, mask_BT)`` (new tensors; inputs untouched).

    * ``"keep"``: unchanged (a truncated response is trained with the reward its grader gave it).
    * ``"mask"``: truncated responses leave the loss (their mask rows become 0); rewards unchanged.
      Call it before computing advantages if the group baseline should ignore them too.
    * ``"zero_reward"``: truncated responses keep their tokens in the loss and get reward 0
      (MAGIC: a missing final answer is wrong, so it earns a negative relative advantage).
    * ``"dapo_soft"``: every response gets ``reward + dapo_overlong_penalty(length)``; the
      ``truncated_B`` flags are not consulted (the length decides). ``length_B`` defaults to the
      number of loss-masked tokens per row (the response length for single-turn data); pass it
      explicitly for multi-turn data. Needs ``max_length`` and ``cache_length``.
    """
    truncated_B = truncated_B.bool()
    if policy == "keep":
        return reward_B.clone(), mask_BT.clone()
    if policy == "mask":
        keep_BT = (~truncated_B)[:, None] & (mask_BT > 0)
        return reward_B.clone(), keep_BT.to(mask_BT.dtype)
    if policy == "zero_reward":
        return torch.where(truncated_B, torch.zeros_like(reward_B), reward_B), mask_BT.clone()
    if policy == "dapo_soft":
        if max_length is None or cache_length is None:
            raise ValueError("dapo_soft needs max_length and cache_length")
        if length_B is None:
            length_B = (mask_BT > 0).sum(-1)
        penalty_B = dapo_overlong_penalty(length_B, max_length, cache_length).to(reward_B.dtype)
        return reward_B + penalty_B, mask_BT.clone()
    raise ValueError(f"unknown truncation policy {policy!r}")


class MagicEntropyController:
    """Skywork-OR1's adaptive entropy coefficient (MAGIC, survey §7.5), a checkpointed state.

    With state c_k (``coef``), step Δ (``delta``) and target H* (``target_entropy``), each call
    ``update(H_k)`` returns the active coefficient and advances the state, exactly as the report:

        α_k     = c_k · 1{H_k ≤ H*}
        c_{k+1} = c_k + Δ if H_k < H*;  c_k − Δ if H_k > H*;  c_k if H_k = H*

    Report values: c_0 = 0, Δ = 0.005, H* = 0.2, no clip. The released scripts instead use
    Δ = 0.0001 and cap c at 0.005 (a 50× slower controller); pick one and say which. We clamp
    c to ``[min_coef, max_coef]`` after each update; ``min_coef=0`` by default because a negative
    c would, once entropy fell below target, push entropy further down. Set ``min_coef=None``
    (and ``max_coef=None``) to reproduce the unclipped equation.

    The entropy loss term is ``−α_k · H`` (added to the policy loss). The state must be saved and
    restored with the optimizer (``state_dict`` / ``load_state_dict``).
    """

    def __init__(
        self,
        target_entropy: float = 0.2,
        delta: float = 0.005,
        init_coef: float = 0.0,
        min_coef: float | None = 0.0,
        max_coef: float | None = None,
    ) -> None:
        if delta <= 0:
            raise ValueError("delta must be > 0")
        if min_coef is not None and max_coef is not None and min_coef > max_coef:
            raise ValueError("min_coef > max_coef")
        self.target_entropy = float(target_entropy)
        self.delta = float(delta)
        self.min_coef = min_coef
        self.max_coef = max_coef
        self.coef = float(init_coef)
        self.steps = 0
        self.last_alpha = 0.0

    def update(self, entropy: float) -> float:
        """Feed the rollout entropy H_k; return α_k and advance c_k → c_{k+1}."""
        entropy = float(entropy)
        alpha = self.coef if entropy <= self.target_entropy else 0.0
        if entropy < self.target_entropy:
            self.coef += self.delta
        elif entropy > self.target_entropy:
            self.coef -= self.delta
        if self.min_coef is not None:
            self.coef = max(self.coef, self.min_coef)
        if self.max_coef is not None:
            self.coef = min(self.coef, self.max_coef)
        self.steps += 1
        self.last_alpha = alpha
        return alpha

    def state_dict(self) -> dict[str, float | int | None]:
        return {
            "target_entropy": self.target_entropy,
            "delta": self.delta,
            "min_coef": self.min_coef,
            "max_coef": self.max_coef,
            "coef": self.coef,
            "steps": self.steps,
            "last_alpha": self.last_alpha,
        }

    def load_state_dict(self, state: dict[str, float | int | None]) -> None:
        """Restore the state. Raises if the saved configuration differs from this controller's
        (resuming a run under a different controller silently changes the experiment)."""
        for key in ("target_entropy", "delta", "min_coef", "max_coef"):
            if state[key] != getattr(self, key):
                raise ValueError(f"MagicEntropyController {key}: saved {state[key]!r} != configured "
                                 f"{getattr(self, key)!r}")
        coef, steps, last_alpha = state["coef"], state["steps"], state["last_alpha"]
        if coef is None or steps is None or last_alpha is None:
            raise ValueError("MagicEntropyController state lacks coef, steps or last_alpha")
        self.coef = float(coef)
        self.steps = int(steps)
        self.last_alpha = float(last_alpha)
