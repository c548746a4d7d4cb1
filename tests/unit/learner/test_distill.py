"""On-policy distillation's learning signal (learner/advantages.py `distill_advantages_BT`), by hand.

The two-token example: a vocabulary of two tokens, the student's next-token distribution
π = (0.8, 0.2) and the teacher's π_T = (0.5, 0.5). The per-token advantage of a sampled token y is
log π_T(y) − log π(y): +0.9163 for the rare token, −0.4700 for the common one, and its expectation
under π is −KL(π ‖ π_T) = −(0.8·ln 1.6 + 0.2·ln 0.4) = −0.19274. The policy gradient with those
advantages, E_π[A(y)·∇ log π(y)], is exactly −∇ KL(π ‖ π_T): the distillation step descends the
reverse KL. Expected values are worked out here with `math`, not by the code under test.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from contract_layouts import old_layout

from trajmesh.contract import Trajectory
from trajmesh.learner import advantages, step
from trajmesh.v1 import trajectory_pb2

STUDENT, TEACHER = (0.8, 0.2), (0.5, 0.5)


def _traj(tid: str, sampled: list[int], student_lp: list[float], teacher_lp: list[float] | None, reward: float,
          group: str = "g") -> Trajectory:
    t = Trajectory.new(trajectory_id=tid)
    t.pb.group_id, t.pb.task_id = group, group
    t.append_prompt([5, 6])
    t.append_sampled(sampled, student_lp, 0, turn_index=0)
    t.finish(trajectory_pb2.ENV_DONE)
    t.set_reward(reward)
    if teacher_lp is not None:
        t.set_teacher_logprobs([0.0, 0.0, *teacher_lp], "teacher@abc")
    return t


def test_two_token_example_advantages_metric_and_gradient() -> None:
    # Two samples from the same position: the rare token (1) and the common one (0).
    ln = math.log
    trajs = [_traj("a", [1], [ln(STUDENT[1])], [ln(TEACHER[1])], reward=0.0),
             _traj("b", [0], [ln(STUDENT[0])], [ln(TEACHER[0])], reward=0.0)]
    batch = step.build_batch(trajs, pad_id=0)
    zero_BT = torch.zeros_like(batch.mask_BT)
    adv_BT, metrics = advantages.distill_advantages_BT(zero_BT, batch, trajs, coef=1.0, reward_weight=1.0)
    assert adv_BT[0, 2].item() == pytest.approx(0.916291, abs=1e-5)  # ln 0.5 − ln 0.2
    assert adv_BT[1, 2].item() == pytest.approx(-0.470004, abs=1e-5)  # ln 0.5 − ln 0.8
    assert adv_BT[:, :2].abs().sum().item() == 0  # prompt tokens get nothing
    # The reported reverse KL is the mean over sampled tokens of ln π − ln π_T (two samples).
    assert metrics["trajmesh_learner_distill_reverse_kl_nats"] == pytest.approx((0.470004 - 0.916291) / 2, abs=1e-5)
    assert metrics["trajmesh_learner_distill_tokens"] == 2

    # E_π[A ∇ log π] over the two tokens equals −∇ KL(π ‖ π_T) at the student's logits.
    logits = torch.tensor([ln(0.8), ln(0.2)], requires_grad=True)
    logp = torch.log_softmax(logits, -1)
    advantage = {1: adv_BT[0, 2].item(), 0: adv_BT[1, 2].item()}
    surrogate = sum(STUDENT[y] * advantage[y] * logp[y] for y in (0, 1))
    (pg,) = torch.autograd.grad(surrogate, logits)
    logits2 = torch.tensor([ln(0.8), ln(0.2)], requires_grad=True)
    p = torch.softmax(logits2, -1)
    kl = (p * (torch.log(p) - torch.log(torch.tensor(TEACHER)))).sum()
    assert kl.item() == pytest.approx(0.8 * ln(1.6) + 0.2 * ln(0.4), abs=1e-6)  # 0.19274
    (kl_grad,) = torch.autograd.grad(kl, logits2)
    assert torch.allclose(pg, -kl_grad, atol=1e-6)
    # Hand value: d KL / d z_0 = p0·p1·(ln(p0/t0) − ln(p1/t1)) = 0.16·(ln 1.6 − ln 0.4) = 0.22181
    assert kl_grad[0].item() == pytest.approx(0.16 * (ln(1.6) - ln(0.4)), abs=1e-6)


def test_mixed_with_the_task_reward_and_unscored_rows_untouched() -> None:
    ln = math.log
    scored = _traj("s", [1, 0], [ln(0.2), ln(0.8)], [ln(0.5), ln(0.5)], reward=1.0)
    plain = _traj("p", [1, 0], [ln(0.2), ln(0.8)], None, reward=0.0)
    trajs = [scored, plain]
    batch = step.build_batch(trajs, pad_id=0)
    task_BT = advantages.advantages_BT(batch, "grpo", scale_by_std=False, eps=1e-6)  # +0.5 and −0.5
    adv_BT, metrics = advantages.distill_advantages_BT(task_BT, batch, trajs, coef=2.0, reward_weight=0.5)
    assert adv_BT[0, 2:4].tolist() == pytest.approx([0.5 * 0.5 + 2 * 0.916291, 0.5 * 0.5 - 2 * 0.470004], abs=1e-5)
    assert adv_BT[1].tolist() == task_BT[1].tolist()  # no teacher: the task advantage as it was
    assert metrics["trajmesh_learner_distill_tokens"] == 2


def test_no_teacher_no_change_no_metrics() -> None:
    trajs = [_traj("p", [1], [-1.0], None, reward=1.0), _traj("q", [1], [-1.0], None, reward=0.0)]
    batch = step.build_batch(trajs, pad_id=0)
    task_BT = advantages.advantages_BT(batch, "grpo", scale_by_std=True, eps=1e-6)
    adv_BT, metrics = advantages.distill_advantages_BT(task_BT, batch, trajs, coef=1.0, reward_weight=0.0)
    assert adv_BT is task_BT and metrics == {}


def test_contract_checks_teacher_logprobs() -> None:
    t = _traj("a", [1], [-1.6], [-0.7], reward=0.0)
    assert np.asarray(t.teacher_logprobs_T).tolist() == pytest.approx([0.0, 0.0, -0.7])
    assert t.validate() == []
    old = old_layout(t)  # a record written before the token block, with one more than there are tokens
    old.pb.teacher_logprobs.append(-1.0)
    assert [v.name for v in Trajectory(old.pb).validate()] == ["length_mismatch"]
    t.pb.teacher_logprobs.append(-1.0)  # the same beside a token block: a record no writer makes
    assert [v.name for v in t.validate()] == ["token_block_mixed"]
    bad = _traj("b", [1], [-1.6], [0.3], reward=0.0)  # a log-prob above 0
    assert [v.name for v in bad.validate()] == ["teacher_logprob_invalid"]
