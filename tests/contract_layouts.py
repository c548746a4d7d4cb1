"""A trajectory in the contract's first per-token layout, for tests of what reads records written
before the token block (trajmesh issue 45). Bytes the old code itself wrote are in
tests/fixtures/contract_v1/."""

from __future__ import annotations

from trajmesh.contract import Trajectory
from trajmesh.v1 import trajectory_pb2


def old_layout(traj: Trajectory) -> Trajectory:
    """`traj` with its per-token arrays in the repeated fields 10-13 and 31 and no token block."""
    msg = trajectory_pb2.Trajectory()
    msg.CopyFrom(traj.pb)
    msg.ClearField("token_block")
    msg.token_ids.extend(traj.token_ids_T.tolist())
    msg.loss_mask.extend(traj.loss_mask_T.tolist())
    msg.behavior_logprobs.extend(traj.behavior_logprobs_T.tolist())
    msg.behavior_versions.extend(traj.behavior_versions_T.tolist())
    if (teacher_T := traj.teacher_logprobs_T) is not None:
        msg.teacher_logprobs.extend(teacher_T.tolist())
    return Trajectory(msg)
