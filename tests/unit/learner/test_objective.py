"""Hand-computed fixtures for trajmesh.learner.objective (survey §10, level 0)."""

from __future__ import annotations

import math

import pytest
import torch

from trajmesh.learner.objective import ObjectiveConfig, behavior_weight, decoupled_ppo_loss, ppo_clip_loss

F64 = torch.float64
LN = math.log


def _build_batch() -> dict[str, torch.Tensor]:
    """2 x 3 batch, float64. prox = 0 everywhere, so logp = ln r and beh = -ln w_raw.

    token     A    r    w_raw   PPO term (eps 0.2/0.28, dual 3)        L (TIS cap 2)
    (0,0)    +1   1.5   1       min(1.5, 1.28)=1.28        -> -1.28    -1.28
    (0,1)    -1   0.5   1       min(-0.5, -0.8)=-0.8       ->  0.8      0.8
    (0,2)   pad (garbage log-probs, mask 0)
    (1,0)    -1   5.0   1       min(-5, -1.28)=-5 -> 5, dual -> 3       3.0
    (1,1)    +2   1.0   4       min(2, 2)=2 -> -2, w = min(4, 2) = 2   -4.0
    (1,2)    +1   1.0   1       -1                                     -1.0
    """
    logp = [[LN(1.5), LN(0.5), -7.0], [LN(5.0), 0.0, 0.0]]
    beh = [[0.0, 0.0, -3.0], [0.0, -LN(4.0), 0.0]]
    adv = [[1.0, -1.0, 5.0], [-1.0, 2.0, 1.0]]
    mask = [[1, 1, 0], [1, 1, 1]]
    return {
        "logp_BT": torch.tensor(logp, dtype=F64),
        "prox_logp_BT": torch.zeros(2, 3, dtype=F64),
        "behavior_logp_BT": torch.tensor(beh, dtype=F64),
        "adv_BT": torch.tensor(adv, dtype=F64),
        "mask_BT": torch.tensor(mask, dtype=F64),
    }


def _loss(batch: dict[str, torch.Tensor], cfg: ObjectiveConfig, **kw: float) -> torch.Tensor:
    loss, _ = decoupled_ppo_loss(
        batch["logp_BT"], batch["prox_logp_BT"], batch["behavior_logp_BT"], batch["adv_BT"], batch["mask_BT"],
        cfg, **kw,
    )
    return loss


def test_loss_hand_values_all_denominators_and_corrections() -> None:
    b = _build_batch()
    # TIS, token_global: (-1.28 + 0.8 + 3 - 4 - 1) / 5 = -2.48 / 5 = -0.496
    assert _loss(b, ObjectiveConfig()).item() == pytest.approx(-0.496, abs=1e-12)
    # sequence_mean: row0 (-1.28+0.8)/2 = -0.24 ; row1 (3-4-1)/3 = -2/3 ; mean = -0.4533333
    cfg_seq = ObjectiveConfig(denominator="sequence_mean")
    assert _loss(b, cfg_seq).item() == pytest.approx((-0.24 - 2 / 3) / 2, abs=1e-12)
    # constant C = 4 (Dr.GRPO): -2.48 / (4 * 2 sequences) = -0.31
    cfg_const = ObjectiveConfig(denominator="constant", constant_denominator=4.0)
    assert _loss(b, cfg_const).item() == pytest.approx(-0.31, abs=1e-12)
    # MIS [0.5, 2]: token (1,1) has w_raw 4 -> dropped (0) but still counted: (-1.28+0.8+3-1)/5 = 0.304
    assert _loss(b, ObjectiveConfig(behavior_correction="mis")).item() == pytest.approx(0.304, abs=1e-12)
    # none: w = 1 -> token (1,1) = -2: (-1.28+0.8+3-2-1)/5 = -0.096
    assert _loss(b, ObjectiveConfig(behavior_correction="none")).item() == pytest.approx(-0.096, abs=1e-12)
    # no dual clip: token (1,0) = 5: (-1.28+0.8+5-4-1)/5 = -0.096
    assert _loss(b, ObjectiveConfig(dual_clip=None)).item() == pytest.approx(-0.096, abs=1e-12)


def test_loss_stats_clip_fractions() -> None:
    b = _build_batch()
    _, stats = decoupled_ppo_loss(*b.values(), ObjectiveConfig())
    # 5 eligible tokens: low clip (0,1); high clip (0,0); dual (1,0); r outside [0.8,1.28]: 3 tokens.
    assert stats["clip_low_frac"].item() == pytest.approx(1 / 5)
    assert stats["clip_high_frac"].item() == pytest.approx(1 / 5)
    assert stats["dual_clip_frac"].item() == pytest.approx(1 / 5)
    assert stats["ratio_outside_frac"].item() == pytest.approx(3 / 5)
    # mean r = (1.5 + 0.5 + 5 + 1 + 1)/5 = 1.8 ; mean w = (1+1+1+2+1)/5 = 1.2
    assert stats["ratio_mean"].item() == pytest.approx(1.8)
    assert stats["weight_mean"].item() == pytest.approx(1.2)
    assert stats["num_tokens"].item() == 5 and stats["denominator"].item() == 5
    assert all(not v.requires_grad for v in stats.values())


def test_behavior_weight_is_exactly_one_when_behavior_equals_proximal() -> None:
    g = torch.Generator().manual_seed(0)
    prox_BT = -torch.rand(3, 7, generator=g, dtype=F64) * 5
    mask_BT = (torch.rand(3, 7, generator=g) > 0.3).to(F64)
    for corr in ("tis", "mis", "none"):
        w_BT, w_raw_BT, kept_BT = behavior_weight(prox_BT, prox_BT.clone(), mask_BT, ObjectiveConfig(behavior_correction=corr))
        assert torch.equal(w_BT, mask_BT) and torch.equal(w_raw_BT, mask_BT), corr
        assert torch.equal(kept_BT, mask_BT > 0), corr


def test_behavior_weight_tis_caps_and_mis_masks() -> None:
    # w_raw = exp(prox - beh) = [0.25, 1, 3]
    prox_BT = torch.zeros(1, 3, dtype=F64)
    beh_BT = torch.tensor([[LN(4.0), 0.0, -LN(3.0)]], dtype=F64)
    mask_BT = torch.ones(1, 3)
    w, w_raw, kept = behavior_weight(prox_BT, beh_BT, mask_BT, ObjectiveConfig(behavior_correction="tis"))
    torch.testing.assert_close(w_raw, torch.tensor([[0.25, 1.0, 3.0]], dtype=F64))
    torch.testing.assert_close(w, torch.tensor([[0.25, 1.0, 2.0]], dtype=F64))
    assert kept.tolist() == [[True, True, True]]
    w, _, kept = behavior_weight(prox_BT, beh_BT, mask_BT, ObjectiveConfig(behavior_correction="mis"))
    torch.testing.assert_close(w, torch.tensor([[0.0, 1.0, 0.0]], dtype=F64))
    assert kept.tolist() == [[False, True, False]]


@pytest.mark.parametrize("denominator", ["token_global", "sequence_mean", "constant"])
@pytest.mark.parametrize("correction", ["tis", "mis", "none"])
def test_equals_plain_ppo_clip_when_behavior_equals_proximal(denominator: str, correction: str) -> None:
    b = _build_batch()
    cfg = ObjectiveConfig(denominator=denominator, behavior_correction=correction)  # type: ignore[arg-type]
    logp_a = b["logp_BT"].clone().requires_grad_(True)
    logp_b = b["logp_BT"].clone().requires_grad_(True)
    prox = torch.tensor([[0.1, -0.2, 0.0], [0.3, -0.1, 0.05]], dtype=F64)
    dec, _ = decoupled_ppo_loss(logp_a, prox, prox.clone(), b["adv_BT"], b["mask_BT"], cfg)
    ppo, _ = ppo_clip_loss(logp_b, prox, b["adv_BT"], b["mask_BT"], cfg)
    assert dec.item() == ppo.item()
    dec.backward()
    ppo.backward()
    assert logp_a.grad is not None and logp_b.grad is not None
    assert torch.equal(logp_a.grad, logp_b.grad)


@pytest.mark.parametrize("denominator", ["token_global", "sequence_mean", "constant"])
@pytest.mark.parametrize("correction", ["tis", "mis", "none"])
def test_padding_and_observations_get_exactly_zero_gradient(denominator: str, correction: str) -> None:
    # Row 0: action, action, observation, observation, action, padding. Row 1: action, padding...
    # Off-mask log-probs are garbage (-inf, nan, huge) as they may be on padding.
    mask_BT = torch.tensor([[1, 1, 0, 0, 1, 0], [1, 0, 0, 0, 0, 0]], dtype=F64)
    garbage = torch.tensor([[0.0, 0.0, -math.inf, math.nan, 0.0, 1e9], [0.0, math.nan, -math.inf, 0, 0, 0]],
                           dtype=F64)
    logp_BT = torch.tensor([[-1.0, -0.5, 0.0, 0.0, -2.0, 0.0], [-0.3, 0, 0, 0, 0, 0]], dtype=F64) + garbage
    logp_BT.requires_grad_(True)
    prox_BT = torch.tensor([[-1.1, -0.4, 0.0, 0.0, -2.2, 0.0], [-0.2, 0, 0, 0, 0, 0]], dtype=F64) + garbage
    beh_BT = prox_BT - 0.1
    adv_BT = torch.tensor([[1.0, 1.0, 1.0, 1.0, 1.0, 1.0], [-1.0] * 6], dtype=F64)
    cfg = ObjectiveConfig(denominator=denominator, behavior_correction=correction)  # type: ignore[arg-type]
    loss, _ = decoupled_ppo_loss(logp_BT, prox_BT, beh_BT, adv_BT, mask_BT, cfg)
    loss.backward()
    assert torch.isfinite(loss)
    grad = logp_BT.grad
    assert grad is not None
    assert torch.equal(grad[mask_BT == 0], torch.zeros(int((mask_BT == 0).sum()), dtype=F64))
    assert bool((grad[mask_BT > 0] != 0).all())


def test_splitting_one_action_into_two_spans_keeps_token_global_loss() -> None:
    g = torch.Generator().manual_seed(1)
    logp_T = -torch.rand(6, generator=g, dtype=F64)
    prox_T = logp_T + 0.1 * torch.randn(6, generator=g, dtype=F64)
    beh_T = prox_T + 0.1 * torch.randn(6, generator=g, dtype=F64)
    adv_T = torch.tensor([1.0, 1.0, 1.0, 1.0, 1.0, 1.0], dtype=F64) * 0.7
    cfg = ObjectiveConfig()

    def loss_of(idx_BT: torch.Tensor, mask_BT: torch.Tensor, c: ObjectiveConfig = cfg) -> float:
        # Gather the same tokens into a new layout; idx -1 = an off-mask slot with garbage values.
        safe = idx_BT.clamp_min(0)
        out, _ = decoupled_ppo_loss(logp_T[safe], prox_T[safe], beh_T[safe], adv_T[safe], mask_BT, c)
        return out.item()

    one_row = loss_of(torch.arange(6)[None], torch.ones(1, 6))
    # (a) the same six tokens as two rows (two spans / two sequences), padded to width 6
    two_rows_idx = torch.tensor([[0, 1, 2, -1, -1, -1], [3, 4, 5, -1, -1, -1]])
    two_rows_mask = (two_rows_idx >= 0).to(F64)
    assert loss_of(two_rows_idx, two_rows_mask) == pytest.approx(one_row, abs=1e-14)
    # (b) one row with an observation span inserted in the middle (mask 0 between the spans)
    gap_idx = torch.tensor([[0, 1, -1, -1, 2, 3, 4, 5]])
    assert loss_of(gap_idx, (gap_idx >= 0).to(F64)) == pytest.approx(one_row, abs=1e-14)
    # The per-sequence mean is NOT split-invariant (3 tokens + 3 tokens vs 2 + 4): expected.
    seq = cfg.model_copy(update={"denominator": "sequence_mean"})
    uneven_idx = torch.tensor([[0, 1, -1, -1], [2, 3, 4, 5]])
    assert loss_of(uneven_idx, (uneven_idx >= 0).to(F64), seq) != pytest.approx(
        loss_of(torch.arange(6)[None], torch.ones(1, 6), seq), abs=1e-6)


def _build_dp_batch() -> dict[str, torch.Tensor]:
    # 4 sequences of very different lengths (1, 6, 2, 5 eligible tokens), rewards mixed.
    g = torch.Generator().manual_seed(2)
    lengths = [1, 6, 2, 5]
    mask_BT = torch.zeros(4, 6, dtype=F64)
    for i, n in enumerate(lengths):
        mask_BT[i, :n] = 1
    logp_BT = -torch.rand(4, 6, generator=g, dtype=F64) - 0.1
    prox_BT = logp_BT + 0.15 * torch.randn(4, 6, generator=g, dtype=F64)
    beh_BT = prox_BT + 0.15 * torch.randn(4, 6, generator=g, dtype=F64)
    adv_BT = torch.tensor([3.0, -1.0, 2.0, -0.5], dtype=F64)[:, None].expand(4, 6).clone()
    return {"logp_BT": logp_BT, "prox_logp_BT": prox_BT, "behavior_logp_BT": beh_BT, "adv_BT": adv_BT,
            "mask_BT": mask_BT}


def _shard(batch: dict[str, torch.Tensor], rows: slice) -> dict[str, torch.Tensor]:
    return {k: v[rows] for k, v in batch.items()}


@pytest.mark.parametrize("denominator", ["token_global", "sequence_mean", "constant"])
def test_wrong_local_denominator_fails_and_global_counts_match_full_batch(denominator: str) -> None:
    cfg = ObjectiveConfig(denominator=denominator, constant_denominator=6.0)  # type: ignore[arg-type]
    full = _build_dp_batch()
    full_logp = full["logp_BT"].clone().requires_grad_(True)
    full_loss, _ = decoupled_ppo_loss(full_logp, *list(full.values())[1:], cfg)
    full_loss.backward()

    # Uneven shards: rows [0] and [1, 2, 3] hold 1 and 13 eligible tokens (14 in all).
    shards = [_shard(full, slice(0, 1)), _shard(full, slice(1, 4))]
    n_tok = float(full["mask_BT"].sum())
    n_seq = 4.0
    # WRONG: each micro-batch / rank normalises by its own counts and the results are averaged
    # (what naive data-parallel gradient averaging does).
    local = [decoupled_ppo_loss(*s.values(), cfg)[0] for s in shards]
    wrong = sum(local) / len(local)
    assert not torch.allclose(wrong, full_loss.detach(), atol=1e-6), "a local denominator must be caught"

    # RIGHT: global counts, shard losses SUMMED (each rank's gradient is summed by all-reduce).
    grads = []
    total = torch.zeros((), dtype=F64)
    for s in shards:
        logp = s["logp_BT"].clone().requires_grad_(True)
        loss, _ = decoupled_ppo_loss(logp, *list(s.values())[1:], cfg, global_token_count=n_tok,
                                     global_sequence_count=n_seq)
        loss.backward()
        total = total + loss.detach()
        assert logp.grad is not None
        grads.append(logp.grad)
    assert total.item() == pytest.approx(full_loss.item(), abs=1e-13)
    assert full_logp.grad is not None
    torch.testing.assert_close(torch.cat(grads), full_logp.grad, atol=1e-14, rtol=0)


def _gradcheck_inputs() -> dict[str, torch.Tensor]:
    # Ratios and weights chosen away from every kink (0.8, 1.28, 3 for r; 0.5, 2 for w).
    r = torch.tensor([[0.5, 0.9, 1.1, 1.5, 5.0], [2.0, 0.7, 1.0, 1.2, 0.6]], dtype=F64)
    w = torch.tensor([[0.3, 1.0, 1.7, 3.0, 1.0], [0.9, 2.5, 1.0, 0.4, 1.1]], dtype=F64)
    prox = torch.tensor([[-0.5, -1.0, -2.0, -0.1, -3.0], [-0.2, -0.7, -1.5, -0.9, -0.4]], dtype=F64)
    adv = torch.tensor([[1.0, -1.0, 0.5, -2.0, -0.3], [1.5, 1.0, -0.7, 2.0, -1.0]], dtype=F64)
    mask = torch.tensor([[1, 1, 1, 1, 1], [1, 1, 0, 1, 1]], dtype=F64)
    return {"logp": prox + r.log(), "prox": prox, "beh": prox - w.log(), "adv": adv, "mask": mask}


@pytest.mark.parametrize("denominator", ["token_global", "sequence_mean", "constant"])
@pytest.mark.parametrize("correction", ["tis", "mis", "none"])
def test_gradcheck_decoupled_loss(denominator: str, correction: str) -> None:
    x = _gradcheck_inputs()
    cfg = ObjectiveConfig(denominator=denominator, behavior_correction=correction,  # type: ignore[arg-type]
                          constant_denominator=8.0)

    def f(logp_BT: torch.Tensor) -> torch.Tensor:
        return decoupled_ppo_loss(logp_BT, x["prox"], x["beh"], x["adv"], x["mask"], cfg)[0]

    assert torch.autograd.gradcheck(f, (x["logp"].clone().requires_grad_(True),), eps=1e-6, atol=1e-8)


@pytest.mark.parametrize("denominator", ["token_global", "sequence_mean", "constant"])
def test_gradcheck_ppo_clip_loss(denominator: str) -> None:
    x = _gradcheck_inputs()
    cfg = ObjectiveConfig(denominator=denominator)  # type: ignore[arg-type]

    def f(logp_BT: torch.Tensor) -> torch.Tensor:
        return ppo_clip_loss(logp_BT, x["prox"], x["adv"], x["mask"], cfg)[0]

    assert torch.autograd.gradcheck(f, (x["logp"].clone().requires_grad_(True),), eps=1e-6, atol=1e-8)


def _one_token(r: float, adv: float, cfg: ObjectiveConfig | None = None) -> tuple[float, float]:
    """Loss and d loss / d logp for a single token with w = 1 (behavior = proximal = 0)."""
    logp = torch.tensor([[math.log(r)]], dtype=F64, requires_grad=True)
    zero = torch.zeros(1, 1, dtype=F64)
    loss, _ = decoupled_ppo_loss(logp, zero, zero, torch.tensor([[adv]], dtype=F64), torch.ones(1, 1),
                                 cfg or ObjectiveConfig())
    loss.backward()
    assert logp.grad is not None
    return loss.item(), logp.grad.item()


def test_asymmetric_clipping_positive_advantage() -> None:
    # A = +1: loss = -r, d/dlogp = -r while r <= 1 + eps_high = 1.28; clipped (grad 0) above.
    assert _one_token(1.27, 1.0) == pytest.approx((-1.27, -1.27))
    loss, grad = _one_token(1.29, 1.0)
    assert loss == pytest.approx(-1.28) and grad == 0.0
    # Below 1 - eps_low nothing clips for A > 0 (min picks r*A): gradient -0.5.
    assert _one_token(0.5, 1.0) == pytest.approx((-0.5, -0.5))


def test_asymmetric_clipping_negative_advantage_and_dual_clip() -> None:
    # A = -1: loss = r, d/dlogp = r while r >= 1 - eps_low = 0.8; clipped (grad 0) below.
    assert _one_token(0.81, -1.0) == pytest.approx((0.81, 0.81))
    loss, grad = _one_token(0.79, -1.0)
    assert loss == pytest.approx(0.8) and grad == 0.0
    # Above 1 + eps_high nothing clips for A < 0 ... until the dual clip c = 3:
    assert _one_token(1.5, -1.0) == pytest.approx((1.5, 1.5))
    assert _one_token(2.9, -1.0) == pytest.approx((2.9, 2.9))
    loss, grad = _one_token(3.1, -1.0)
    assert loss == pytest.approx(3.0) and grad == 0.0  # bounded by c·|A| = 3
    loss, grad = _one_token(10.0, -2.0)
    assert loss == pytest.approx(6.0) and grad == 0.0  # c·|A| = 3·2
    # Without dual clip the loss grows with r.
    assert _one_token(10.0, -2.0, ObjectiveConfig(dual_clip=None)) == pytest.approx((20.0, 20.0))


def test_config_validation() -> None:
    with pytest.raises(ValueError):
        ObjectiveConfig(dual_clip=0.5)
    with pytest.raises(ValueError):
        ObjectiveConfig(mis_low=1.5)
    with pytest.raises(Exception):  # noqa: B017 - the frozen config model refuses assignment
        ObjectiveConfig().eps_low = 0.1  # type: ignore[misc]
