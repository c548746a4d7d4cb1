"""Work sampled with a version the learner published just before it died is kept, not discarded.

In-process, against real NATS and Redis: a real store (its gRPC server and intake) and two real
learner processes' services, one after the other, sharing a run directory.

1. The learner checkpoints at v0, takes a batch from the store, trains it and publishes v1; it is
   killed the instant its announcement of v1 is out (nothing after that runs: no Report).
2. A rollout samples a group with the announced weights (v1) and the store takes it in. It must not
   be quarantined `version_from_future`: the learner that comes back replays towards v1 (the
   replay is bitwise), so the group waits in the store for it.
3. The learner restarts from its v0 checkpoint, replays the saved batch to v1 (reproducing the
   announced weights bit for bit), then takes the waiting group and trains it at v1.

Every admitted trajectory ends trained exactly once, with lag 0, and the gate releases everything.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest
from store_checks import admit_and_take, store_config

from trajmesh import bus as busmod
from trajmesh.infra import NatsServer, RedisServer
from trajmesh.services.store.archive import final_outcomes, read_archive
from trajmesh.services.store.service import TrajectoryStore
from trajmesh.v1 import trajectory_pb2
from trajmesh.weights import announce

pytestmark = [pytest.mark.timeout(300)]

G = 2
CONFIG = {"tasks.group_size": G, "learner.batch_groups": 1, "gate.eta": 2, "learner.max_steps": 2,
          "learner.checkpoint_every": 20, "learner.engine.type": "torch",
          "learner.consistency_probe_trajectories": 0}


class _Killed(BaseException):
    """The learner process died here (a BaseException: no handler of the service catches it)."""


def _watch_announcements(learner: Any, seen: list[trajectory_pb2.WeightsAnnouncement],
                         kill_after: int | None = None) -> None:
    """Record the learner's announcements (its messages on WEIGHTS); with `kill_after`, the process
    dies right after it announced that version."""
    publish: Callable[..., Awaitable[Any]] = learner.bus.publish

    async def publish_watched(subject: str, data: bytes, **kw: Any) -> Any:
        ack = await publish(subject, data, **kw)
        if subject == busmod.SUBJECT_WEIGHTS:
            ann = trajectory_pb2.WeightsAnnouncement.FromString(data)
            seen.append(ann)
            if kill_after is not None and ann.version >= kill_after:
                raise _Killed
        return ack

    learner.bus.publish = publish_watched


def test_work_sampled_with_a_version_the_replay_reaches_is_trained(
        tmp_path: Path, nats_server: NatsServer, redis_server: RedisServer, tiny_model_dir: str) -> None:
    from trajmesh.services.learner import LearnerService

    cfg = store_config(tmp_path, nats_server, redis_server, tiny_model_dir, **CONFIG)
    before: list[trajectory_pb2.WeightsAnnouncement] = []
    after: list[trajectory_pb2.WeightsAnnouncement] = []

    async def main() -> dict[str, Any]:
        store = TrajectoryStore(cfg)
        await store.setup()
        # 1. The learner before the crash.
        learner = LearnerService(cfg)
        await learner.setup()
        await learner._checkpoint_async()  # the checkpoint the restart resumes from (v0)
        await admit_and_take(store, "ta", [0.0, 1.0], sampled_with=0)
        _watch_announcements(learner, before, kill_after=1)
        with pytest.raises(_Killed):
            await learner.run()
        await learner.store.close()  # the kill: its connections go, nothing else runs
        await learner.bus.close()
        await learner.redis.aclose()
        announced = await announce.latest(store.w.bus)
        assert announced is not None
        # 2. A rollout samples with the announced weights; the store keeps the group for the learner.
        tb = await admit_and_take(store, "tb", [0.0, 1.0], sampled_with=announced.version)
        held = [store.state.holds(f"{tb}-{i}") for i in range(G)]
        ready = [g.group_id for g in store.state.ready]
        if held != [True] * G:  # discarded: no learner would ever train it (fail now, not at a timeout)
            await store.stop()
            return {"held": held, "ready": ready}
        # 3. The learner comes back from v0, replays to v1 and trains the waiting group.
        again = LearnerService(cfg)
        await again.setup()
        _watch_announcements(again, after)
        resumed_from = again.version
        await again.run()
        await again.stop()
        await store.stop()  # the learner finished its budget: the store finalizes the run
        check = TrajectoryStore(cfg)
        await check.setup()
        counters = await check.w.gate.counters()
        admitted = int(await check.w.redis.get(check.w.repo.keys.admitted_trajectories) or 0)
        await check.stop()
        return {"announced": announced.version, "held": held, "ready": ready, "resumed_from": resumed_from,
                "final_version": again.version, "counters": counters, "admitted": admitted}

    out = asyncio.run(main())
    assert out["held"] == [True] * G and out["ready"] == ["g1-tb"], \
        "the group sampled with the announced version was not kept for the replaying learner"
    assert out["announced"] == 1 and out["resumed_from"] == 0 and out["final_version"] == 2
    rows = read_archive(Path(cfg.run_dir) / "archive").to_pylist()
    assert not [r for r in rows if "version_from_future" in (r["reason"] or "")]
    final = {tid: (r["outcome"], r["learner_version"]) for tid, r in
             final_outcomes(read_archive(Path(cfg.run_dir) / "archive")).items()}
    # ta trained at v0 (reported by the replay), tb at v1 = the version it was sampled with.
    assert final == {"ta-c0-0": ("trained", 0), "ta-c0-1": ("trained", 0),
                     "tb-c1-0": ("trained", 1), "tb-c1-1": ("trained", 1)}
    assert len([r for r in rows if r["outcome"] == "trained"]) == 2 * G  # each trained once
    counters = out["counters"]
    assert out["admitted"] == 2 * G and counters.running == 0 and counters.accepted == 2 * G
    # The replay reproduced the weights the dead learner had announced, bit for bit.
    v1_before = [a.sha256 for a in before if a.version == 1]
    v1_after = [a.sha256 for a in after if a.version == 1]
    assert v1_before and v1_after and v1_before == v1_after
