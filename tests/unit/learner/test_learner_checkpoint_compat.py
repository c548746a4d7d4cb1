"""Learner checkpoints from before the PolicyLogprobs wrapper (model keys without ``policy.``) load
after :func:`add_policy_prefix`: the torch engine's and DeepSpeed's (ZeRO 0 and 2), weights and
optimizer state included. Without the renaming the strict load fails."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch
from tiny_llama import tiny_llama

from trajmesh.learner.checkpoint_compat import add_policy_prefix
from trajmesh.learner.logprobs import PolicyLogprobs, policy_of
from trajmesh.learner.train_engine import build_train_engine, ensure_distributed, shutdown_distributed

needs_ds = pytest.mark.skipif(importlib.util.find_spec("deepspeed") is None, reason="deepspeed not installed")
ENGINES = [pytest.param("torch", 0, id="torch"), pytest.param("deepspeed", 0, id="ds-zero0", marks=needs_ds),
           pytest.param("deepspeed", 2, id="ds-zero2", marks=needs_ds)]


@pytest.fixture(scope="module")
def ds_world():  # type: ignore[no-untyped-def]
    if importlib.util.find_spec("deepspeed") is None:
        yield None
        return
    created = ensure_distributed("gloo")
    yield created
    if created:
        shutdown_distributed()


def _engine(model: torch.nn.Module, typ: str, stage: int):  # type: ignore[no-untyped-def]
    return build_train_engine(model, type=typ, lr=1e-2, warmup_steps=0, weight_decay=0.0, grad_clip=1.0,
                              zero_stage=stage, seed=0)


def _step(engine, wrapped: bool) -> None:  # type: ignore[no-untyped-def]
    ids = torch.tensor([[1, 5, 7, 9, 2], [1, 4, 4, 8, 3]])
    att = torch.ones_like(ids)
    if wrapped:
        loss = engine.module(input_ids=ids, attention_mask=att)[0].mean()
    else:
        loss = engine.module(input_ids=ids, attention_mask=att).logits.float().log_softmax(-1).mean()
    engine.backward(loss)
    engine.step()


@pytest.mark.parametrize(("typ", "stage"), ENGINES)
def test_old_checkpoint_loads_after_renaming(ds_world, tmp_path: Path, typ: str, stage: int) -> None:  # type: ignore[no-untyped-def]
    old = _engine(tiny_llama(0), typ, stage)  # the old layout: the bare HF model in the engine
    _step(old, wrapped=False)
    ckpt = tmp_path / "latest"
    old.save_checkpoint(str(ckpt), client_state={"version": 7})
    saved = {k: v.detach().clone() for k, v in old.model.state_dict().items()}
    del old

    with pytest.raises(RuntimeError):  # what a resumed learner hit: missing policy.* keys
        _engine(PolicyLogprobs(tiny_llama(1)), typ, stage).load_checkpoint(str(ckpt))

    assert add_policy_prefix(ckpt)
    assert add_policy_prefix(ckpt) == []  # already in the new form: left alone
    new = _engine(PolicyLogprobs(tiny_llama(1)), typ, stage)
    assert new.load_checkpoint(str(ckpt)) == {"version": 7}
    loaded = policy_of(new.model).state_dict()
    assert set(loaded) == set(saved)
    for name, tensor in saved.items():
        assert torch.equal(loaded[name], tensor), name
    _step(new, wrapped=True)  # the optimizer state fits the wrapped model's parameters
