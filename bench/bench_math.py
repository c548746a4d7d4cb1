"""How much does the learner's math cost next to the model? (goal: ≤ 3% of one forward+backward)

Times, on the same 64 × 2,048-token batch and in the same process (best of N each):

* math  = GRPO advantages + token broadcast + decoupled PPO loss forward and backward (w.r.t.
  log-probs) + every step metric, entropy included from V = 256 logits;
* model = one forward+backward of a tiny causal transformer (2 layers, d = 128, V = 256,
  embedding + LM head) with a token-level cross-entropy loss.

Prints ``math_vs_fwd_bwd_ratio=<x>``. Run: ``.venv/bin/python bench/bench_math.py``.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import torch
from torch import Tensor, nn

from trajmesh.learner.advantages import expand_to_tokens, grpo_advantages
from trajmesh.learner.metrics import entropy_from_logits, step_metrics
from trajmesh.learner.objective import ObjectiveConfig, behavior_weight, decoupled_ppo_loss

GOAL = 0.03


class TinyCausalLM(nn.Module):
    def __init__(self, vocab: int = 256, d_model: int = 128, layers: int = 2, heads: int = 4) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, d_model)
        layer = nn.TransformerEncoderLayer(d_model, heads, dim_feedforward=4 * d_model, dropout=0.0,
                                           batch_first=True, norm_first=True)
        self.encoder = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.head = nn.Linear(d_model, vocab)

    def forward(self, ids_BT: Tensor) -> Tensor:
        T = ids_BT.shape[1]
        causal_TT = nn.Transformer.generate_square_subsequent_mask(T)
        return self.head(self.encoder(self.embed(ids_BT), mask=causal_TT, is_causal=True))


def _best_of(fn: Callable[[], object], repeats: int, budget_s: float) -> tuple[float, int]:
    """Best wall time of up to ``repeats`` runs; stops early once ``budget_s`` is spent (≥ 1 run)."""
    best, spent, runs = float("inf"), 0.0, 0
    while runs < repeats and (runs == 0 or spent < budget_s):
        t0 = time.perf_counter()
        fn()
        dt = time.perf_counter() - t0
        best, spent, runs = min(best, dt), spent + dt, runs + 1
    return best, runs


def _build_batch(B: int, T: int, V: int, G: int) -> dict[str, Tensor]:
    g = torch.Generator().manual_seed(0)
    lengths_B = torch.randint(T // 4, T + 1, (B,), generator=g)
    mask_BT = (torch.arange(T)[None, :] < lengths_B[:, None]).float()
    mask_BT[:, : T // 8] = 0.0  # prompt
    prox_BT = -torch.rand(B, T, generator=g) * 3
    return {
        "ids_BT": torch.randint(0, V, (B, T), generator=g),
        "mask_BT": mask_BT,
        "reward_B": torch.randint(0, 2, (B,), generator=g).float(),
        "group_B": torch.arange(B) // G,
        "prox_BT": prox_BT,
        "beh_BT": prox_BT + 0.1 * torch.randn(B, T, generator=g),
        "logp_BT": prox_BT + 0.05 * torch.randn(B, T, generator=g),
        "logits_BTV": torch.randn(B, T, V, generator=g),
        "versions_BT": torch.randint(6, 11, (B, T), generator=g),
    }


def math_step(b: dict[str, Tensor], cfg: ObjectiveConfig) -> dict[str, float]:
    logp_BT = b["logp_BT"].clone().requires_grad_(True)
    adv_B = grpo_advantages(b["reward_B"], b["group_B"])
    adv_BT = expand_to_tokens(adv_B, b["mask_BT"])
    loss, stats = decoupled_ppo_loss(logp_BT, b["prox_BT"], b["beh_BT"], adv_BT, b["mask_BT"], cfg)
    loss.backward()
    _, w_raw_BT, kept_BT = behavior_weight(b["prox_BT"], b["beh_BT"], b["mask_BT"], cfg)
    with torch.no_grad():
        entropy_BT = entropy_from_logits(b["logits_BTV"])
    return step_metrics(
        logp_BT=logp_BT.detach(), prox_logp_BT=b["prox_BT"], behavior_logp_BT=b["beh_BT"], adv_BT=adv_BT,
        mask_BT=b["mask_BT"], w_raw_BT=w_raw_BT, kept_mask_BT=kept_BT, loss_stats=stats, cfg=cfg,
        entropy_BT=entropy_BT, current_version=10, versions_BT=b["versions_BT"], max_lag=8,
    )


def model_step(model: TinyCausalLM, ids_BT: Tensor) -> None:
    model.zero_grad(set_to_none=True)
    logits_BTV = model(ids_BT[:, :-1])
    loss = nn.functional.cross_entropy(logits_BTV.reshape(-1, logits_BTV.shape[-1]), ids_BT[:, 1:].reshape(-1))
    loss.backward()


def main(argv: list[str] | None = None) -> float:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--vocab", type=int, default=256)
    ap.add_argument("--group", type=int, default=8)
    ap.add_argument("--math-repeats", type=int, default=5)
    ap.add_argument("--model-repeats", type=int, default=3)
    ap.add_argument("--budget-seconds", type=float, default=45.0,
                    help="stop repeating a measurement once this much time went into it")
    args = ap.parse_args(argv)

    torch.manual_seed(0)
    b = _build_batch(args.batch, args.tokens, args.vocab, args.group)
    cfg = ObjectiveConfig()
    model = TinyCausalLM(vocab=args.vocab)
    math_step(b, cfg)  # warm-up
    t_math, n_math = _best_of(lambda: math_step(b, cfg), args.math_repeats, args.budget_seconds)
    t_model, n_model = _best_of(lambda: model_step(model, b["ids_BT"]), args.model_repeats, args.budget_seconds)
    ratio = t_math / t_model
    print(f"batch={args.batch}x{args.tokens} vocab={args.vocab} threads={torch.get_num_threads()}")
    print(f"math_seconds={t_math:.4f} best_of={n_math} (advantages + loss fwd/bwd + metrics incl. entropy)")
    print(f"fwd_bwd_seconds={t_model:.4f} best_of={n_model} (2-layer d=128 causal transformer, V={args.vocab})")
    print(f"math_vs_fwd_bwd_ratio={ratio:.4f} goal<={GOAL} {'OK' if ratio <= GOAL else 'OVER'}")
    return ratio


if __name__ == "__main__":
    main()
