"""Difficulty curriculum and the mixture sampler (trajmesh/tasks.py), with hand-computed values.

The sources are the demo's real chain_sum generator (10 training tasks each); profiles are written
by hand: each task's (passes, samples) is chosen here, so each expected bucket, kept set and share
below is worked out from those numbers, not from the sampler.
"""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

from trajmesh.config import ConfigError, load_config
from trajmesh.tasks import MixtureTracker, TaskSampler, bucket, profile_key, read_profile

N_DRAWS = 20000
"""Draws per sampling check. A share p estimated from N draws has standard deviation
sqrt(p(1-p)/N) <= 0.0036; the stated bound SHARE_BOUND is over 5 of them."""
SHARE_BOUND = 0.02


def _cfg(tmp_path: Path, curriculum: dict[str, Any] | None = None, **tasks: Any) -> Any:
    src: dict[str, Any] = {"type": "reasoning_gym", "name": "cs", "family": "chain_sum"}
    if curriculum is not None:
        src["curriculum"] = curriculum
    over = {"tasks.train_size": 10, "tasks.heldout_size": 4, "tasks.sources": [src]}
    over.update({f"tasks.{k}": v for k, v in tasks.items()})
    return load_config(None, over).tasks


def _ids(tmp_path: Path) -> list[str]:
    return [t.task_id for t in TaskSampler(_cfg(tmp_path), seed=0).train[0]]


def _write(path: Path, counts: dict[str, tuple[int, int]]) -> str:
    path.write_text(json.dumps({"tasks": {profile_key("cs", t): {"passes": n, "samples": m}
                                          for t, (n, m) in counts.items()}}))
    return str(path)


def _draw_ids(sampler: TaskSampler, n: int = N_DRAWS) -> Counter[str]:
    return Counter(sampler.task_at(i).task_id for i in range(n))


def test_pass_rate_buckets() -> None:
    band = (0.25, 0.75)
    assert [bucket(r, band) for r in (0.0, 1 / 8, 0.25, 0.5, 0.75, 7 / 8, 1.0)] == [
        "all_fail", "below_band", "in_band", "in_band", "in_band", "above_band", "all_pass"]
    assert [bucket(r, None) for r in (0.0, 0.1, 0.9, 1.0)] == ["all_fail", "in_band", "in_band", "all_pass"]


def test_all_pass_and_all_fail_tasks_are_dropped(tmp_path: Path) -> None:
    ids = _ids(tmp_path)
    # 3 tasks all pass (8/8), 3 all fail (0/8), 3 in between; the last one is not profiled.
    counts = {**{t: (8, 8) for t in ids[:3]}, **{t: (0, 8) for t in ids[3:6]},
              ids[6]: (1, 8), ids[7]: (4, 8), ids[8]: (7, 8)}
    profile = _write(tmp_path / "p.json", counts)
    both = TaskSampler(_cfg(tmp_path, {"drop": ["all_pass", "all_fail"]}, profile=profile), seed=0)
    assert {t.task_id for t in both.kept(0)} == set(ids[6:])
    assert set(_draw_ids(both, 2000)) == set(ids[6:])
    only_fail = TaskSampler(_cfg(tmp_path, {"drop": ["all_fail"]}, profile=profile), seed=0)
    assert {t.task_id for t in only_fail.kept(0)} == set(ids[:3]) | set(ids[6:])
    # without a curriculum the profile changes nothing: every task is drawn
    assert set(_draw_ids(TaskSampler(_cfg(tmp_path, profile=profile), seed=0), 2000)) == set(ids)


def test_a_curriculum_that_drops_every_task_is_refused(tmp_path: Path) -> None:
    profile = _write(tmp_path / "p.json", {t: (0, 4) for t in _ids(tmp_path)})
    with pytest.raises(ValueError, match="leaves no task"):
        TaskSampler(_cfg(tmp_path, {"drop": ["all_fail"]}, profile=profile), seed=0)


def test_target_band_sampling_share_and_mean_pass_rate(tmp_path: Path) -> None:
    ids = _ids(tmp_path)
    # 2 tasks in the band [0.25, 0.75] (pass rate 1/2), 8 below it (1/8); outside weight 0.1:
    # in-band share = 2 / (2 + 8 * 0.1) = 0.7143; mean pass rate of the draws
    # = 0.7143 * 0.5 + 0.2857 * 0.125 = 0.3929 (uniform: (2 * 0.5 + 8 * 0.125) / 10 = 0.2).
    counts = {**{t: (4, 8) for t in ids[:2]}, **{t: (1, 8) for t in ids[2:]}}
    profile = _write(tmp_path / "p.json", counts)
    sampler = TaskSampler(_cfg(tmp_path, {"target_band": [0.25, 0.75], "outside_band_weight": 0.1},
                               profile=profile), seed=0)
    drawn = _draw_ids(sampler)
    in_band = sum(drawn[t] for t in ids[:2]) / N_DRAWS
    assert abs(in_band - 2 / 2.8) < SHARE_BOUND, in_band
    mean = sum(drawn[t] * counts[t][0] / counts[t][1] for t in drawn) / N_DRAWS
    assert abs(mean - (2 / 2.8 * 0.5 + 0.8 / 2.8 * 0.125)) < SHARE_BOUND, mean
    assert set(drawn) == set(ids)  # outside the band is rarer, not gone


def test_the_mixture_matches_its_weights_within_the_bound(tmp_path: Path) -> None:
    cfg = load_config(None, {"tasks.train_size": 10, "tasks.heldout_size": 4, "tasks.sources": [
        {"type": "reasoning_gym", "name": "a", "family": "chain_sum", "weight": 1.0},
        {"type": "reasoning_gym", "name": "b", "family": "chain_sum", "weight": 3.0}]}).tasks
    sampler, tracker = TaskSampler(cfg, seed=0), MixtureTracker(cfg.sources)
    for i in range(N_DRAWS):
        tracker.admit(sampler.task_at(i).source)
    assert tracker.weight_share == {"a": 0.25, "b": 0.75}
    share = tracker.admitted_share()
    assert abs(share["a"] - 0.25) < SHARE_BOUND and abs(share["b"] - 0.75) < SHARE_BOUND, share
    assert tracker.drift() < SHARE_BOUND


def test_mixture_drift_hand_values() -> None:
    cfg = load_config(None, {"tasks.sources": [
        {"type": "reasoning_gym", "name": "a", "family": "chain_sum", "weight": 1.0},
        {"type": "reasoning_gym", "name": "b", "family": "chain_sum", "weight": 3.0}]}).tasks
    tracker = MixtureTracker(cfg.sources)
    assert tracker.drift() == 0.75  # nothing admitted yet: share 0 against 0.75
    for source in ("a", "a", "b"):
        tracker.admit(source)
    assert tracker.admitted_share() == {"a": 2 / 3, "b": 1 / 3}
    assert tracker.drift() == pytest.approx(2 / 3 - 0.25)


def test_reprofiling_from_run_outcomes(tmp_path: Path) -> None:
    ids = _ids(tmp_path)
    profile = _write(tmp_path / "start.json", {t: (4, 8) for t in ids})  # every task in between at start
    out = tmp_path / "run" / "task_profile.json"
    cfg = _cfg(tmp_path, {"drop": ["all_pass"]}, profile=profile, reprofile_every_versions=2,
               reprofile_min_samples=3)
    sampler = TaskSampler(cfg, seed=0, profile_out=out)
    assert len(sampler.kept(0)) == 10
    for reward in (1.0, 1.0, 1.0):  # ids[0] now passes 3/3
        sampler.observe("cs", ids[0], reward)
    for reward in (1.0, 1.0):  # ids[1]: 2 outcomes, below reprofile_min_samples
        sampler.observe("cs", ids[1], reward)
    for reward in (0.5, 0.5, 0.5):  # ids[2]: partial credit is below profile_pass_reward 1.0, not a pass
        sampler.observe("cs", ids[2], reward)
    assert not sampler.maybe_reprofile(1)  # not yet a multiple of 2 versions
    assert sampler.maybe_reprofile(2)
    assert {t.task_id for t in sampler.kept(0)} == set(ids[1:])
    assert read_profile(out)[profile_key("cs", ids[0])] == (3, 3)
    assert read_profile(out)[profile_key("cs", ids[1])] == (4, 8)  # kept its starting profile
    assert read_profile(out)[profile_key("cs", ids[2])] == (0, 3)  # all fail now, but only all_pass drops
    assert not sampler.maybe_reprofile(3)
    # a restarted store reloads the profile in effect from the run dir
    assert {t.task_id for t in TaskSampler(cfg, seed=0, profile_out=out).kept(0)} == set(ids[1:])


def test_a_band_outside_0_1_is_rejected(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="target_band"):
        _cfg(tmp_path, {"target_band": [0.8, 0.2]})
