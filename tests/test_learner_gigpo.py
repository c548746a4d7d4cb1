"""GiGPO selectable in the learner (`learner.advantage.type: gigpo`, learner/step.py
`gigpo_advantages_BT`) on the workplace environment's real state hashes.

Four episodes of one workplace task ("Mark task 7 as done"), played through `WorkplaceEnv` as
the rollout does (the reset's state hash, then each step's): a read-only lookup leaves the database
(and its hash) as it was, so the initial state recurs across episodes and within one. Expected
values are worked out here from the formulas with `statistics`, not by the code under test.
"""

from __future__ import annotations

import statistics
from pathlib import Path

import pytest
import torch

from trajmesh.contract import Trajectory
from trajmesh.envs.workplace import WorkplaceEnv, make_tasks
from trajmesh.learner import step
from trajmesh.v1 import trajectory_pb2

GAMMA, OMEGA, EPS = 0.95, 1.0, 1e-6
SOLVE = '<tool>{"name": "update_task", "arguments": {"task_id": 7, "status": "done"}}</tool>'
LOOKUP = '<tool>{"name": "find_employee", "arguments": {"name": "Gus"}}</tool>'
WRONG = '<tool>{"name": "update_task", "arguments": {"task_id": 3, "status": "done"}}</tool>'
DONE = "<done/>"
EPISODES = [[SOLVE, DONE], [LOOKUP, SOLVE, DONE], [LOOKUP, DONE], [WRONG, DONE]]


def _play(task: dict, actions: list[str], n: int) -> tuple[Trajectory, list[str]]:
    """One episode as a trajectory: the prompt, then per turn its action (3 tokens, turn k) and the
    observation; state hashes as services/rollout.py records them; reward 1 when the final
    database is the task's answer (the workplace grader's rule)."""
    env = WorkplaceEnv()
    _, h = env.reset(task, seed=0)
    t = Trajectory.new(trajectory_id=f"e{n}")
    t.pb.group_id, t.pb.task_id = "g", task["task_id"]
    t.pb.state_hashes.append(h)
    t.append_prompt([1, 2])
    for k, action in enumerate(actions):
        t.append_sampled([3 + k, 4 + k, 5 + k], [-1.0, -1.0, -1.0], 0, turn_index=k)
        res = env.step(action)
        if res.done:
            break
        t.append_observation([20, 21])
        t.pb.state_hashes.append(res.state_hash)
    t.finish(trajectory_pb2.ENV_DONE)
    t.set_reward(1.0 if env.state_hash() == task["answer"] else 0.0)
    return t, list(t.pb.state_hashes)


def _relative(x: float, group: list[float]) -> float:
    """GRPO's relative value by hand: (x − mean) / (sample std + eps); 0 for a group of one or an
    all-equal group."""
    if len(group) < 2 or len(set(group)) == 1:
        return 0.0
    return (x - statistics.fmean(group)) / (statistics.stdev(group) + EPS)


def test_gigpo_on_workplace_state_hashes_gives_step_advantages_where_anchor_states_repeat() -> None:
    task = make_tasks(0, 1)[0]
    assert task["metadata"]["goal"] == "Mark task 7 as done."
    played = [_play(task, actions, n) for n, actions in enumerate(EPISODES)]
    trajs = [t for t, _ in played]
    hashes = [h for _, h in played]
    s0 = hashes[0][0]
    assert hashes[1][:2] == [s0, s0] and hashes[2][:2] == [s0, s0]  # the lookup changed nothing
    assert hashes[0][1] == hashes[1][2] != s0 and hashes[3][1] not in (s0, hashes[0][1])
    rewards = [t.reward for t in trajs]
    assert rewards == [1.0, 1.0, 0.0, 0.0]

    # By hand: the reward on each episode's last turn, discounted back; anchor groups by state.
    turns = [len(a) for a in EPISODES]
    returns = [[GAMMA ** (n - 1 - k) * r for k in range(n)] for n, r in zip(turns, rewards, strict=True)]
    members: dict[str, list[float]] = {}
    for hs, rs in zip(hashes, returns, strict=True):
        for h, g in zip(hs, rs, strict=True):
            members.setdefault(h, []).append(g)
    episode = [_relative(r, rewards) for r in rewards]
    expected = [[episode[i] + OMEGA * _relative(g, members[h]) for h, g in zip(hashes[i], returns[i], strict=True)]
                for i in range(4)]

    batch = step.build_batch(trajs, pad_id=0)
    adv_BT = step.advantages_BT(batch, "gigpo", scale_by_std=True, eps=EPS, trajs=trajs, omega=OMEGA, gamma=GAMMA)
    for i, t in enumerate(trajs):
        for span in t.pb.spans:
            if span.action_type == trajectory_pb2.PROMPT or span.action_type == trajectory_pb2.OBSERVATION:
                assert not adv_BT[i, span.token_start:span.token_end].any()
                continue
            got = adv_BT[i, span.token_start:span.token_end].tolist()
            assert got == pytest.approx([expected[i][span.turn_index]] * 3, rel=1e-5, abs=1e-6), (i, span.turn_index)
    # Where the initial state repeats (six steps of four episodes) the step advantage moves the
    # episode's; where a state's returns all agree (s1) or it is seen once (the wrong update's) it
    # does not.
    e1 = [float(adv_BT[1, s.token_start]) for s in trajs[1].pb.spans if s.action_type == trajectory_pb2.TEXT]
    assert e1[0] != pytest.approx(episode[1]) and e1[1] != pytest.approx(episode[1])
    assert e1[0] != pytest.approx(e1[1])
    assert e1[2] == pytest.approx(episode[1])
    grpo_BT = step.advantages_BT(batch, "grpo", scale_by_std=True, eps=EPS)
    assert not torch.allclose(adv_BT, grpo_BT)


def test_a_learner_step_trains_with_gigpo(tmp_path: Path) -> None:
    """`learner.advantage.type: gigpo` through the learner service's step (as the offline replay
    drives it): the step's advantages are GiGPO's (their mean |A| over action tokens)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from trajmesh.config import load_config
    from trajmesh.services.learner import LearnerService

    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(vocab_size=24, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                 num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=32,
                                 tie_word_embeddings=True)).save_pretrained(str(tmp_path / "model"))
    cfg = load_config(None, {"run_dir": str(tmp_path / "run"), "model.path": str(tmp_path / "model"),
                             "learner.engine.type": "torch", "learner.consistency_probe_trajectories": 0,
                             "learner.advantage.type": "gigpo"})
    svc = LearnerService(cfg)
    svc._build_trainer()
    task = make_tasks(0, 1)[0]
    trajs = [_play(task, actions, n)[0] for n, actions in enumerate(EPISODES)]
    batch = step.build_batch(trajs, pad_id=0)
    adv_BT = step.advantages_BT(batch, "gigpo", scale_by_std=True, eps=EPS, trajs=trajs, omega=OMEGA, gamma=GAMMA)
    on = batch.mask_BT > 0
    metrics = svc._train_step(trajs, eta=4, temperature=1.0).metrics
    assert metrics["trajectories_trained"] == 4
    got = metrics["trajmesh_learner_advantage_abs_mean"]
    assert got == pytest.approx(float(adv_BT[on].abs().mean()), rel=1e-5)
    grpo = step.advantages_BT(batch, "grpo", scale_by_std=True, eps=EPS)
    assert got != pytest.approx(float(grpo[on].abs().mean()), rel=1e-3)  # not the episode-level figure
