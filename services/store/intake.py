"""The store's intake verdict on one TRAJ_GRADED message, as a pure function (no I/O, no torch).

Everything the store receives is classified here before it can touch a group or the learner:
bytes that are not a trajectory, unknown tasks, trajectories that claim another task's group,
contract violations (named by `Trajectory.validate`), infrastructure failures, ungraded ones.
Only a `valid` verdict may be trained. The fuzz tests drive this function with hostile input.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from trajmesh.contract import ContractError, Trajectory
from trajmesh.v1 import trajectory_pb2

OUTCOME_VALID = "valid"
INFRA_REASON_UNKNOWN = "infra_failure"
"""The failed_infra reason of a trajectory that names no cause (a record written before `infra_cause`)."""


def infra_reason(traj: Trajectory) -> str:
    """The failed_infra reason of a trajectory that ended INFRA_FAILURE: ``infra_<cause>`` from its
    typed cause (``infra_environment``, ``infra_deadline``, ...), `INFRA_REASON_UNKNOWN` without one."""
    cause = int(traj.infra_cause)
    if cause == trajectory_pb2.INFRA_CAUSE_UNSPECIFIED or cause not in trajectory_pb2.InfraCause.values():
        return INFRA_REASON_UNKNOWN
    return trajectory_pb2.InfraCause.Name(cause).lower()


INFRA_REASONS = (INFRA_REASON_UNKNOWN, *(name.lower() for name in trajectory_pb2.InfraCause.keys()
                                         if name != "INFRA_CAUSE_UNSPECIFIED"))
"""Every failed_infra reason `judge` gives."""


@dataclass(frozen=True)
class Verdict:
    trajectory: Trajectory | None
    """Parsed trajectory (None: the bytes are not one)."""
    outcome: str
    """valid, quarantined or failed_infra."""
    reason: str
    """Why it is not valid ('' when valid): a violation name list, or a named intake reason."""
    member: bool
    """Whether it belongs to its task's group (counts toward the group's G)."""


def parse(data: bytes) -> Trajectory | None:
    """The trajectory in `data`, or None when the bytes are not one."""
    try:
        return Trajectory.from_bytes(data)
    except ContractError:
        return None


def judge(data: bytes, task: dict[str, Any] | None, *, vocab_size: int | None, learner_version: int) -> Verdict:
    """`task` is the store's record of the trajectory's task (None: unknown task id)."""
    return judge_parsed(parse(data), task, vocab_size=vocab_size, learner_version=learner_version)


def judge_parsed(traj: Trajectory | None, task: dict[str, Any] | None, *, vocab_size: int | None,
                 learner_version: int) -> Verdict:
    """`judge` for a message already parsed with `parse` (the store parses once, to find the task)."""
    if traj is None:
        return Verdict(None, "quarantined", "not_a_trajectory", False)
    return judge_prejudged(traj, prejudge(traj, vocab_size=vocab_size), task, learner_version=learner_version)


@dataclass(frozen=True)
class Prejudged:
    """What a trajectory says of itself, before the store reads Redis (`prejudge`): its verdict
    then needs only the task record and the learner version (`judge_prejudged`)."""
    violations: frozenset[str]
    """Names of the broken invariants (`Trajectory.validate`) but the learner-version one."""
    newest_version: int
    """The largest behaviour version over every token (-1: no token); above the learner's version
    the trajectory breaks ``version_from_future``."""
    oldest_sampled_version: int
    """The oldest behaviour version among its sampled tokens (-1: none sampled): what its staleness
    is measured by (the store's stale-on-arrival cut)."""
    valid_member: bool
    """Whether, as a member of its task's group and at a learner version ≥ `newest_version`, it is
    `OUTCOME_VALID` and not cut short (terminal reason STALE): the store's one-round intake
    records its membership as valid on that condition and the stale-on-arrival rule alone."""


def prejudge(traj: Trajectory, *, vocab_size: int | None) -> Prejudged:
    """`Prejudged` of `traj`: `Trajectory.validate` once, without the learner version."""
    names = frozenset(v.name for v in traj.validate(vocab_size=vocab_size))
    try:
        versions_T = traj.behavior_versions_T
        mask_T = traj.loss_mask_T
    except ContractError:  # a damaged token block (`validate` names it): never valid, no versions to read
        return Prejudged(names or frozenset({"token_block_malformed"}), -1, -1, False)
    # (arrays of different lengths break `length_mismatch`: never valid, their staleness unused)
    sampled_T = versions_T[mask_T == 1] if versions_T.size == mask_T.size else versions_T[:0]
    newest = int(versions_T.max()) if versions_T.size else -1
    oldest = int(sampled_T.min()) if sampled_T.size else -1
    ok = (not names and traj.terminal_reason not in (trajectory_pb2.INFRA_FAILURE, trajectory_pb2.STALE)
          and traj.graded and math.isfinite(traj.reward))
    return Prejudged(names, newest, oldest, ok)


def judge_prejudged(traj: Trajectory, pre: Prejudged, task: dict[str, Any] | None, *,
                    learner_version: int) -> Verdict:
    """`judge_parsed` from `prejudge`'s facts: the same verdict, `validate` not run again."""
    names = pre.violations | ({"version_from_future"} if pre.newest_version > learner_version else set())
    reason = ",".join(sorted(names))
    if task is None:  # what is wrong with the trajectory itself first: it needs no task to tell
        return Verdict(traj, "quarantined", reason or "unknown_task_id", False)
    member = traj.pb.group_id == task.get("group_id")
    if not member:
        return Verdict(traj, "quarantined", reason or "group_mismatch", False)
    if names:
        return Verdict(traj, "quarantined", reason, True)
    if traj.terminal_reason == trajectory_pb2.INFRA_FAILURE:
        return Verdict(traj, "failed_infra", infra_reason(traj), True)
    if not traj.graded or not math.isfinite(traj.reward):
        return Verdict(traj, "quarantined", "not_graded", True)
    return Verdict(traj, OUTCOME_VALID, "", True)
