"""Advantage estimators (docs/DESIGN.md §4, survey §2.2, §3.5, §7.7).

Pure CPU/GPU torch functions over small tensors. Shape suffixes: B sequences (trajectories),
T tokens, S agent steps. ``group_index_B`` holds any integer id per sequence; sequences with the
same id are G samples of the same prompt (a GRPO group). Group ids need not be contiguous.

Conventions, decided once and tested (tests/unit/learner/test_advantages.py):

* A group of one has no relative signal: every group-relative estimator returns advantage 0 for
  it (verl's loop GRPO returns the raw score there, its vectorised RLOO 0; we pick 0 everywhere).
* A group whose rewards are all equal returns exactly 0, not ``rounding_error / eps``: the
  group mean of e.g. three 0.1 rewards is not bit-exactly 0.1, and dividing that residue by
  ``0 + eps`` would hand a zero-variance group a spurious O(0.01..1) advantage.
* Token tensors carry a loss mask that is 1 exactly on tokens the policy sampled; outputs are 0
  wherever the mask is 0.
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = [
    "discounted_returns",
    "dr_grpo_advantages",
    "expand_steps_to_tokens",
    "expand_to_tokens",
    "gae_advantages",
    "gigpo_advantages",
    "grpo_advantages",
    "per_trajectory",
    "reinforce_pp_advantages",
    "rloo_advantages",
]


def _group_stats(reward_B: Tensor, group_index_B: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Per-sequence group mean, group size, group unbiased std, and an all-equal flag (all _B)."""
    if reward_B.dim() != 1 or group_index_B.shape != reward_B.shape:
        raise ValueError(f"reward_B {tuple(reward_B.shape)} and group_index_B "
                         f"{tuple(group_index_B.shape)} must both be 1-D of the same length")
    _, inverse_B = torch.unique(group_index_B, return_inverse=True)
    num_groups = int(inverse_B.max().item()) + 1 if inverse_B.numel() else 0
    zeros_G = reward_B.new_zeros(num_groups)
    count_G = zeros_G.index_add(0, inverse_B, torch.ones_like(reward_B))
    mean_G = zeros_G.index_add(0, inverse_B, reward_B) / count_G
    centered_B = reward_B - mean_G[inverse_B]
    sq_G = zeros_G.index_add(0, inverse_B, centered_B * centered_B)
    std_G = (sq_G / (count_G - 1).clamp_min(1)).sqrt()
    max_G = zeros_G.scatter_reduce(0, inverse_B, reward_B, "amax", include_self=False)
    min_G = zeros_G.scatter_reduce(0, inverse_B, reward_B, "amin", include_self=False)
    all_equal_B = (max_G == min_G)[inverse_B]  # also true for every group of one
    return mean_G[inverse_B], count_G[inverse_B], std_G[inverse_B], all_equal_B


def grpo_advantages(
    reward_B: Tensor, group_index_B: Tensor, *, scale_by_std: bool = True, eps: float = 1e-6
) -> Tensor:
    """GRPO: ``A_i = (R_i - mean_g) / (std_g + eps)`` with std_g the unbiased (n-1) sample std.

    ``scale_by_std=False`` gives the centred estimator. Groups of one and all-equal groups → 0.
    """
    mean_B, _, std_B, all_equal_B = _group_stats(reward_B, group_index_B)
    centered_B = reward_B - mean_B
    adv_B = centered_B / (std_B + eps) if scale_by_std else centered_B
    return torch.where(all_equal_B, torch.zeros_like(adv_B), adv_B)


def dr_grpo_advantages(reward_B: Tensor, group_index_B: Tensor) -> Tensor:
    """Dr.GRPO: ``A_i = R_i - mean_g`` (no std scaling; pair it with the ``constant`` denominator)."""
    return grpo_advantages(reward_B, group_index_B, scale_by_std=False)


def rloo_advantages(reward_B: Tensor, group_index_B: Tensor) -> Tensor:
    """RLOO: ``A_i = R_i - mean_{j != i} R_j = n/(n-1) · (R_i - mean_g)``. Group of one → 0."""
    mean_B, count_B, _, all_equal_B = _group_stats(reward_B, group_index_B)
    adv_B = (reward_B - mean_B) * count_B / (count_B - 1).clamp_min(1)
    return torch.where(all_equal_B, torch.zeros_like(adv_B), adv_B)


def per_trajectory(x_B: Tensor, trajectory_index_B: Tensor) -> Tensor:
    """One value per trajectory from per-row values (rows of one trajectory — its segments — carry
    the same reward and group): ``x_J[j]`` = x of trajectory j's first row. ``trajectory_index_B``
    holds 0..J−1 (row i belongs to trajectory ``trajectory_index_B[i]``)."""
    idx_B = trajectory_index_B.to(x_B.device)
    num = int(idx_B.max().item()) + 1 if idx_B.numel() else 0
    rows = torch.arange(idx_B.numel(), device=x_B.device)
    first_J = torch.full((num,), idx_B.numel(), dtype=torch.long, device=x_B.device).scatter_reduce(
        0, idx_B, rows, "amin")
    return x_B.index_select(0, first_J)


def expand_to_tokens(adv_B: Tensor, mask_BT: Tensor) -> Tensor:
    """Broadcast one advantage per sequence onto its loss-masked tokens (0 elsewhere) → adv_BT."""
    return torch.where(mask_BT > 0, adv_B[:, None], torch.zeros((), dtype=adv_B.dtype))


def reinforce_pp_advantages(
    reward_B: Tensor, group_index_B: Tensor, mask_BT: Tensor, eps: float = 1e-6,
    trajectory_index_B: Tensor | None = None,
) -> Tensor:
    """REINFORCE++ with group baseline → adv_BT (token-level, because the whitening is).

    1. ``a_i = R_i - mean_g`` (group baseline, as in ``dr_grpo_advantages``);
    2. broadcast ``a_i`` to the loss-masked tokens of sequence i;
    3. whiten over all masked tokens of the batch: ``(a - μ) / (σ + eps)`` with μ and σ the
       mask-weighted mean and population std (divide by N = Σm). Long sequences therefore weigh
       more in μ and σ, exactly as in the token-level loss. Unmasked tokens are 0.

    With a micro-batched or sharded batch, call it once on the whole batch, not per shard. With
    ``trajectory_index_B`` (rows that are segments of one trajectory, see :func:`per_trajectory`)
    the group baseline of step 1 is over trajectories and each row gets its trajectory's ``a``; the
    whitening of step 3 is over tokens, which the rows hold each once.
    """
    if trajectory_index_B is None:
        centered_B = dr_grpo_advantages(reward_B, group_index_B)
    else:
        idx_B = trajectory_index_B.to(reward_B.device)
        centered_B = dr_grpo_advantages(per_trajectory(reward_B, idx_B), per_trajectory(group_index_B, idx_B))[idx_B]
    m_BT = (mask_BT > 0).to(reward_B.dtype)
    a_BT = centered_B[:, None] * m_BT
    n = m_BT.sum().clamp_min(1)
    mu = a_BT.sum() / n
    var = (((a_BT - mu) * m_BT) ** 2).sum() / n
    return (a_BT - mu) / (var.sqrt() + eps) * m_BT


def gae_advantages(
    reward_BT: Tensor, value_BT: Tensor, mask_BT: Tensor, gamma: float, lam: float
) -> tuple[Tensor, Tensor]:
    """GAE over multi-turn sequences whose action tokens are interleaved with observations.

    Time steps are the loss-masked (action) tokens only. Tokens with mask 0 (prompt, tool output,
    observations, padding) are skipped: the recursion carries ``next_value`` and the running
    ``gae`` across the gap unchanged, so the first action token after an observation bootstraps
    the last action token before it. With t' the next action token after action token t:

        δ_t = r̃_t + γ·V_{t'} − V_t        (V_{t'} = 0 after the last action token)
        A_t = δ_t + γλ·A_{t'}              return_t = A_t + V_t

    ``r̃_t`` is ``reward_t`` plus the rewards sitting on the mask-0 tokens between t and t'
    (an environment reward on an observation token is credited to the action that caused it;
    a terminal reward on trailing padding goes to the last action token). Rewards on mask-0
    tokens before the first action token have no action to credit and are dropped. The values
    at mask-0 tokens are never read. Outputs are 0 at mask-0 tokens.
    """
    if not (reward_BT.shape == value_BT.shape == mask_BT.shape) or reward_BT.dim() != 2:
        raise ValueError("reward_BT, value_BT and mask_BT must share one (B, T) shape")
    act_BT = mask_BT > 0
    value_BT = value_BT.detach()
    reward_BT = reward_BT.detach()
    B, T = reward_BT.shape
    next_value_B = value_BT.new_zeros(B)
    gae_B = value_BT.new_zeros(B)
    pending_B = reward_BT.new_zeros(B)
    adv_BT = torch.zeros_like(value_BT)
    for t in range(T - 1, -1, -1):
        act_B = act_BT[:, t]
        r_B = reward_BT[:, t] + pending_B
        delta_B = r_B + gamma * next_value_B - value_BT[:, t]
        new_gae_B = delta_B + gamma * lam * gae_B
        gae_B = torch.where(act_B, new_gae_B, gae_B)
        next_value_B = torch.where(act_B, value_BT[:, t], next_value_B)
        pending_B = torch.where(act_B, torch.zeros_like(pending_B), r_B)
        adv_BT[:, t] = torch.where(act_B, new_gae_B, torch.zeros_like(new_gae_B))
    return_BT = torch.where(act_BT, adv_BT + value_BT, torch.zeros_like(adv_BT))
    return adv_BT, return_BT


def discounted_returns(step_reward: list[list[float]], gamma: float) -> list[list[float]]:
    """``G_{i,t} = Σ_{u≥t} γ^{u−t} r_{i,u}`` per episode (the step returns GiGPO compares)."""
    out: list[list[float]] = []
    for rewards in step_reward:
        acc = 0.0
        returns = [0.0] * len(rewards)
        for t in range(len(rewards) - 1, -1, -1):
            acc = rewards[t] + gamma * acc
            returns[t] = acc
        out.append(returns)
    return out


def gigpo_advantages(
    episode_reward_B: Tensor,
    group_index_B: Tensor,
    step_state_hash: list[list[str]],
    step_return: list[list[float]],
    *,
    omega: float = 1.0,
    scale_by_std: bool = True,
    eps: float = 1e-6,
) -> tuple[Tensor, Tensor]:
    """GiGPO (survey §7.7): episode-level plus anchor-state step-level relative advantages.

    For episode i in group g with steps t = 0..T_i−1, state hash s_{i,t} and discounted return
    G_{i,t} (``step_return``; see ``discounted_returns``):

        A^E_i     = relative(R_i ; {R_j : j in g})                       (GRPO over the group)
        A^S_{i,t} = relative(G_{i,t} ; {G_{j,u} : j in g, s_{j,u} = s_{i,t}})
        A_{i,t}   = A^E_i + ω · A^S_{i,t}

    ``relative`` is ``grpo_advantages`` (mean-centred, divided by std + eps unless
    ``scale_by_std=False``). Anchor groups are keyed by (group id, state hash), so equal hashes
    in different prompts' groups never mix. A state seen once (also twice in one episode counts
    as a group of two) is a singleton → A^S = 0, so with no repeated states GiGPO reduces to
    episode-level GRPO.

    Returns ``(adv_BS, step_mask_BS)``: per-step advantages padded to the longest episode, and a
    bool mask of real steps (padding holds 0).
    """
    B = episode_reward_B.shape[0]
    if not (len(step_state_hash) == len(step_return) == B):
        raise ValueError("step_state_hash and step_return need one list per episode")
    episode_adv_B = grpo_advantages(episode_reward_B, group_index_B, scale_by_std=scale_by_std, eps=eps)

    keys: dict[tuple[int, str], int] = {}
    anchor_ids: list[int] = []
    returns: list[float] = []
    for i, (hashes, rets) in enumerate(zip(step_state_hash, step_return, strict=True)):
        if len(hashes) != len(rets):
            raise ValueError(f"episode {i}: {len(hashes)} state hashes but {len(rets)} step returns")
        g = int(group_index_B[i].item())
        for h, ret in zip(hashes, rets, strict=True):
            anchor_ids.append(keys.setdefault((g, h), len(keys)))
            returns.append(ret)

    S = max((len(h) for h in step_state_hash), default=0)
    step_mask_BS = torch.zeros(B, S, dtype=torch.bool)
    for i, hashes in enumerate(step_state_hash):
        step_mask_BS[i, : len(hashes)] = True
    adv_BS = torch.zeros(B, S, dtype=episode_reward_B.dtype)
    if returns:
        step_adv_N = grpo_advantages(
            torch.tensor(returns, dtype=episode_reward_B.dtype),
            torch.tensor(anchor_ids),
            scale_by_std=scale_by_std,
            eps=eps,
        )
        adv_BS[step_mask_BS] = step_adv_N * omega
    adv_BS = torch.where(step_mask_BS, adv_BS + episode_adv_B[:, None], adv_BS)
    return adv_BS, step_mask_BS


def expand_steps_to_tokens(adv_BS: Tensor, step_index_BT: Tensor, mask_BT: Tensor) -> Tensor:
    """Give every action token the advantage of its agent step. ``step_index_BT`` is the step
    number of each token (any value, e.g. −1, where the mask is 0) → adv_BT, 0 off the mask."""
    act_BT = mask_BT > 0
    idx_BT = torch.where(act_BT, step_index_BT, torch.zeros_like(step_index_BT)).long()
    gathered_BT = torch.gather(adv_BS, 1, idx_BT)
    return torch.where(act_BT, gathered_BT, torch.zeros_like(gathered_BT))
