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

from typing import TYPE_CHECKING

import torch
from torch import Tensor

if TYPE_CHECKING:
    from trajmesh.contract import Trajectory
    from trajmesh.learner.step import Batch

__all__ = [
    "advantage_metrics",
    "advantages_B",
    "advantages_BT",
    "discounted_returns",
    "distill_advantages_BT",
    "dr_grpo_advantages",
    "expand_steps_to_tokens",
    "expand_to_tokens",
    "gae_advantages",
    "gigpo_advantages",
    "gigpo_advantages_BT",
    "grpo_advantages",
    "per_trajectory",
    "prime_advantages_BT",
    "prime_process_advantages",
    "implicit_process_rewards",
    "reinforce_pp_advantages",
    "rloo_advantages",
    "teacher_logprobs_BT",
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


def implicit_process_rewards(prm_logp_BT: Tensor, ref_logp_BT: Tensor, mask_BT: Tensor, beta: float) -> Tensor:
    """PRIME's implicit token reward (survey §7.4): ``r_t = β · (log πφ(y_t) − log π_ref(y_t))`` on
    the loss-masked tokens, 0 elsewhere (no grad: a reward, not a loss)."""
    on_BT = mask_BT > 0
    diff_BT = (prm_logp_BT.detach() - ref_logp_BT.detach()).float()
    return torch.where(on_BT, beta * diff_BT, torch.zeros((), dtype=diff_BT.dtype))


def prime_process_advantages(
    reward_BT: Tensor, mask_BT: Tensor, group_index_B: Tensor, *, gamma: float = 1.0,
    trajectory_index_B: Tensor | None = None,
) -> Tensor:
    """PRIME's implicit process component (survey §7.4) → adv_BT. With ``r̄_j`` trajectory j's mean
    token reward over its loss-masked tokens and K its group's size:

        b_i       = (1/(K−1)) Σ_{j≠i in the group} r̄_j            (leave-one-out baseline)
        A^p_{i,t} = Σ_{u≥t} γ^{u−t} (r_{i,u} − b_i)                  (over action tokens u only)

    Time steps are the loss-masked tokens, as in :func:`gae_advantages`: the return skips the
    observation and padding tokens between them. A group of one has no baseline → 0. With
    ``trajectory_index_B`` (rows that are segments of one trajectory, see :func:`per_trajectory`) a
    trajectory's mean runs over all its rows and its return runs on from one row into the next
    (rows in order). A trajectory without loss-masked tokens has r̄ = 0."""
    on_BT = mask_BT > 0
    reward_BT = torch.where(on_BT, reward_BT.detach().float(), torch.zeros(()))
    B = reward_BT.shape[0]
    row_traj_B = (torch.arange(B) if trajectory_index_B is None else trajectory_index_B.cpu().long())
    _, row_traj_B = torch.unique(row_traj_B, return_inverse=True)
    J = int(row_traj_B.max()) + 1 if B else 0
    sum_J = torch.zeros(J).index_add(0, row_traj_B, reward_BT.sum(-1))
    tokens_J = torch.zeros(J).index_add(0, row_traj_B, on_BT.sum(-1).float())
    mean_J = sum_J / tokens_J.clamp_min(1.0)
    group_J = per_trajectory(group_index_B.cpu(), row_traj_B)
    _, group_J = torch.unique(group_J, return_inverse=True)
    G = int(group_J.max()) + 1 if J else 0
    group_sum_J = torch.zeros(G).index_add(0, group_J, mean_J)[group_J]
    group_size_J = torch.zeros(G).index_add(0, group_J, torch.ones(J))[group_J]
    baseline_J = (group_sum_J - mean_J) / (group_size_J - 1).clamp_min(1.0)
    delta_BT = torch.where(on_BT, reward_BT - baseline_J[row_traj_B][:, None], torch.zeros(()))
    ret_BT = torch.zeros_like(delta_BT)
    running_B = torch.zeros(B)
    for t in range(delta_BT.shape[1] - 1, -1, -1):
        running_B = torch.where(on_BT[:, t], delta_BT[:, t] + gamma * running_B, running_B)
        ret_BT[:, t] = torch.where(on_BT[:, t], running_B, torch.zeros(()))
    # A trajectory's later rows carry on its return: a row's token t gains γ^(action tokens from t
    # to the row's end) × the return at the next row's first action token.
    after_BT = on_BT.flip(-1).cumsum(-1).flip(-1).float()
    carry_J = torch.zeros(J)
    for r in range(B - 1, -1, -1):
        j = int(row_traj_B[r])
        ret_BT[r] = torch.where(on_BT[r], ret_BT[r] + torch.pow(gamma, after_BT[r]) * carry_J[j], torch.zeros(()))
        if bool(on_BT[r].any()):
            carry_J[j] = ret_BT[r, int(on_BT[r].nonzero()[0])]
    single_B = (group_size_J < 2)[row_traj_B]
    return torch.where(single_B[:, None], torch.zeros_like(ret_BT), ret_BT)


def expand_steps_to_tokens(adv_BS: Tensor, step_index_BT: Tensor, mask_BT: Tensor) -> Tensor:
    """Give every action token the advantage of its agent step. ``step_index_BT`` is the step
    number of each token (any value, e.g. −1, where the mask is 0) → adv_BT, 0 off the mask."""
    act_BT = mask_BT > 0
    idx_BT = torch.where(act_BT, step_index_BT, torch.zeros_like(step_index_BT)).long()
    gathered_BT = torch.gather(adv_BS, 1, idx_BT)
    return torch.where(act_BT, gathered_BT, torch.zeros_like(gathered_BT))


# ------------------------------------------------------------------ a batch's advantages
# What a learner step trains with, from a `trajmesh.learner.step.Batch` (and the trajectories it
# was built from, where the estimator needs their turns, state hashes or teacher scores).

def advantages_B(batch: Batch, kind: str, *, scale_by_std: bool, eps: float) -> Tensor:
    """Per-row advantages: computed once per trajectory (the group baseline is over trajectories,
    not rows: a trajectory split into segment rows counts once) and copied to each of its rows."""
    row_traj_B = batch.trajectory_rows()
    reward_J, group_J = per_trajectory(batch.reward_B, row_traj_B), per_trajectory(batch.group_index_B,
                                                                                          row_traj_B)
    if kind == "grpo":
        adv_J = grpo_advantages(reward_J, group_J, scale_by_std=scale_by_std, eps=eps)
    elif kind == "dr_grpo":
        adv_J = dr_grpo_advantages(reward_J, group_J)
    elif kind == "rloo":
        adv_J = rloo_advantages(reward_J, group_J)
    else:
        raise ValueError(f"advantage {kind!r} has no per-sequence form (use advantages_BT)")
    return adv_J[row_traj_B.to(adv_J.device)]


def gigpo_advantages_BT(batch: Batch, trajs: list[Trajectory], *, omega: float, gamma: float,
                        scale_by_std: bool, eps: float) -> Tensor:
    """GiGPO per token (:func:`gigpo_advantages`) for a batch built from
    `trajs` by :func:`trajmesh.learner.step.build_batch`. A trajectory's steps are its turns (its spans' ``turn_index``);
    step k's anchor state is ``state_hashes[k]``, the environment's state before turn k (a step with
    no hash gets a key of its own: a singleton, A^S = 0). Step k's reward is the environment's
    ``step_rewards[k]`` (0 where there is none), plus the batch's reward of the trajectory (the
    graded one, after any truncation shaping) on its last step; the step returns are discounted by
    `gamma`. The episode-level part is GRPO on the batch's rewards. Every action token gets its
    turn's advantage, each segment row its trajectory's."""
    turns = [t.num_turns for t in trajs]
    hashes = [[(t.pb.state_hashes[k] if k < len(t.pb.state_hashes) and t.pb.state_hashes[k]
                else f"\x00{t.trajectory_id}:{k}") for k in range(n)] for t, n in zip(trajs, turns, strict=True)]
    row_traj_B = batch.trajectory_rows()
    reward_J = per_trajectory(batch.reward_B, row_traj_B)
    group_J = per_trajectory(batch.group_index_B, row_traj_B)
    rewards = []
    for j, (t, n) in enumerate(zip(trajs, turns, strict=True)):
        env_r = [float(t.pb.step_rewards[k]) if k < len(t.pb.step_rewards) else 0.0 for k in range(n)]
        if n:
            env_r[-1] += float(reward_J[j])
        rewards.append(env_r)
    adv_JS, _ = gigpo_advantages(reward_J, group_J, hashes, discounted_returns(rewards, gamma),
                                     omega=omega, scale_by_std=scale_by_std, eps=eps)
    if adv_JS.shape[1] == 0:
        return torch.zeros_like(batch.mask_BT)
    step_BT = torch.zeros(batch.mask_BT.shape, dtype=torch.long)
    rows = [(i, a) for i, t in enumerate(trajs) for a, _ in (t.segment_bounds() or [(0, len(t))])]
    width = batch.mask_BT.shape[1]
    for r, (i, a) in enumerate(rows):
        for span in trajs[i].pb.spans:
            lo, hi = max(span.token_start - a, 0), min(span.token_end - a, width)
            if lo < hi:
                step_BT[r, lo:hi] = span.turn_index
    adv_BS = adv_JS[row_traj_B]
    return expand_steps_to_tokens(adv_BS, step_BT.clamp(max=adv_BS.shape[1] - 1), batch.mask_BT)


def prime_advantages_BT(batch: Batch, process_reward_BT: Tensor, *, gamma: float = 1.0) -> Tensor:
    """PRIME (survey §7.4): the implicit process component (:func:`prime_process_advantages` of the
    PRM's token rewards) plus the outcome component, RLOO on the batch's rewards, each with its own
    leave-one-out baseline over the trajectory's group → adv_BT (0 off the loss mask)."""
    process_BT = prime_process_advantages(process_reward_BT, batch.mask_BT, batch.group_index_B, gamma=gamma,
                                          trajectory_index_B=batch.trajectory_index_B)
    outcome_BT = expand_to_tokens(advantages_B(batch, "rloo", scale_by_std=False, eps=1e-6), batch.mask_BT)
    return outcome_BT + process_BT.to(outcome_BT.device)


def advantages_BT(batch: Batch, kind: str, *, scale_by_std: bool, eps: float,
                  trajs: list[Trajectory] | None = None, omega: float = 1.0, gamma: float = 0.95,
                  process_reward_BT: Tensor | None = None, prime_gamma: float = 1.0) -> Tensor:
    """Per-token advantages of the whole batch (before any split: REINFORCE++ whitens over it).
    ``gigpo`` needs the `trajs` the batch was built from (their turns and state hashes); ``prime``
    the implicit PRM's token rewards of the batch (`process_reward_BT`, learner/prm.py)."""
    if kind == "prime":
        if process_reward_BT is None:
            raise ValueError("advantage prime needs the implicit PRM's token rewards")
        return prime_advantages_BT(batch, process_reward_BT, gamma=prime_gamma)
    if kind == "gigpo":
        if trajs is None:
            raise ValueError("advantage gigpo needs the batch's trajectories")
        return gigpo_advantages_BT(batch, trajs, omega=omega, gamma=gamma, scale_by_std=scale_by_std, eps=eps)
    if kind == "reinforce_pp":
        return reinforce_pp_advantages(batch.reward_B, batch.group_index_B, batch.mask_BT, eps=eps,
                                           trajectory_index_B=batch.trajectory_rows())
    return expand_to_tokens(advantages_B(batch, kind, scale_by_std=scale_by_std, eps=eps), batch.mask_BT)


def advantage_metrics(batch: Batch, adv_BT: Tensor, kind: str, trajs: list[Trajectory], *, scale_by_std: bool,
                      eps: float) -> dict[str, float]:
    """What the step's advantages are, for a run to show it trained with `kind` (metrics.jsonl):
    ``advantage_minus_grpo_max_abs``, the largest |A − A_GRPO| over action tokens (GRPO on the same
    batch; 0 when `kind` is grpo), and for gigpo ``advantage_step_anchor_groups``, the step-level
    anchor groups (a state hash reached by two or more steps of one group) that give steps their own
    relative advantage."""
    mask = batch.mask_BT > 0
    out: dict[str, float] = {}
    if kind != "grpo":
        grpo_BT = advantages_BT(batch, "grpo", scale_by_std=scale_by_std, eps=eps)
        out["advantage_minus_grpo_max_abs"] = float((adv_BT - grpo_BT)[mask].abs().max()) if mask.any() else 0.0
    if kind == "prime":  # what the process component added to RLOO's outcome advantage
        rloo_BT = advantages_BT(batch, "rloo", scale_by_std=scale_by_std, eps=eps)
        out["advantage_minus_rloo_max_abs"] = float((adv_BT - rloo_BT)[mask].abs().max()) if mask.any() else 0.0
    if kind == "gigpo":
        members: dict[tuple[str, str], int] = {}
        for t in trajs:
            for k in range(t.num_turns):
                h = t.pb.state_hashes[k] if k < len(t.pb.state_hashes) else ""
                if h:
                    members[(t.group_id, h)] = members.get((t.group_id, h), 0) + 1
        out["advantage_step_anchor_groups"] = float(sum(1 for n in members.values() if n >= 2))
    return out


def teacher_logprobs_BT(batch: Batch, trajs: list[Trajectory]) -> tuple[Tensor, Tensor]:
    """(teacher_BT, taught_B) for a batch built from `trajs` by :func:`trajmesh.learner.step.build_batch`: each row's
    teacher log-probs (``Trajectory.teacher_logprobs``, 0 on padding) and whether its trajectory
    was scored by a teacher at all."""
    teacher_BT = torch.zeros(batch.mask_BT.shape, dtype=torch.float32)
    rows = [(i, a, e) for i, t in enumerate(trajs) for a, e in (t.segment_bounds() or [(0, len(t))])]
    taught_B = torch.zeros(len(rows), dtype=torch.bool)
    for r, (i, a, e) in enumerate(rows):
        lp_T = trajs[i].teacher_logprobs_T
        if lp_T is not None:
            teacher_BT[r, :e - a] = torch.tensor(lp_T[a:e])  # a read-only view of the block: copied
            taught_B[r] = True
    return teacher_BT, taught_B


def distill_advantages_BT(adv_BT: Tensor, batch: Batch, trajs: list[Trajectory], *, coef: float,
                          reward_weight: float) -> tuple[Tensor, dict[str, float]]:
    """On-policy distillation (rollout/engines/teacher.py): on the action tokens of a trajectory a teacher
    scored, ``reward_weight · A_t + coef · (log π_T(y_t) − log π_behavior(y_t))``: the second part
    is the negated per-token reverse KL's single-sample estimate (k1), a reward per token that the
    decoupled objective then corrects for staleness like any advantage. Other rows keep `adv_BT`.
    Metrics (scored action tokens only): the reverse KL KL(π_behavior ‖ π_T) estimated as the mean
    of ``log π_behavior − log π_T`` (nats) and the tokens it is over."""
    teacher_BT, taught_B = teacher_logprobs_BT(batch, trajs)
    if not bool(taught_B.any()):
        return adv_BT, {}
    taught_BT = (batch.mask_BT > 0) & taught_B[:, None]
    gap_BT = (teacher_BT - batch.behavior_logp_BT) * taught_BT
    out_BT = torch.where(taught_BT, reward_weight * adv_BT + coef * gap_BT, adv_BT)
    n = int(taught_BT.sum())
    metrics = {"trajmesh_learner_distill_reverse_kl_nats": float(-gap_BT.sum() / max(n, 1)),
               "trajmesh_learner_distill_tokens": float(n)}
    return out_BT, metrics
