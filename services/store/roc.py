"""GRPO-RoC, Resample-on-Correct (rStar2-Agent; survey §5.2): a group filter at the store.

The store admits ``oversample × G`` samples of a task; when they are all back, RoC keeps G:

1. negatives (reward ≤ ``correct_above``) are drawn uniformly, up to half of the kept group
   (⌊G/2⌋), or more where too few positives exist to fill it;
2. each positive gets a penalty, the sum of two scores of how it got there:

   - tool-error score: 0.5 when it made no tool call, else its failed calls over all its calls
     (a call whose status is not ``TOOL_OK``: an error, a timeout, a sandbox violation, invalid);
   - format score: 1 when its sampled text holds no answer tag, else
     min(1, (answers − 1) / turns), answers the tags counted, turns its sampled turns;

3. the positives that fill the rest are drawn without replacement, each draw with probability
   proportional to 1 / (penalty + ``penalty_floor``): clean successes are kept far more often than
   messy ones, and a messy one can still be kept.

The reward is untouched (the penalties select, they do not shape). Every sample that RoC drops
ends ``filtered`` with its reason; every kept one's ``accepted`` row says which side it was kept
on, and both carry their two scores (`services/store/archive.py`). The draw is seeded by the group
id over members sorted by id, so a group rebuilt after a store restart keeps the same members.
A group of at most G members keeps them all.
"""

from __future__ import annotations

import hashlib
import random
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from trajmesh.contract import Trajectory
from trajmesh.v1 import trajectory_pb2

KEPT_POSITIVE = "roc_kept_correct"
"""Reason on the ``accepted`` row of a positive RoC drew."""
KEPT_NEGATIVE = "roc_kept_incorrect"
"""Reason on the ``accepted`` row of a negative RoC drew."""
DROPPED_POSITIVE = "roc_correct_not_drawn"
"""Reason on the ``filtered`` row of a positive RoC did not draw."""
DROPPED_NEGATIVE = "roc_incorrect_not_drawn"
"""Reason on the ``filtered`` row of a negative RoC did not draw."""
_SAMPLED_SPANS = (trajectory_pb2.TEXT, trajectory_pb2.TOOL_CALL, trajectory_pb2.CODE)


@dataclass(frozen=True)
class Scores:
    """The two selection scores of one sample (survey §5.2)."""

    tool_error: float
    format: float

    @property
    def penalty(self) -> float:
        return self.tool_error + self.format


@dataclass(frozen=True)
class Decision:
    """What RoC did with one member: kept or not, why, and its scores."""

    trajectory_id: str
    kept: bool
    reason: str
    scores: Scores


def tool_error_score(traj: Trajectory) -> float:
    """0.5 without a tool call, else the share of its calls whose status is not ``TOOL_OK``."""
    calls = traj.pb.tool_calls
    if not calls:
        return 0.5
    return sum(c.status != trajectory_pb2.TOOL_OK for c in calls) / len(calls)


def sampled_turns(traj: Trajectory) -> int:
    """Turns holding sampled tokens (by the spans; 1 when the trajectory has none)."""
    turns = {s.turn_index for s in traj.pb.spans if s.action_type in _SAMPLED_SPANS}
    return max(len(turns), 1)


def format_score(answers: int, turns: int) -> float:
    """1 without an answer tag, else min(1, (answers − 1) / turns)."""
    if answers == 0:
        return 1.0
    return min(1.0, (answers - 1) / max(turns, 1))


def scores(traj: Trajectory, sampled_text: str, answer_tag: re.Pattern[str]) -> Scores:
    """A member's scores: `sampled_text` is the decoded text of its sampled tokens."""
    return Scores(tool_error_score(traj), format_score(len(answer_tag.findall(sampled_text)), sampled_turns(traj)))


def group_rng(group_id: str) -> random.Random:
    """The draw's generator: seeded by the group id alone (a rebuilt group draws the same)."""
    return random.Random(int.from_bytes(hashlib.sha256(group_id.encode()).digest()[:8], "big"))


def split_counts(positives: int, negatives: int, keep: int) -> tuple[int, int]:
    """(positives kept, negatives kept): negatives up to ⌊keep/2⌋, positives the rest, then more
    negatives where positives ran short."""
    neg = min(negatives, keep // 2)
    pos = min(positives, keep - neg)
    return pos, min(negatives, keep - pos)


def weighted_draw(ids: Sequence[str], weights: Sequence[float], k: int, rng: random.Random) -> list[str]:
    """`k` of `ids` without replacement, each draw ∝ the weights of those left."""
    left = list(zip(ids, weights, strict=True))
    out: list[str] = []
    for _ in range(min(k, len(left))):
        x = rng.random() * sum(w for _, w in left)
        i = 0
        while i < len(left) - 1 and x >= left[i][1]:
            x -= left[i][1]
            i += 1
        out.append(left.pop(i)[0])
    return out


def select(group_id: str, members: Sequence[Trajectory], keep: int, *, correct_above: float,
           penalty_floor: float, scored: Callable[[Trajectory], Scores]) -> list[Decision]:
    """RoC's decision for each member of a complete group (the module doc), in id order."""
    by_id = sorted(members, key=lambda t: t.trajectory_id)
    s = {t.trajectory_id: scored(t) for t in by_id}
    pos = [t.trajectory_id for t in by_id if t.reward > correct_above]
    neg = [t.trajectory_id for t in by_id if t.reward <= correct_above]
    n_pos, n_neg = split_counts(len(pos), len(neg), keep)
    rng = group_rng(group_id)
    kept = set(rng.sample(neg, n_neg))
    kept |= set(weighted_draw(pos, [1.0 / (s[t].penalty + penalty_floor) for t in pos], n_pos, rng))
    positive = set(pos)
    return [Decision(t, t in kept, (KEPT_POSITIVE if t in kept else DROPPED_POSITIVE) if t in positive
                     else (KEPT_NEGATIVE if t in kept else DROPPED_NEGATIVE), s[t]) for t in s]
