"""GRPO-RoC across a store crash, in-process against real NATS and Redis (no other service): a
group RoC decided keeps the same samples when a new store rebuilds it, and the gate counts the
group once. Killed after the decision committed (the dropped samples acked and final), the new store
gets the kept ones back by redelivery and the group completes with them alone; killed before the
commit, every sample comes back and the draw (seeded by the group id) drops the same ones again."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from trajmesh import bus as busmod
from trajmesh.config import RunConfig, load_config
from trajmesh.contract import Trajectory
from trajmesh.infra import NatsServer, RedisServer, free_port
from trajmesh.services.store.archive import read_archive
from trajmesh.services.store.service import TrajectoryStore, _Incoming
from trajmesh.services.store.state import TrajectoryState
from trajmesh.v1 import trajectory_pb2

pytestmark = [pytest.mark.timeout(120)]

REWARDS = (1.0, 1.0, 0.0, 0.0)
"""The 4 samples (G = 2, oversample 2): 2 correct, 2 incorrect; RoC keeps one of each."""


def _build_config(tmp_path: Path, nats: NatsServer, redis: RedisServer, model_dir: str) -> RunConfig:
    return load_config(None, {
        "run_dir": str(tmp_path / "run"), "model.path": model_dir, "tasks.group_size": 2,
        "store.resample_on_correct.enabled": True, "store.intake_ack_wait_s": 1.0,
        "infra.nats_url": nats.url, "infra.redis_url": redis.public_url,
        "infra.store_address": f"127.0.0.1:{free_port()}",
        "infra.security.nats_auth": False, "infra.security.redis_auth": False,
    })


def _graded(index: int, reward: float) -> bytes:
    task = trajectory_pb2.Task(task_id="ta", group_id="ga", source="chain_sum", group_size=4)
    t = Trajectory.new(task, trajectory_id=f"ta-{index}")
    t.append_prompt([1, 5, 6])
    t.append_sampled([7, 2], [-0.5, -0.1], 0)
    t.finish(trajectory_pb2.EOS)
    t.set_reward(reward)
    return t.to_bytes()


async def _take(store: TrajectoryStore, n: int) -> None:
    """Fetch `n` TRAJ_GRADED messages (redeliveries included) and run them through intake."""
    incoming: list[_Incoming] = []
    while len(incoming) < n:
        for msg in await store.w.intake.fetch(batch=8, timeout=10.0):
            data = await store.w.intake.resolve(msg)
            traj = Trajectory.from_bytes(data)
            incoming.append(_Incoming(data, msg, traj, traj.pb.trajectory_id))
    await store._intake_run(incoming)


def _ready(store: TrajectoryStore) -> set[str]:
    return {tid for tid, rec in store.state.records.items() if rec.state is TrajectoryState.READY}


async def _kill(store: TrajectoryStore) -> None:
    """As a SIGKILL leaves it: connections gone, nothing stopped or finalized."""
    await store.w.grpc_server.stop(grace=0)
    await store.w.bus.close()
    await store.w.redis.aclose()


@pytest.mark.parametrize("committed", [True, False], ids=["killed-after-commit", "killed-before-commit"])
def test_a_rebuilt_group_keeps_what_roc_kept(tmp_path: Path, nats_server: NatsServer, redis_server: RedisServer,
                                            tiny_model_dir: str, committed: bool) -> None:
    cfg = _build_config(tmp_path, nats_server, redis_server, tiny_model_dir)
    assert cfg.admitted_group_size == 4

    async def main() -> tuple[set[str], set[str], tuple[int, int]]:
        store = TrajectoryStore(cfg)
        await store.setup()
        record = {"group_id": "ga", "group_size": 4, "source": "chain_sum", "admitted_at_version": 0}
        assert await store.w.repo.try_admit("ta", record, b"", 4)
        for i, reward in enumerate(REWARDS):
            await store.w.bus.publish(busmod.SUBJECT_TRAJ_GRADED, _graded(i, reward), msg_id=f"ta-{i}")
        await _take(store, 4)
        kept_first = _ready(store)
        assert len(kept_first) == 2
        if committed:
            await store._commit_final()  # the dropped samples' rows on disk, marked final, acked
        await _kill(store)
        again = TrajectoryStore(cfg)
        await again.setup()
        await _take(again, 2 if committed else 4)  # redelivered after the 1 s ack wait
        kept_again = _ready(again)
        c = await again.w.gate.counters()
        await again._commit_final()
        await again.w.grpc_server.stop(grace=0)
        await again.w.bus.close()
        await again.w.redis.aclose()
        return kept_first, kept_again, (c.accepted, c.running)

    kept_first, kept_again, (accepted, running) = asyncio.run(main())
    assert kept_again == kept_first
    assert {int(t[-1]) for t in kept_first if REWARDS[int(t[-1])] > 0.5} and \
        {int(t[-1]) for t in kept_first if REWARDS[int(t[-1])] <= 0.5}  # one of each side
    assert (accepted, running) == (2, 0)  # the group counted once: 2 kept, the other 2 freed
    rows = read_archive(Path(cfg.run_dir) / "archive").to_pylist()
    dropped = {r["trajectory_id"] for r in rows if r["outcome"] == "filtered"}
    assert dropped == {f"ta-{i}" for i in range(4)} - kept_first
    assert all(r["reason"].startswith("roc_") and r["reason"].endswith("_not_drawn")
               for r in rows if r["outcome"] == "filtered")
