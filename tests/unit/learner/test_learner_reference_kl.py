"""The frozen reference policy and the KL-to-reference term (`learner.reference`, learner/reference.py).

Hand-computed values of the three estimators and their gradients; the term's reduction under the
objective's denominators; the learner service's reference resets (at the configured versions,
logged, with the optimizer's state cleared), a bitwise resume with the reference on across a reset,
and the term holding KL(π_θ ‖ π_ref) under a bound that the same run without it exceeds.
"""

from __future__ import annotations

import logging
import math
from pathlib import Path
from typing import Any

import pytest
import torch
from learner_batches import two_groups_of_four
from tiny_llama import tiny_llama_dir

from trajmesh.config import ObjectiveConfig, load_config
from trajmesh.learner.objective import kl_penalty, reference_kl_loss

# ------------------------------------------------------------------ the estimators, by hand

LOGP = [-1.0, -0.5]
REF = [-2.0, -0.25]  # y = ref − logp = [−1, 0.25]


@pytest.mark.parametrize("estimator,values,grads", [
    ("k1", [1.0, -0.25], [1.0, 1.0]),
    ("k2", [0.5, 0.25**2 / 2], [1.0, -0.25]),  # d/dlogp (y²/2) = −y
    ("k3", [math.exp(-1.0), math.exp(0.25) - 1.25], [1.0 - math.exp(-1.0), 1.0 - math.exp(0.25)]),
])
def test_each_estimator_and_its_gradient_by_hand(estimator: str, values: list[float], grads: list[float]) -> None:
    logp = torch.tensor(LOGP, dtype=torch.float64, requires_grad=True)
    k = kl_penalty(logp, torch.tensor(REF, dtype=torch.float64), estimator)
    assert k.tolist() == pytest.approx(values, rel=1e-12)
    k.sum().backward()
    assert logp.grad is not None
    assert logp.grad.tolist() == pytest.approx(grads, rel=1e-12)


def test_the_term_reduces_with_the_objective_denominators_and_ignores_padding() -> None:
    """Row 0: two eligible tokens (y = −1, 0.25); row 1: one (y = 0.5) and a padding position whose
    log-prob is −inf. k3 by hand: e^−1, e^0.25 − 1.25, e^0.5 − 1.5."""
    k00, k01, k10 = math.exp(-1.0), math.exp(0.25) - 1.25, math.exp(0.5) - 1.5
    logp = torch.tensor([[-1.0, -0.5], [-1.0, -math.inf]], dtype=torch.float64, requires_grad=True)
    ref = torch.tensor([[-2.0, -0.25], [-0.5, -3.0]], dtype=torch.float64)
    mask = torch.tensor([[1.0, 1.0], [1.0, 0.0]])
    token, stats = reference_kl_loss(logp, ref, mask, ObjectiveConfig(), estimator="k3", coef=0.5)
    assert float(token.detach()) == pytest.approx(0.5 * (k00 + k01 + k10) / 3, rel=1e-12)
    assert float(stats["reference_kl"]) == pytest.approx((k00 + k01 + k10) / 3, rel=1e-12)
    token.backward()
    assert logp.grad is not None and torch.isfinite(logp.grad).all()
    assert float(logp.grad[1, 1]) == 0.0
    assert float(logp.grad[0, 0]) == pytest.approx(0.5 * (1 - math.exp(-1.0)) / 3, rel=1e-12)
    seq, _ = reference_kl_loss(logp, ref, mask, ObjectiveConfig(denominator="sequence_mean"), estimator="k3",
                               coef=0.5)
    assert float(seq.detach()) == pytest.approx(0.5 * ((k00 + k01) / 2 + k10) / 2, rel=1e-12)
    named, _ = reference_kl_loss(logp, ref, mask, ObjectiveConfig(), estimator="k3", coef=0.5,
                                 aggregation="sequence_mean")
    assert float(named.detach()) == pytest.approx(float(seq.detach()), rel=1e-12)
    # Split over two calls (micro-batches) with the whole batch's counts, the parts add up.
    parts = [reference_kl_loss(logp[i:i + 1], ref[i:i + 1], mask[i:i + 1], ObjectiveConfig(), estimator="k3",
                               coef=0.5, global_token_count=3.0)[0] for i in range(2)]
    assert float(sum(parts).detach()) == pytest.approx(float(token.detach()), rel=1e-12)


# ------------------------------------------------------------------ the learner service


def _service(tmp_path: Path, model: str, run: str, **over: Any) -> Any:
    from trajmesh.services.learner import LearnerService

    cfg = load_config(None, {"run_dir": str(tmp_path / run), "model.path": model, "learner.engine.type": "torch",
                             "learner.consistency_probe_trajectories": 0, "learner.warmup_steps": 0,
                             "learner.reference.enabled": True, **over})
    svc = LearnerService(cfg)
    svc._build_trainer()
    return svc


def _steps(svc: Any, first: int, last: int) -> list[dict[str, Any]]:
    return [svc._train_step(two_groups_of_four(s), eta=100, temperature=1.0).metrics for s in range(first, last)]


def test_the_reference_and_the_optimizer_reset_at_the_configured_versions(tmp_path: Path,
                                                                         caplog: pytest.LogCaptureFixture) -> None:
    from prometheus_client import REGISTRY

    svc = _service(tmp_path, tiny_llama_dir(tmp_path), "run", **{"learner.reference.reset_every": 2,
                                                             "learner.reference.kl_coef": 0.1})
    resets_before = REGISTRY.get_sample_value("trajmesh_learner_reference_reset_steps_total") or 0.0
    with caplog.at_level(logging.INFO, logger="trajmesh.learner"):
        metrics = _steps(svc, 0, 3)  # versions 0, 1, 2: the reset before training from version 2
        steps = {float(st["step"]) for st in svc.engine.optimizer.state.values()}
        assert steps == {1.0}  # one AdamW step since the reset (three without it)
        metrics += _steps(svc, 3, 5)  # versions 3, 4
    assert [m["reference_reset"] for m in metrics] == [False, False, True, False, True]
    assert [m["trajmesh_learner_reference_version"] for m in metrics] == [0, 0, 2, 2, 4]
    # Right after a reset the reference is the policy: KL exactly 0 at that step's (pre-update) forward.
    assert metrics[2]["trajmesh_learner_reference_kl_k3"] == 0.0
    assert metrics[4]["trajmesh_learner_reference_kl_k3"] == 0.0
    assert metrics[3]["trajmesh_learner_reference_kl_k3"] > 0
    logged = [r.getMessage() for r in caplog.records if "reference reset" in r.getMessage()]
    assert logged == ["reference reset to version 2 (optimizer state cleared)",
                      "reference reset to version 4 (optimizer state cleared)"]
    assert REGISTRY.get_sample_value("trajmesh_learner_reference_reset_steps_total") == resets_before + 2
    assert REGISTRY.get_sample_value("trajmesh_learner_reference_version") == 4.0


def test_resume_is_bitwise_with_the_reference_on_across_a_reset(tmp_path: Path) -> None:
    """An uninterrupted run of 6 steps (resets at versions 2 and 4) against one checkpointed at
    version 3 (reference at 2, written to the checkpoint) and resumed by a fresh learner."""
    model = tiny_llama_dir(tmp_path)
    over = {"learner.reference.reset_every": 2, "learner.reference.kl_coef": 0.2, "learner.lr": 1e-2}
    a = _service(tmp_path, model, "a", **over)
    whole = _steps(a, 0, 6)

    b = _service(tmp_path, model, "b", **over)
    _steps(b, 0, 3)
    assert b.reference.version == 2
    b._checkpoint()
    assert (b.ckpt_dir / "latest" / "reference.pt").is_file()
    c = _service(tmp_path, model, "b", **over)  # a fresh learner on b's run dir
    assert c.reference.version == 0
    c._load_checkpoint()
    assert (c.version, c.reference.version) == (3, 2)
    resumed = _steps(c, 3, 6)
    keys = [k for k in whole[0] if k.startswith("trajmesh_learner_") or k == "reference_reset"]
    for x, y in zip(whole[3:], resumed, strict=True):
        assert {k: x[k] for k in keys} == {k: y[k] for k in keys}
    pa, pc = a.engine.full_state_dict(), c.engine.full_state_dict()
    assert all(torch.equal(pa[k], pc[k]) for k in pa)
    ra, rc = a.reference._tensors(), c.reference._tensors()
    assert all(torch.equal(ra[k], rc[k]) for k in ra)
    assert any(not torch.equal(ra[k], pa[k]) for k in ra)  # the policy moved on from the last reset


def test_the_term_keeps_kl_to_the_reference_under_a_bound_the_run_without_it_exceeds(tmp_path: Path) -> None:
    """Same seed, same batches, lr 3e-2: with kl_coef 0 the reference is only measured and the policy
    runs away from it; with the term it stays close."""
    model = tiny_llama_dir(tmp_path)
    bound = 1.0
    kl = {}
    for coef in (0.0, 2.0):
        svc = _service(tmp_path, model, f"c{coef}", **{"learner.lr": 3e-2, "learner.reference.kl_coef": coef})
        metrics = _steps(svc, 0, 8)
        kl[coef] = [m["trajmesh_learner_reference_kl_k3"] for m in metrics]
    assert max(kl[2.0]) < bound < kl[0.0][-1], kl


# ------------------------------------------------------------------ ZeRO-3: sharded like the policy

@pytest.mark.slow  # ~30 s on a loaded 2-core machine (DeepSpeed's start, two ZeRO-3 engines)
@pytest.mark.parametrize("built", ["copied_before", "partitioned_after"])
def test_under_zero3_the_reference_is_partitioned_like_the_policy_and_resets_from_its_shards(built: str) -> None:
    pytest.importorskip("deepspeed")
    from tiny_llama import tiny_llama

    from trajmesh.config import ReferenceConfig
    from trajmesh.learner import advantages, step
    from trajmesh.learner.logprobs import PolicyLogprobs
    from trajmesh.learner.reference import ReferencePolicy
    from trajmesh.learner.train_engine import build_train_engine, ensure_distributed, shutdown_distributed

    created = ensure_distributed("gloo")
    try:
        policy = PolicyLogprobs(tiny_llama())
        if built == "copied_before":  # a whole copy, then partitioned by its own deepspeed.initialize
            ref = ReferencePolicy(policy, "deepspeed", zero_stage=3, precision="fp32")
        engine = build_train_engine(policy, type="deepspeed", zero_stage=3, lr=3e-2, warmup_steps=0,
                                    weight_decay=0.0, grad_clip=1.0, seed=0)
        if built == "partitioned_after":  # never whole: zero.Init, then the policy's own partitions
            ref = ReferencePolicy.after_zero3_engine(engine)
        pairs = ref._pairs(engine)
        assert pairs and all(hasattr(r, "ds_id") and r.ds_tensor.numel() == p.ds_tensor.numel()
                             for r, p in pairs)
        batch = step.build_batch(two_groups_of_four(0), pad_id=0)
        adv_BT = advantages.advantages_BT(batch, "grpo", scale_by_std=True, eps=1e-6)
        kl = ReferenceConfig(enabled=True, kl_coef=0.1)

        def train(version: int) -> float:
            m = step.train_batch(engine, batch, adv_BT, ObjectiveConfig(), step.StepPlan(micro_batch_tokens=1024),
                                 temperature=1.0, version=version, max_lag=2, reference=ref, kl=kl)
            return float(m["trajmesh_learner_reference_kl_k3"])

        assert train(0) == 0.0  # the reference is the initial policy
        assert train(1) > 0.0
        ref.reset_from(engine, 2)
        assert train(2) == 0.0
    finally:
        if created:
            shutdown_distributed()


@pytest.mark.slow  # ~20 s (DeepSpeed's start, two ZeRO-3 engines)
def test_the_learner_service_builds_its_zero3_reference_from_the_engines_partitions(tmp_path: Path) -> None:
    """Under ZeRO-3 the learner service builds the reference after its engine
    (`ReferencePolicy.after_zero3_engine`): the first step's KL is exactly 0 (the reference holds
    the initial weights, copied from the policy's partitions) and a trained step's is not."""
    pytest.importorskip("deepspeed")
    from trajmesh.learner.train_engine import shutdown_distributed

    svc = _service(tmp_path, tiny_llama_dir(tmp_path), "run", **{"learner.engine.type": "deepspeed",
                                                             "learner.engine.zero_stage": 3,
                                                             "learner.reference.kl_coef": 0.1})
    try:
        assert svc.reference is not None and svc.reference.zero3
        assert all(hasattr(p, "ds_id") for p in svc.reference.module.module.parameters())
        metrics = _steps(svc, 0, 2)
        assert metrics[0]["trajmesh_learner_reference_kl_k3"] == 0.0
        assert metrics[1]["trajmesh_learner_reference_kl_k3"] > 0.0
    finally:
        shutdown_distributed()
