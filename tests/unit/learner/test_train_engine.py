"""Tests for trajmesh.learner.train_engine (torch and DeepSpeed train engines, CPU).

DeepSpeed runs in this test process as a world of size 1 over gloo (DS_ACCELERATOR=cpu). The
module-scoped ``ds_world`` fixture creates that process group once and destroys it at the end of the
module (only if it created it), so no process group leaks into other test modules.

Tolerance of DeepSpeed vs torch (test_deepspeed_matches_torch): parameters within
``atol=1e-6, rtol=1e-5`` after 3 clipped steps (lr 1e-2). ZeRO-1/2/3 flatten parameters and compute
the grad norm in a different order and with a slightly different clip formula
(``grad / ((norm + 1e-6) / clip)`` vs torch's ``grad * (clip / (norm + 1e-6))``), so bitwise equality
is not promised; without active clipping they are bitwise equal here.
"""

from __future__ import annotations

import importlib.util
import subprocess
import sys

import pytest
import torch
from torch import nn

from trajmesh.learner.train_engine import (
    TRAIN_ENGINES,
    DeepSpeedTrainEngine,
    TorchTrainEngine,
    TrainEngine,
    build_train_engine,
    ensure_distributed,
    lr_at,
    shutdown_distributed,
)


def _has_deepspeed() -> bool:
    try:
        return importlib.util.find_spec("deepspeed") is not None
    except (ImportError, ValueError):
        return False


HAS_DEEPSPEED = _has_deepspeed()
needs_ds = pytest.mark.skipif(not HAS_DEEPSPEED, reason="deepspeed not installed")

# (type, zero_stage) combinations exercised by most tests.
ENGINES = [
    pytest.param("torch", 0, id="torch"),
    pytest.param("deepspeed", 0, id="ds-zero0", marks=needs_ds),
    pytest.param("deepspeed", 2, id="ds-zero2", marks=needs_ds),
]


@pytest.fixture(scope="module")
def ds_world():
    """A gloo world of size 1 for DeepSpeed, destroyed after this module if we made it."""
    if not HAS_DEEPSPEED:
        yield None
        return
    try:
        created = ensure_distributed("gloo")
    except Exception as e:  # pragma: no cover - depends on the environment
        pytest.skip(f"deepspeed distributed init failed on this host: {e!r}")
    yield created
    if created:
        shutdown_distributed()
        assert not torch.distributed.is_initialized()


@pytest.fixture
def world(request):
    """The DeepSpeed world when the test's engine type is deepspeed; nothing for the torch engine."""
    callspec = getattr(request.node, "callspec", None)
    if callspec is not None and callspec.params.get("typ") == "deepspeed":
        return request.getfixturevalue("ds_world")
    return None


def make_mlp(seed: int = 0, dropout: float = 0.0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Dropout(dropout), nn.Linear(32, 4))


def fixed_batch(seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(64, 8, generator=g), torch.randn(64, 4, generator=g)


def mse_step(
    engine: TrainEngine, x: torch.Tensor, y: torch.Tensor, noise: bool = False
) -> tuple[float, dict]:
    if noise:  # draws from the global torch RNG: makes RNG restore on resume observable
        x = x + 0.05 * torch.randn_like(x)
    loss = ((engine.module(x) - y) ** 2).mean()
    engine.backward(loss)
    return float(loss.detach()), engine.step()


def build(model: nn.Module, typ: str, stage: int, **kw) -> TrainEngine:
    args = dict(lr=1e-2, warmup_steps=0, weight_decay=0.01, grad_clip=1.0, zero_stage=stage, seed=0)
    args.update(kw)
    return build_train_engine(model, type=typ, **args)


# ------------------------------------------------------------------------------------------------


def test_registry_and_unknown_type():
    assert TRAIN_ENGINES["torch"] is TorchTrainEngine
    assert TRAIN_ENGINES["deepspeed"] is DeepSpeedTrainEngine
    with pytest.raises(ValueError, match="unknown train engine"):
        build(make_mlp(), "nope", 0)


def test_module_import_does_not_import_deepspeed():
    code = (
        "import sys, trajmesh.learner.train_engine as t; assert 'deepspeed' not in sys.modules; print('ok')"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "ok"


def test_lr_at_values():
    assert [lr_at(s, 1.0, 4) for s in range(6)] == [0.25, 0.5, 0.75, 1.0, 1.0, 1.0]
    assert [lr_at(s, 3e-4, 0) for s in range(3)] == [3e-4] * 3
    assert lr_at(0, 2.0, 1) == 2.0


@pytest.mark.parametrize("typ,stage", ENGINES)
def test_warmup_lr_schedule(world, typ, stage):
    eng = build(make_mlp(), typ, stage, lr=0.1, warmup_steps=4)
    x, y = fixed_batch()
    lrs = []
    for s in range(6):
        assert eng.lr == pytest.approx(lr_at(s, 0.1, 4), abs=1e-12)
        lrs.append(mse_step(eng, x, y)[1]["lr"])
    assert lrs == pytest.approx([0.025, 0.05, 0.075, 0.1, 0.1, 0.1], abs=1e-12)
    assert eng.global_step == 6


def test_decay_lr_values():
    # warmup 2 updates, then from 1 at update 2 to 0.1 at update 10, held after (values by hand)
    linear = [lr_at(s, 1.0, 2, "linear", 10, 0.1) for s in (0, 1, 2, 4, 6, 9, 10, 20)]
    assert linear == pytest.approx([0.5, 1.0, 1.0, 0.775, 0.55, 0.2125, 0.1, 0.1], abs=1e-12)
    cosine = [lr_at(s, 1.0, 2, "cosine", 10, 0.1) for s in (2, 4, 6, 8, 10)]
    assert cosine == pytest.approx([1.0, 0.868198, 0.55, 0.231802, 0.1], abs=1e-6)
    assert lr_at(5, 2.0, 0, "linear", 10, 0.0) == pytest.approx(1.0, abs=1e-12)
    with pytest.raises(ValueError, match="decay_steps"):
        build(make_mlp(), "torch", 0, warmup_steps=4, schedule="linear", decay_steps=4)
    with pytest.raises(ValueError, match="schedule"):
        build(make_mlp(), "torch", 0, schedule="step")


@pytest.mark.parametrize("typ,stage", ENGINES)
def test_linear_decay_lr_schedule(world, typ, stage):
    eng = build(make_mlp(), typ, stage, lr=0.1, warmup_steps=2, schedule="linear", decay_steps=6,
                min_lr_ratio=0.2)
    x, y = fixed_batch()
    lrs = [mse_step(eng, x, y)[1]["lr"] for _ in range(8)]
    # 0.05, 0.1 (warmup), then 0.1 -> 0.02 over updates 2..6, held at 0.02
    assert lrs == pytest.approx([0.05, 0.1, 0.1, 0.08, 0.06, 0.04, 0.02, 0.02], abs=1e-12)
    assert eng.lr == pytest.approx(0.02, abs=1e-12)


@pytest.mark.parametrize("typ,stage", ENGINES)
def test_loss_decreases_mlp(world, typ, stage):
    eng = build(make_mlp(), typ, stage, lr=1e-2, warmup_steps=2)
    x, y = fixed_batch()
    losses = []
    for _ in range(30):
        loss, stats = mse_step(eng, x, y)
        losses.append(loss)
        assert stats["grad_norm"] > 0 and stats["grad_norm"] == stats["grad_norm"]  # finite, not NaN
    assert losses[-1] < 0.7 * losses[0], losses


@pytest.mark.parametrize(
    "typ,stage",
    [pytest.param("torch", 0, id="torch"), pytest.param("deepspeed", 1, id="ds-zero1", marks=needs_ds)],
)
def test_loss_decreases_tiny_llama(world, typ, stage):
    transformers = pytest.importorskip("transformers")
    cfg = transformers.LlamaConfig(
        vocab_size=32,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=2,
        max_position_embeddings=64,
    )
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(cfg)
    eng = build(model, typ, stage, lr=3e-3, warmup_steps=2)
    ids = torch.randint(0, 32, (4, 12), generator=torch.Generator().manual_seed(3))
    losses = []
    for _ in range(8):
        out = eng.module(input_ids=ids, labels=ids)
        eng.backward(out.loss)
        eng.step()
        losses.append(float(out.loss.detach()))
    assert losses[-1] < losses[0], losses


@needs_ds
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_deepspeed_matches_torch(ds_world, stage):
    x, y = fixed_batch()
    # grad_clip=0.05 is well below the grad norm (~0.5), so clipping is active on every step.
    kw = dict(lr=1e-2, warmup_steps=2, grad_clip=0.05)
    ref = build(make_mlp(), "torch", 0, **kw)
    ds = build(make_mlp(), "deepspeed", stage, **kw)
    for _ in range(3):
        loss_r, st_r = mse_step(ref, x, y)
        loss_d, st_d = mse_step(ds, x, y)
        assert loss_d == pytest.approx(loss_r, rel=1e-5)
        assert st_d["lr"] == st_r["lr"]
        assert st_d["grad_norm"] == pytest.approx(st_r["grad_norm"], rel=1e-5)
        assert st_r["grad_norm"] > 0.05
    a, b = ref.full_state_dict(), ds.full_state_dict()
    assert a.keys() == b.keys()
    for k in a:
        torch.testing.assert_close(b[k], a[k], atol=1e-6, rtol=1e-5, msg=k)
    # And the models did move.
    init = make_mlp().state_dict()
    assert any(not torch.equal(init[k], a[k]) for k in a)


@pytest.mark.parametrize("typ,stage", ENGINES)
def test_reproducible_run_to_run(world, typ, stage):
    x, y = fixed_batch()

    def run() -> dict[str, torch.Tensor]:
        eng = build(make_mlp(dropout=0.2), typ, stage, warmup_steps=1, seed=7)
        for _ in range(3):
            mse_step(eng, x, y, noise=True)
        return eng.full_state_dict()

    p1, p2 = run(), run()
    for k in p1:
        assert torch.equal(p1[k], p2[k]), k


@pytest.mark.parametrize(
    "typ,stage",
    ENGINES + [pytest.param("deepspeed", 3, id="ds-zero3", marks=needs_ds)],
)
def test_checkpoint_resume_bitwise(world, tmp_path, typ, stage):
    x, y = fixed_batch()
    kw = dict(warmup_steps=3, grad_clip=0.3, seed=11)  # warmup spans the checkpoint; dropout + noise use RNG

    eng = build(make_mlp(dropout=0.2), typ, stage, **kw)
    for _ in range(2):
        mse_step(eng, x, y, noise=True)
    ckpt = tmp_path / "ckpt"
    eng.save_checkpoint(ckpt, client_state={"consumed": 2, "note": "hi", "nested": {"a": [1, 2]}})
    stats_a = [mse_step(eng, x, y, noise=True)[1] for _ in range(2)]
    p_a = eng.full_state_dict()
    next_draw_a = torch.rand(3)
    del eng

    # A fresh engine around a differently initialised model with another seed: everything that
    # matters must come from the checkpoint.
    fresh = build(make_mlp(seed=123, dropout=0.2), typ, stage, **{**kw, "seed": 999})
    client = fresh.load_checkpoint(ckpt)
    assert client == {"consumed": 2, "note": "hi", "nested": {"a": [1, 2]}}
    assert fresh.global_step == 2
    stats_b = [mse_step(fresh, x, y, noise=True)[1] for _ in range(2)]
    p_b = fresh.full_state_dict()
    assert stats_b == stats_a  # same lr (schedule restored) and bitwise-same grad norms
    for k in p_a:
        assert torch.equal(p_a[k], p_b[k]), k
    assert torch.equal(torch.rand(3), next_draw_a)  # RNG stream continued identically


@pytest.mark.parametrize("typ,stage", ENGINES)
def test_load_missing_checkpoint_raises(world, tmp_path, typ, stage):
    eng = build(make_mlp(), typ, stage)
    with pytest.raises(FileNotFoundError):
        eng.load_checkpoint(tmp_path / "nothing-here")


@pytest.mark.parametrize("typ,stage", ENGINES)
def test_zero_grad_discards_accumulated_grads(world, typ, stage):
    x, y = fixed_batch()
    a = build(make_mlp(), typ, stage)
    b = build(make_mlp(), typ, stage)
    # a: a junk backward, then zero_grad, then the real step. b: the real step only.
    loss = (a.module(x * 10) ** 2).mean()
    a.backward(loss)
    a.zero_grad()
    sa = mse_step(a, x, y)[1]
    sb = mse_step(b, x, y)[1]
    assert sa["grad_norm"] == pytest.approx(sb["grad_norm"], rel=1e-6)
    pa, pb = a.full_state_dict(), b.full_state_dict()
    for k in pa:
        torch.testing.assert_close(pa[k], pb[k], atol=0, rtol=0)


@pytest.mark.parametrize(
    "typ,stage", ENGINES + [pytest.param("deepspeed", 3, id="ds-zero3", marks=needs_ds)]
)
def test_accumulated_micro_batches_equal_one_batch(world, typ, stage):
    """Three micro-batches (boundary only on the last), each loss scaled by the whole batch's
    size, give the same gradient norm and update as one backward over the batch."""
    x, y = fixed_batch()
    a = build(make_mlp(), typ, stage, grad_clip=0.0)
    b = build(make_mlp(), typ, stage, grad_clip=0.0)
    cuts = [(0, 10), (10, 40), (40, 64)]
    for i, (lo, hi) in enumerate(cuts):
        loss = ((a.module(x[lo:hi]) - y[lo:hi]) ** 2).sum() / y.numel()
        a.backward(loss, boundary=i == len(cuts) - 1)
    sa = a.step()
    b.backward(((b.module(x) - y) ** 2).sum() / y.numel())
    sb = b.step()
    assert sa["grad_norm"] == pytest.approx(sb["grad_norm"], rel=1e-5)
    assert sa["grad_norm"] > 0
    pa, pb = a.full_state_dict(), b.full_state_dict()
    for k in pa:
        torch.testing.assert_close(pa[k], pb[k], atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize(("setting", "cuda", "expected"), [
    ("auto", False, True), ("auto", True, False), ("on", True, True), ("off", False, False)])
def test_deterministic_kernels_only_when_asked_on_gpu(setting: str, cuda: bool, expected: bool) -> None:
    from trajmesh.learner.train_engine import wants_deterministic

    assert wants_deterministic(setting, cuda=cuda) is expected


def test_deterministic_setting_rejects_unknown_values() -> None:
    from trajmesh.learner.train_engine import wants_deterministic

    with pytest.raises(ValueError, match="auto, on or off"):
        wants_deterministic("sometimes", cuda=False)
