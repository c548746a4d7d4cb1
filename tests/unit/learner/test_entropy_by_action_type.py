"""Entropy by action type end to end: per-token action types from spans (build_batch), the learner
step's metrics (compute_loss), and the learner service's gauges and metrics.jsonl record."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from trajmesh.contract import Trajectory
from trajmesh.learner import advantages, step
from trajmesh.learner.metrics import ENTROPY_BY_ACTION_TYPE_NAMES, entropy_by_action_type
from trajmesh.learner.objective import ObjectiveConfig
from trajmesh.v1 import trajectory_pb2

PROMPT, TEXT, TOOL_CALL, CODE, OBSERVATION = (
    trajectory_pb2.PROMPT, trajectory_pb2.TEXT, trajectory_pb2.TOOL_CALL, trajectory_pb2.CODE,
    trajectory_pb2.OBSERVATION)
PAD = trajectory_pb2.ACTION_TYPE_UNSPECIFIED


def _trajectories() -> list[Trajectory]:
    """t0: PROMPT(2) TEXT(2) TOOL_CALL(1) OBSERVATION(2) CODE(3) = 10 tokens;
    t1: PROMPT(1) TEXT(3) OBSERVATION(1) TOOL_CALL(2) = 7 tokens (3 padding in the batch)."""
    a = Trajectory.new(trajectory_id="t0")
    a.pb.group_id, a.pb.task_id = "g", "task"
    a.append_prompt([1, 2])
    a.append_sampled([3, 4], [-1.0, -1.2], 2)
    a.append_sampled([5], [-0.8], 2, action_type=TOOL_CALL)
    a.append_observation([6, 7])
    a.append_sampled([8, 9, 10], [-1.0, -1.1, -0.9], 3, action_type=CODE, turn_index=1)
    a.finish(trajectory_pb2.EOS)
    a.set_reward(1.0)
    b = Trajectory.new(trajectory_id="t1")
    b.pb.group_id, b.pb.task_id = "g", "task"
    b.append_prompt([1])
    b.append_sampled([3, 11, 12], [-1.0, -1.5, -2.0], 3)
    b.append_observation([6])
    b.append_sampled([5, 13], [-0.7, -0.6], 3, action_type=TOOL_CALL, turn_index=1)
    b.finish(trajectory_pb2.EOS)
    b.set_reward(0.0)
    for t in (a, b):
        assert t.validate() == []
    return [a, b]


def _model_config() -> LlamaConfig:
    return LlamaConfig(vocab_size=24, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                       num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=32,
                       tie_word_embeddings=True)


def test_build_batch_fills_the_action_type_of_each_token_from_spans() -> None:
    batch = step.build_batch(_trajectories(), pad_id=0)
    assert batch.action_type_BT.dtype == torch.long
    assert batch.action_type_BT.tolist() == [
        [PROMPT, PROMPT, TEXT, TEXT, TOOL_CALL, OBSERVATION, OBSERVATION, CODE, CODE, CODE],
        [PROMPT, TEXT, TEXT, TEXT, OBSERVATION, TOOL_CALL, TOOL_CALL, PAD, PAD, PAD],
    ]
    # the action types sit exactly on the loss-masked tokens
    sampled_BT = torch.isin(batch.action_type_BT, torch.tensor([TEXT, TOOL_CALL, CODE]))
    assert torch.equal(sampled_BT, batch.mask_BT > 0)


def test_build_batch_leaves_tokens_no_span_covers_unspecified() -> None:
    t = Trajectory.new(trajectory_id="raw")
    t.append_prompt([1, 2])
    t.append_sampled([3, 4, 5], [-1.0] * 3, 0)
    del t.pb.spans[1]  # an older producer that wrote the prompt span only
    t.pb.spans[0].token_end = 9  # and a span running past the end: clipped, not an error
    batch = step.build_batch([t], pad_id=0)
    assert batch.action_type_BT.tolist() == [[PROMPT, PROMPT, PROMPT, PROMPT, PROMPT]]
    t.pb.spans[0].token_end = 2
    batch = step.build_batch([t], pad_id=0)
    assert batch.action_type_BT.tolist() == [[PROMPT, PROMPT, PAD, PAD, PAD]]


def test_compute_loss_reports_the_entropy_of_each_action_type() -> None:
    torch.manual_seed(0)
    model = LlamaForCausalLM(_model_config()).float()
    batch = step.build_batch(_trajectories(), pad_id=0)
    adv_B = advantages.advantages_B(batch, "grpo", scale_by_std=True, eps=1e-6)
    _, metrics = step.compute_loss(model, batch, adv_B, ObjectiveConfig(), temperature=1.0, version=3, max_lag=3)
    with torch.no_grad():
        _, entropy_BT = step.token_logprobs(model, batch, 1.0)
    expected = entropy_by_action_type(entropy_BT, batch.action_type_BT, batch.mask_BT)
    for name, metric in ENTROPY_BY_ACTION_TYPE_NAMES.items():
        assert metrics[metric] == pytest.approx(expected[name], rel=1e-6), name
        assert metrics[metric] > 0.0, name  # every type is present in this batch
    # by hand from the same entropies: TEXT at (0,2),(0,3),(1,1),(1,2),(1,3); CODE at (0,7..9)
    text = [float(entropy_BT[i, j]) for i, j in ((0, 2), (0, 3), (1, 1), (1, 2), (1, 3))]
    assert metrics["trajmesh_learner_entropy_text_action_nats"] == pytest.approx(sum(text) / 5, rel=1e-6)
    code = float(entropy_BT[0, 7:10].sum()) / 3
    assert metrics["trajmesh_learner_entropy_code_action_nats"] == pytest.approx(code, rel=1e-6)


def test_the_learner_exports_every_action_type_from_the_start() -> None:
    """Importing the learner service registers one gauge per action type, at 0 (a fresh interpreter:
    this process may already have taken a step)."""
    check = (
        "from prometheus_client import REGISTRY; import trajmesh.services.learner; "
        "from trajmesh.learner.metrics import ENTROPY_BY_ACTION_TYPE_NAMES as N; "
        "print({n: REGISTRY.get_sample_value(n) for n in N.values()})"
    )
    result = subprocess.run([sys.executable, "-c", check], capture_output=True, text=True, timeout=180)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip().splitlines()[-1] == str(dict.fromkeys(ENTROPY_BY_ACTION_TYPE_NAMES.values(), 0.0))
    assert list(ENTROPY_BY_ACTION_TYPE_NAMES) == ["TEXT", "TOOL_CALL", "CODE"]


def test_a_learner_step_sets_the_gauges_and_returns_the_metrics_jsonl_record(tmp_path: Path) -> None:
    """LearnerService._train_step (as the offline replay drives it): the step's metrics, which run()
    writes to metrics.jsonl, carry each action type's entropy, and the gauges show the same values."""
    from prometheus_client import REGISTRY

    from trajmesh.config import load_config
    from trajmesh.services.learner import LearnerService

    torch.manual_seed(0)
    LlamaForCausalLM(_model_config()).save_pretrained(str(tmp_path / "model"))
    cfg = load_config(None, {"run_dir": str(tmp_path / "run"), "model.path": str(tmp_path / "model"),
                             "learner.engine.type": "torch", "learner.consistency_probe_trajectories": 0})
    svc = LearnerService(cfg)
    svc._build_trainer()
    svc.version, svc.steps_done, svc.trajectories_trained = 3, 0, 0
    trajs = _trajectories()
    trajs[1].pb.ClearField("spans")  # t1 has no spans: its action tokens count in no type
    batch = step.build_batch(trajs, pad_id=0)
    assert batch.action_type_BT[1].tolist() == [PAD] * 10
    with torch.no_grad():  # the pre-update weights: the step's forward sees the same entropies
        _, entropy_BT = step.token_logprobs(svc.engine.module, batch, 1.0)
    # TEXT: t0's tokens 2, 3 only ; TOOL_CALL: t0's token 4 ; CODE: t0's tokens 7..9
    expected = {"TEXT": float(entropy_BT[0, 2:4].mean()), "TOOL_CALL": float(entropy_BT[0, 4]),
                "CODE": float(entropy_BT[0, 7:10].mean())}
    metrics = svc._train_step(trajs, eta=4, temperature=1.0).metrics
    record = json.loads(json.dumps({"kind": "learner_step", **{k: v for k, v in metrics.items()
                                                               if not k.startswith("_")}}))
    for kind, name in ENTROPY_BY_ACTION_TYPE_NAMES.items():
        value = record[name]
        assert isinstance(value, float) and math.isfinite(value), name
        assert value == pytest.approx(expected[kind], rel=1e-5), name
        assert REGISTRY.get_sample_value(name) == pytest.approx(value), name
