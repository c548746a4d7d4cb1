"""Poison messages on TRAJ_GRADED end as a recorded final outcome (issue 10/16), in-process against
real NATS and Redis: a graded trajectory whose message was delivered more than
`infra.max_deliveries` times (it kept crashing or stalling stores) is archived as
`quarantined:poison`, counted, marked final, and counts as an invalid member of its group, so the
group still completes and the gate releases it — also when an earlier store had recorded it as a
valid member."""

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
from trajmesh.services.store.repo import Membership
from trajmesh.services.store.service import TrajectoryStore, _Incoming
from trajmesh.v1 import trajectory_pb2

pytestmark = [pytest.mark.timeout(120)]


def _graded(task_id: str, group_id: str, index: int, reward: float) -> bytes:
    task = trajectory_pb2.Task(task_id=task_id, group_id=group_id, source="chain_sum", group_size=2)
    t = Trajectory.new(task, trajectory_id=f"{task_id}-{index}")
    t.append_prompt([1, 5, 6])
    t.append_sampled([7, 2], [-0.5, -0.1], 0)
    t.finish(trajectory_pb2.EOS)
    t.set_reward(reward)
    return t.to_bytes()


def _count(outcome: str, reason: str) -> float:
    return REGISTRY.get_sample_value("trajmesh_store_trajectories_total",
                                     {"outcome": outcome, "reason": reason}) or 0.0


def test_a_poison_member_is_archived_final_and_its_group_completes(
        tmp_path: Path, nats_server: NatsServer, redis_server: RedisServer, tiny_model_dir: str) -> None:
    cfg = load_config(None, {
        "run_dir": str(tmp_path / "run"), "model.path": tiny_model_dir, "tasks.group_size": 2,
        "infra.nats_url": nats_server.url, "infra.redis_url": redis_server.public_url,
        "infra.store_address": f"127.0.0.1:{free_port()}", "infra.max_deliveries": 1,
        "store.intake_ack_wait_s": 1.0, "infra.security.nats_auth": False, "infra.security.redis_auth": False,
    })
    poison_before = _count("quarantined", "poison")

    async def main() -> tuple[int, int, list[bool], int]:
        store = TrajectoryStore(cfg)
        await store.setup()
        repo = store.w.repo
        record = {"group_id": "ga", "group_size": 2, "source": "chain_sum", "admitted_at_version": 0}
        assert await repo.try_admit("ta", record, b"", 2)
        # An earlier store took ta-0 in as a valid member and died holding it.
        await repo.record_members([Membership("ga", "ta-0", True)])
        await store.w.bus.publish(busmod.SUBJECT_TRAJ_GRADED, _graded("ta", "ga", 0, 1.0), msg_id="ta-0")
        [first] = await store.w.intake.fetch(batch=1, timeout=10.0)
        assert first.metadata.num_delivered == 1  # taken, never acked: comes back after the ack wait
        again: list[object] = []
        while not again:  # the redelivery is the second delivery (> max_deliveries = 1): poison
            again = await store.w.intake.fetch(batch=1, timeout=5.0)
            if _count("quarantined", "poison") > poison_before:
                break
        assert not again, "a poison message was handed out"
        # The other member comes back valid: the group completes (one valid member: too small).
        await store.w.bus.publish(busmod.SUBJECT_TRAJ_GRADED, _graded("ta", "ga", 1, 0.0), msg_id="ta-1")
        [second] = await store.w.intake.fetch(batch=1, timeout=10.0)
        data = await store.w.intake.resolve(second)
        await store._intake_run([_Incoming(data, second, Trajectory.from_bytes(data), "ta-1")])
        await store._commit_final()
        counters = await store.w.gate.counters()
        finals = await repo.finals(["ta-0", "ta-1"])
        pending = await store.w.intake.pending()
        await store.stop()
        return counters.running, counters.accepted, finals, pending.num_ack_pending

    running, accepted, finals, ack_pending = asyncio.run(main())
    assert (running, accepted) == (0, 0)  # the group was released, nothing accepted
    assert finals == [True, True]
    assert ack_pending == 0  # the poison message was terminated, the other acked
    assert _count("quarantined", "poison") == poison_before + 1
    final = {tid: (r["outcome"], r["reason"])
             for tid, r in final_outcomes(read_archive(Path(cfg.run_dir) / "archive")).items()}
    assert final == {"ta-0": ("quarantined", "poison"), "ta-1": ("filtered", "group_too_small")}
