"""The systems benchmark's timing model (bench/bench_systems.py): the synthetic engine's modelled
decode time and response lengths, and the learner's modelled step cost. Every check is on durations
the model computes (steps × step time), never on the wall clock."""

from __future__ import annotations

import asyncio
import math
import random
from pathlib import Path

import pytest

from trajmesh.config import SimulatedStepCost, load_config
from trajmesh.contract import Trajectory
from trajmesh.rollout.engines.synthetic_engine import SyntheticEngine, SyntheticEngineConfig, SyntheticTiming
from trajmesh.v1 import trajectory_pb2

EOS = 0


def _engine(**timing: float) -> SyntheticEngine:
    return SyntheticEngine(40, EOS, seed=3, timing=SyntheticTiming(**timing))  # type: ignore[arg-type]


def test_step_time_grows_with_the_batch() -> None:
    e = _engine(decode_step_s=0.01, step_s_per_sequence=0.001)
    assert e.step_seconds(1) == pytest.approx(0.011)
    assert e.step_seconds(32) == pytest.approx(0.042)
    assert _engine(decode_step_s=0.01).step_seconds(64) == pytest.approx(0.01)  # memory-bound: flat


def test_decode_time_grows_with_the_tokens_of_concurrent_requests() -> None:
    """Two requests submitted together share the batch until the shorter one ends: the modelled busy
    time is short·step(2) + (long − short)·step(1), and the steps are the longer one's tokens."""
    e = _engine(decode_step_s=0.002, step_s_per_sequence=0.001)

    async def main() -> list[int]:
        res = await asyncio.gather(e.generate([1, 2], {"max_new_tokens": 30}),
                                   e.generate([1, 2], {"max_new_tokens": 12}))
        return [len(r.output_ids) for r in res]

    assert asyncio.run(main()) == [30, 12]
    assert e.decode_steps == 30
    assert e.busy_seconds == pytest.approx(12 * 0.004 + 18 * 0.003)
    # Alone, a longer response costs proportionally more modelled time.
    e2 = _engine(decode_step_s=0.002)
    asyncio.run(e2.generate([1], {"max_new_tokens": 10}))
    t10 = e2.busy_seconds
    asyncio.run(e2.generate([1], {"max_new_tokens": 40}))
    assert e2.busy_seconds - t10 == pytest.approx(4 * t10)


def test_max_batch_queues_the_rest() -> None:
    """With room for one sequence, two requests decode one after the other: steps add up."""
    e = _engine(decode_step_s=0.001, max_batch=1)

    async def main() -> None:
        await asyncio.gather(e.generate([1], {"max_new_tokens": 8}), e.generate([1], {"max_new_tokens": 5}))

    asyncio.run(main())
    assert e.decode_steps == 13
    assert e.busy_seconds == pytest.approx(0.013)


def test_response_lengths_are_lognormal_capped_and_end_with_eos() -> None:
    e = _engine(length_median=20, length_sigma=1.0)
    rng = random.Random(3)  # the engine's own seed: the same draws
    expected = [max(1, round(20 * math.exp(rng.gauss(0.0, 1.0)))) for _ in range(200)]
    got = [e.response_length(64) for _ in range(200)]
    assert [n for n, _ in got] == [min(n, 64) for n in expected]
    assert [stop for _, stop in got] == [n < 64 for n in expected]
    assert any(stop for _, stop in got) and not all(stop for _, stop in got)  # both kinds occur at this budget

    async def one() -> tuple[list[int], dict[str, object]]:
        r = await e.generate([1], {"max_new_tokens": 10_000})  # no cap reached: ends with EOS
        return r.output_ids, r.finish_reason

    ids, finish = asyncio.run(one())
    assert ids[-1] == EOS and EOS not in ids[:-1] and finish == {"type": "stop"}
    assert _engine(length_median=20, length_sigma=0.0).response_length(64) == (20, True)


def test_without_a_timing_model_the_engine_is_instant_and_full_length() -> None:
    e = SyntheticEngine(40, EOS, seed=0)
    r = asyncio.run(e.generate([1], {"max_new_tokens": 7}))
    assert len(r.output_ids) == 7 and EOS not in r.output_ids and r.finish_reason["type"] == "length"
    assert e.decode_steps == 0 and e.busy_seconds == 0.0


def test_learner_step_cost_knob() -> None:
    cost = SimulatedStepCost(seconds_per_token=0.001, seconds_per_step=0.5)
    assert cost.enabled
    assert cost.seconds(2000) == pytest.approx(2.5)
    assert cost.seconds(4000) - cost.seconds(2000) == pytest.approx(2.0)
    assert not SimulatedStepCost().enabled  # off by default: the learner trains
    cfg = load_config(None, {"learner.simulated_step.seconds_per_token": 0.002,
                             "rollout.engine.type": "synthetic", "rollout.engine.synthetic.decode_step_s": 0.01})
    assert cfg.learner.simulated_step.seconds(100) == pytest.approx(0.2)
    assert isinstance(cfg.rollout.engine, SyntheticEngineConfig) and cfg.rollout.engine.synthetic.decode_step_s == 0.01


def test_the_learner_sleeps_the_modelled_step_instead_of_training(tmp_path: Path, tiny_model_dir: str) -> None:
    """learner.simulated_step in LearnerService._train_step (as the offline replay drives it): the
    step reports a·(sampled tokens of the non-stale trajectories) + b seconds, the weights do not
    change, and the version still advances by one; a stale trajectory's tokens do not count."""
    import torch

    from trajmesh.services.learner import LearnerService

    a, b = 1e-4, 0.01
    cfg = load_config(None, {"run_dir": str(tmp_path / "run"), "model.path": tiny_model_dir,
                             "learner.engine.type": "torch", "learner.consistency_probe_trajectories": 0,
                             "learner.simulated_step.seconds_per_token": a,
                             "learner.simulated_step.seconds_per_step": b})
    svc = LearnerService(cfg)
    svc._build_trainer()
    svc.version = 5

    def traj(tid: str, sampled: int, version: int, reward: float) -> Trajectory:
        t = Trajectory.new(trajectory_id=tid)
        t.pb.group_id, t.pb.task_id = "g", "task"
        t.append_prompt([1, 2, 3])
        t.append_sampled([4] * sampled, [-1.0] * sampled, version)
        t.finish(trajectory_pb2.EOS)
        t.set_reward(reward)
        return t

    trajs = [traj("t0", 7, 5, 1.0), traj("t1", 4, 4, 0.0), traj("stale", 9, 1, 0.5)]
    before = [p.detach().clone() for p in svc.engine.module.parameters()]
    outcome = svc._train_step(trajs, eta=1, temperature=1.0)
    metrics = outcome.metrics
    assert sorted(outcome.trained_ids) == ["t0", "t1"] and outcome.stale_ids == ["stale"]
    assert not any(k.startswith("_") for k in metrics)  # control data is not telemetry
    assert metrics["trajectories_stale"] == 1 and metrics["tokens_trained"] == 11
    assert metrics["simulated_step_seconds"] == pytest.approx(b + a * 11)
    assert svc.version == 6
    assert all(torch.equal(p, q) for p, q in zip(before, svc.engine.module.parameters(), strict=True))
