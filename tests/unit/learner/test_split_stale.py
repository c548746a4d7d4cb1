"""The learner's consume-time staleness check (`split_stale`, docs/DESIGN.md §3): a trajectory is
trainable at learner version v only if every action token's lag v − u ≤ η. Hand-worked cases."""

from __future__ import annotations

from trajmesh.contract import Trajectory
from trajmesh.learner.step import split_stale
from trajmesh.v1 import trajectory_pb2


def _traj(tid: str, *segments: int | list[int], observation_between: bool = False) -> Trajectory:
    """Prompt tokens, then one sampled segment per entry (one version, or one per token)."""
    t = Trajectory.new(trajectory_id=tid)
    t.append_prompt([1, 2, 3])
    for seg in segments:
        versions = seg if isinstance(seg, list) else [seg, seg]
        t.append_sampled([5] * len(versions), [-0.5] * len(versions), versions)
        if observation_between:
            t.append_observation([9])
    t.finish(trajectory_pb2.EOS)
    return t


def _ids(trajs: list[Trajectory]) -> list[str]:
    return [t.trajectory_id for t in trajs]


def test_lag_at_the_bound_is_kept_and_one_past_it_is_stale() -> None:
    # v = 5, η = 2: versions 3 (lag 2) keep, 2 (lag 3) stale, 5 (lag 0) keep.
    trajs = [_traj("lag2", 3), _traj("lag3", 2), _traj("lag0", 5)]
    keep, stale = split_stale(trajs, version=5, eta=2)
    assert _ids(keep) == ["lag2", "lag0"]  # order of the batch is kept
    assert _ids(stale) == ["lag3"]


def test_one_stale_token_makes_the_whole_trajectory_stale() -> None:
    """Interruptible generation: a trajectory straddling a weight update carries two versions;
    the oldest decides (AReaL issue #602: admission alone does not bound every token)."""
    straddling = _traj("straddle", [1, 1, 4, 4])  # lags 3 and 0 at v = 4
    keep, stale = split_stale([straddling], version=4, eta=2)
    assert keep == [] and _ids(stale) == ["straddle"]
    keep, stale = split_stale([straddling], version=3, eta=2)  # lags 2 and −1
    assert _ids(keep) == ["straddle"] and stale == []


def test_masked_out_tokens_never_count() -> None:
    """Prompt and observation tokens carry version −1 (lag v + 1): they must not make it stale."""
    multi_turn = _traj("turns", 7, 7, observation_between=True)
    keep, stale = split_stale([multi_turn], version=7, eta=0)
    assert _ids(keep) == ["turns"] and stale == []


def test_eta_zero_is_on_policy_only() -> None:
    keep, stale = split_stale([_traj("now", 3), _traj("prev", 2)], version=3, eta=0)
    assert _ids(keep) == ["now"] and _ids(stale) == ["prev"]


def test_no_action_tokens_is_kept_and_empty_batch_is_empty() -> None:
    prompt_only = Trajectory.new(trajectory_id="empty")
    prompt_only.append_prompt([1, 2])
    keep, stale = split_stale([prompt_only], version=100, eta=0)
    assert _ids(keep) == ["empty"] and stale == []
    assert split_stale([], version=3, eta=1) == ([], [])
