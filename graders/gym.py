"""Grader of the ``gym`` source (envs/gym_env.py): the environment's own rewards (no torch).

The grader rebuilds the episode on a fresh environment from the task and the sampled turns (only
the turns the environment saw: a turn cut by the token budget never reached it), checks every
replayed state hash against the hashes rollout recorded (a mismatch means the environment is not
deterministic: an infrastructure error, never policy reward), and scores the per-step rewards: the
reward is their sum (the episode's return) or the last one (the task's ``reward``); each step's
reward is the raw reward component ``step_<k>`` (k from 1), beside ``return`` and ``steps``.
"""

from __future__ import annotations

from typing import Any

from trajmesh.envs.gym_env import GymEnv, TextArenaEnv
from trajmesh.graders.base import Grade, Sample


class ReplayMismatch(RuntimeError):
    """Replaying the action log did not reproduce the recorded state hashes."""


class GymGrader:
    revision = "gym-replay-v1"
    components = ("return", "steps")
    """Fixed components; the per-step ``step_<k>`` ones come with them (one per step taken)."""

    def grade(self, sample: Sample, task: dict[str, Any]) -> Grade:
        env: GymEnv | TextArenaEnv = TextArenaEnv() if task["metadata"].get("environment") == "textarena" else GymEnv()
        _, h = env.reset(task, 0)  # an episode does not depend on the reset seed (envs/gym_env.py)
        hashes, rewards = [h], []
        turns = sample.turns[: len(sample.state_hashes) - 1] if sample.state_hashes else sample.turns
        for turn in turns:
            res = env.step(turn)
            hashes.append(res.state_hash)
            rewards.append(float(res.reward))
            if res.done:
                break
        recorded = list(sample.state_hashes)
        if recorded and recorded != hashes[: len(recorded)]:
            raise ReplayMismatch(f"replayed {hashes} but rollout recorded {recorded}: the environment is not "
                                 "deterministic given (task, seed, actions)")
        total = sum(rewards)
        reward = rewards[-1] if task["metadata"].get("reward") == "last" and rewards else total
        components = {"return": total, "steps": float(len(rewards)),
                      **{f"step_{k}": r for k, r in enumerate(rewards, 1)}}
        return Grade(reward, components, f"step rewards={rewards} ({sample.terminal_reason})", self.revision)
