"""GiGPO selectable in the learner (`learner.advantage.type: gigpo`, learner/advantages.py
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
from trajmesh.learner import advantages, step
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
        t.pb.step_rewards.append(res.reward)  # as services/rollout.py carries StepResponse.reward
        if res.done:
            break
        t.append_observation([20, 21])
        t.pb.state_hashes.append(res.state_hash)
    t.finish(trajectory_pb2.ENV_DONE)
    t.set_reward(1.0 if env.state_hash() == task["answer"] else 0.0)
    return t, list(t.pb.state_hashes)


def _expected(hashes: list[list[str]], rewards: list[float], step_rewards: list[list[float]]) -> list[list[float]]:
    """GiGPO by hand: step k's reward is the environment's plus, on the last step, the episode's;
    returns discounted back; anchor groups by state hash (one group id here)."""
    returns = []
    for r, env in zip(rewards, step_rewards, strict=True):
        step_r = [*env[:-1], env[-1] + r]
        returns.append([sum(GAMMA ** (u - k) * step_r[u] for u in range(k, len(step_r))) for k in range(len(step_r))])
    members: dict[str, list[float]] = {}
    for hs, rs in zip(hashes, returns, strict=True):
        for h, g in zip(hs, rs, strict=True):
            members.setdefault(h, []).append(g)
    episode = [_relative(r, rewards) for r in rewards]
    return [[episode[i] + OMEGA * _relative(g, members[h]) for h, g in zip(hashes[i], returns[i], strict=True)]
            for i in range(len(rewards))]


def _check(trajs: list[Trajectory], adv_BT: torch.Tensor, expected: list[list[float]]) -> None:
    for i, t in enumerate(trajs):
        for span in t.pb.spans:
            got = adv_BT[i, span.token_start:span.token_end].tolist()
            if span.action_type in (trajectory_pb2.PROMPT, trajectory_pb2.OBSERVATION):
                assert not any(got)
            else:
                assert got == pytest.approx([expected[i][span.turn_index]] * 3, rel=1e-5, abs=1e-6), (i, span)


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

    assert [list(t.pb.step_rewards) for t in trajs] == [[0.0] * len(a) for a in EPISODES]  # workplace: 0 a step
    episode = [_relative(r, rewards) for r in rewards]
    batch = step.build_batch(trajs, pad_id=0)
    adv_BT = advantages.advantages_BT(batch, "gigpo", scale_by_std=True, eps=EPS, trajs=trajs, omega=OMEGA, gamma=GAMMA)
    _check(trajs, adv_BT, _expected(hashes, rewards, [[0.0] * len(a) for a in EPISODES]))
    # Where the initial state repeats (six steps of four episodes) the step advantage moves the
    # episode's; where a state's returns all agree (s1) or it is seen once (the wrong update's) it
    # does not.
    e1 = [float(adv_BT[1, s.token_start]) for s in trajs[1].pb.spans if s.action_type == trajectory_pb2.TEXT]
    assert e1[0] != pytest.approx(episode[1]) and e1[1] != pytest.approx(episode[1])
    assert e1[0] != pytest.approx(e1[1])
    assert e1[2] == pytest.approx(episode[1])
    grpo_BT = advantages.advantages_BT(batch, "grpo", scale_by_std=True, eps=EPS)
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
    adv_BT = advantages.advantages_BT(batch, "gigpo", scale_by_std=True, eps=EPS, trajs=trajs, omega=OMEGA, gamma=GAMMA)
    on = batch.mask_BT > 0
    metrics = svc._train_step(trajs, eta=4, temperature=1.0).metrics
    assert metrics["trajectories_trained"] == 4
    got = metrics["trajmesh_learner_advantage_abs_mean"]
    assert got == pytest.approx(float(adv_BT[on].abs().mean()), rel=1e-5)
    grpo = advantages.advantages_BT(batch, "grpo", scale_by_std=True, eps=EPS)
    assert got != pytest.approx(float(grpo[on].abs().mean()), rel=1e-3)  # not the episode-level figure


def test_gigpo_step_returns_take_the_environments_step_rewards() -> None:
    """An environment reward on a step (here 0.5 on episode 2's lookup, 0.25 on episode 3's wrong
    update) enters that step's return and the returns before it; the episode-level part is
    unchanged."""
    task = make_tasks(0, 1)[0]
    played = [_play(task, actions, n) for n, actions in enumerate(EPISODES)]
    trajs = [t for t, _ in played]
    trajs[2].pb.step_rewards[0] = 0.5
    trajs[3].pb.step_rewards[0] = 0.25
    env = [list(t.pb.step_rewards) for t in trajs]
    batch = step.build_batch(trajs, pad_id=0)
    adv_BT = advantages.advantages_BT(batch, "gigpo", scale_by_std=True, eps=EPS, trajs=trajs, omega=OMEGA, gamma=GAMMA)
    expected = _expected([h for _, h in played], [t.reward for t in trajs], env)
    _check(trajs, adv_BT, expected)
    without = _expected([h for _, h in played], [t.reward for t in trajs], [[0.0] * len(e) for e in env])
    assert expected[1][0] != pytest.approx(without[1][0])  # the anchor group of s0 saw the new returns


def test_step_rewards_are_archived() -> None:
    """The store's archive row carries a trajectory's step rewards (an old part reads them as null)."""
    import tempfile
    from types import SimpleNamespace

    from trajmesh.services.store.archive import ArchiveWriter, final_outcomes, read_archive
    from trajmesh.services.store.service import TrajectoryStore

    task = make_tasks(0, 1)[0]
    t, _ = _play(task, EPISODES[1], 0)
    t.pb.step_rewards[1] = 0.75
    with tempfile.TemporaryDirectory() as d:
        writer = ArchiveWriter(d, writer="store0")
        TrajectoryStore._archive(SimpleNamespace(w=SimpleNamespace(archive=writer)), t, "trained", "")  # type: ignore[arg-type]
        writer.append(trajectory_id="bare", outcome="filtered")
        writer.close()
        rows = final_outcomes(read_archive(d))
    assert rows["e0"]["step_rewards"] == [0.0, 0.75, 0.0]
    assert rows["bare"]["step_rewards"] is None


def test_advantage_metrics_tell_gigpo_from_grpo() -> None:
    """The step's metrics name what it trained with (learner/advantages.py `advantage_metrics`): the
    anchor groups counted here by hand (s0 is reached by 6 steps, s1 by 2: two groups), and a
    nonzero distance from GRPO for GiGPO's advantages, zero for GRPO's own."""
    task = make_tasks(0, 1)[0]
    trajs = [_play(task, actions, n)[0] for n, actions in enumerate(EPISODES)]
    batch = step.build_batch(trajs, pad_id=0)
    kw = {"scale_by_std": True, "eps": EPS}
    gigpo_BT = advantages.advantages_BT(batch, "gigpo", trajs=trajs, omega=OMEGA, gamma=GAMMA, **kw)
    grpo_BT = advantages.advantages_BT(batch, "grpo", **kw)
    as_gigpo = advantages.advantage_metrics(batch, gigpo_BT, "gigpo", trajs, **kw)
    assert as_gigpo["advantage_step_anchor_groups"] == 2
    assert as_gigpo["advantage_minus_grpo_max_abs"] > 0.1
    # a learner that trained GRPO's advantages under a gigpo config would report no distance
    assert advantages.advantage_metrics(batch, grpo_BT, "gigpo", trajs, **kw)["advantage_minus_grpo_max_abs"] == 0.0
    assert advantages.advantage_metrics(batch, grpo_BT, "grpo", trajs, **kw) == {}
