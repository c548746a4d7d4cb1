"""Small batches of trajectories for the learner service's tests (tests/unit/learner/)."""

from __future__ import annotations

from trajmesh.contract import Trajectory
from trajmesh.v1 import trajectory_pb2


def two_groups_of_four(step: int) -> list[Trajectory]:
    """Two groups of four sampled at version 0; in each, two trajectories rewarded 1 and two 0 (GRPO
    advantages ±). The reward follows the first sampled token (3 or 4: correct, 5 or 6: not), a
    label a PRM can learn from the tokens; the last token varies with `step`."""
    out = []
    for g in range(2):
        for i in range(4):
            t = Trajectory.new(trajectory_id=f"s{step}-g{g}-{i}")
            t.pb.group_id, t.pb.task_id = f"g{step}-{g}", f"task{g}"
            t.append_prompt([1, 2 + g])
            t.append_sampled([3 + i, 8 + i + g, 14 + (i + step) % 4], [-3.0, -3.1, -2.9], 0)
            t.finish(trajectory_pb2.EOS)
            t.set_reward(float(i < 2))
            out.append(t)
    return out
