"""Members that reach the store already too stale to train are cut at intake (issue 16), in-process
against real NATS and Redis: with the learner at version v and bound η, a graded member whose
oldest sampled token is older than v − η could only be quarantined as stale by the learner; the
store records it as `filtered:stale_on_arrival` (archived, counted, final), its group completes
without it, and nothing of it is handed to the learner; one the rollout cut short (terminal STALE)
is `filtered:stale_cut_short`. Fresh members of the same group are kept."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
from prometheus_client import REGISTRY

from trajmesh import bus as busmod
from trajmesh.config import load_config
from trajmesh.contract import Trajectory
from trajmesh.infra import NatsServer, RedisServer, free_port
from trajmesh.services.store.archive import final_outcomes, read_archive
from trajmesh.services.store.service import TrajectoryStore, _Incoming
from trajmesh.v1 import trajectory_pb2

pytestmark = [pytest.mark.timeout(120)]

ETA = 1
LEARNER_VERSION = 5


def _graded(index: int, sampled_at: list[int], reward: float,
            end: trajectory_pb2.TerminalReason = trajectory_pb2.EOS) -> bytes:
    task = trajectory_pb2.Task(task_id="ta", group_id="ga", source="chain_sum", group_size=4)
    t = Trajectory.new(task, trajectory_id=f"ta-{index}")
    t.append_prompt([1, 5, 6])
    for v in sampled_at:  # one token per version: a generation that spanned weight updates
        t.append_sampled([7], [-0.5], v)
    t.finish(end)
    t.set_reward(reward)
    return t.to_bytes()


def _cut_count() -> float:
    return REGISTRY.get_sample_value("trajmesh_store_trajectories_total",
                                     {"outcome": "filtered", "reason": "stale_on_arrival"}) or 0.0


def test_a_member_too_stale_to_train_is_cut_on_arrival(tmp_path: Path, nats_server: NatsServer,
                                                       redis_server: RedisServer, tiny_model_dir: str) -> None:
    cfg = load_config(None, {
        "run_dir": str(tmp_path / "run"), "model.path": tiny_model_dir, "tasks.group_size": 4, "gate.eta": ETA,
        "learner.batch_groups": 1, "infra.nats_url": nats_server.url, "infra.redis_url": redis_server.public_url,
        "infra.store_address": f"127.0.0.1:{free_port()}",
        "infra.security.nats_auth": False, "infra.security.redis_auth": False,
    })
    cut_before = _cut_count()
    # The learner at v5 trains tokens of v >= 4 only: ta-0 is fresh, ta-1 straddles the bound (its
    # oldest token, v3, decides: cut), ta-2 was sampled at v4 (lag 1 = eta: kept); the rollout cut
    # ta-3 short (terminal STALE: its weights had moved on) — recorded as such, whatever its versions.
    members = {0: [5, 5], 1: [3, 4], 2: [4, 4], 3: [5]}

    async def main() -> list[str]:
        store = TrajectoryStore(cfg)
        await store.setup()
        record = {"group_id": "ga", "group_size": 4, "source": "chain_sum", "admitted_at_version": 3}
        assert await store.w.repo.try_admit("ta", record, b"", 4)
        await store.w.gate.set_version(LEARNER_VERSION)
        for i, versions in members.items():
            end = trajectory_pb2.STALE if i == 3 else trajectory_pb2.EOS
            await store.w.bus.publish(busmod.SUBJECT_TRAJ_GRADED, _graded(i, versions, float(i), end), msg_id=f"ta-{i}")
        msgs: list[object] = []
        while len(msgs) < len(members):
            msgs += await store.w.intake.fetch(batch=len(members), timeout=10.0)
        items = []
        for msg in msgs:
            data = await store.w.intake.resolve(msg)
            peek = Trajectory.from_bytes(data)
            items.append(_Incoming(data, msg, peek, peek.trajectory_id))
        await store._intake_run(items)
        handed = await store.next_batch(LEARNER_VERSION, 16, timeout_s=10.0)
        await store._commit_final()
        await store.stop()
        return sorted(t.trajectory_id for t in handed)

    handed = asyncio.run(main())
    assert handed == ["ta-0", "ta-2"]
    assert _cut_count() == cut_before + 1
    final = {tid: (r["outcome"], r["reason"])
             for tid, r in final_outcomes(read_archive(Path(cfg.run_dir) / "archive")).items()}
    assert final["ta-1"] == ("filtered", "stale_on_arrival")
    assert final["ta-3"] == ("filtered", "stale_cut_short")
    assert final["ta-0"] == final["ta-2"] == ("accepted", "")
