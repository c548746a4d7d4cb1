"""The store's end-of-run finalization, in-process against real NATS and Redis (no other service):
when a finished run stops, every admitted trajectory gets a recorded final outcome — a member the
store holds as `in_flight_at_stop:held_at_stop`, one that never came back as
`in_flight_at_stop:not_returned` — the gate releases those groups, and a second store (the first
killed halfway) changes nothing."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from trajmesh import bus as busmod
from trajmesh.config import RunConfig, load_config
from trajmesh.contract import Trajectory
from trajmesh.infra import NatsServer, RedisServer, free_port
from trajmesh.services.store.archive import final_outcomes, read_archive
from trajmesh.services.store.service import TrajectoryStore, _Incoming
from trajmesh.v1 import trajectory_pb2

pytestmark = [pytest.mark.timeout(120)]


def _build_config(tmp_path: Path, nats: NatsServer, redis: RedisServer, model_dir: str) -> RunConfig:
    return load_config(None, {
        "run_dir": str(tmp_path / "run"), "model.path": model_dir, "tasks.group_size": 2,
        "infra.nats_url": nats.url, "infra.redis_url": redis.public_url,
        "infra.store_address": f"127.0.0.1:{free_port()}",
        "infra.security.nats_auth": False, "infra.security.redis_auth": False,
    })


def _graded(task_id: str, group_id: str, index: int) -> bytes:
    task = trajectory_pb2.Task(task_id=task_id, group_id=group_id, source="chain_sum", group_size=2)
    t = Trajectory.new(task, trajectory_id=f"{task_id}-{index}")
    t.append_prompt([1, 5, 6])
    t.append_sampled([7, 2], [-0.5, -0.1], 0)
    t.finish(trajectory_pb2.EOS)
    t.set_reward(1.0)
    return t.to_bytes()


async def _admit_and_receive_one(store: TrajectoryStore) -> None:
    """Two tasks admitted (G = 2); one member of the first comes back graded and is held."""
    repo = store.w.repo
    for task_id, gid in (("ta", "ga"), ("tb", "gb")):
        record = {"group_id": gid, "group_size": 2, "source": "chain_sum", "admitted_at_version": 0}
        assert await repo.try_admit(task_id, record, b"", 2)
    await store.w.bus.publish(busmod.SUBJECT_TRAJ_GRADED, _graded("ta", "ga", 0), msg_id="ta-0")
    msgs = await store.w.intake.fetch(batch=4, timeout=10.0)
    assert len(msgs) == 1
    data = await store.w.intake.resolve(msgs[0])
    await store._intake_run([_Incoming(data, msgs[0], Trajectory.from_bytes(data), "ta-0")])
    assert store.state.holds("ta-0")


def test_a_finished_run_records_every_admitted_trajectory(tmp_path: Path, nats_server: NatsServer,
                                                          redis_server: RedisServer, tiny_model_dir: str) -> None:
    cfg = _build_config(tmp_path, nats_server, redis_server, tiny_model_dir)

    async def main() -> None:
        store = TrajectoryStore(cfg)
        await store.setup()
        await _admit_and_receive_one(store)
        await store.w.redis.set(store.w.repo.keys.run_finished, "budget")
        await store.stop()
        again = TrajectoryStore(cfg)  # as if the first had been killed after its rows were on disk
        await again.setup()
        counters = await again.w.gate.counters()
        finals = await again.w.repo.finals(["ta-0", "ta-1", "tb-0", "tb-1"])
        due = await again.w.repo.due_groups(100)
        await again.stop()
        assert counters.running == 0 and counters.accepted == 0
        assert finals == [True] * 4 and due == set()

    asyncio.run(main())
    rows = read_archive(Path(cfg.run_dir) / "archive").to_pylist()
    final = {tid: (r["outcome"], r["reason"]) for tid, r in final_outcomes(read_archive(Path(cfg.run_dir) / "archive")).items()}
    assert final == {
        "ta-0": ("in_flight_at_stop", "held_at_stop"),
        "ta-1": ("in_flight_at_stop", "not_returned"),
        "tb-0": ("in_flight_at_stop", "not_returned"),
        "tb-1": ("in_flight_at_stop", "not_returned"),
    }
    assert len([r for r in rows if r["outcome"] == "in_flight_at_stop"]) == 4  # the second store added none


def _graded_with(task_id: str, group_id: str, index: int, reward: float) -> bytes:
    t = Trajectory.from_bytes(_graded(task_id, group_id, index))
    t.set_reward(reward)
    return t.to_bytes()


def test_a_kept_group_whose_accepted_rows_died_unflushed_is_recorded_accepted(
        tmp_path: Path, nats_server: NatsServer, redis_server: RedisServer, tiny_model_dir: str) -> None:
    """A store killed right after a group completed: the gate counted its members as accepted (Redis),
    but their `accepted` archive rows were still in the writer's buffer. The end of the run records
    that acceptance (reason `before_store_crash`) before their final outcome, so the archive agrees
    with the gate's counter (a store-kill sweep run found 48 counted against 44 rows). That outcome is
    `filtered:unused_at_end_of_run`, as the dead store would have recorded it: the group came back and
    was kept, only the learner never took it (its messages, unacked, had not come back to the new
    store yet). A held-out run with the store killed 6 s before the learner's time budget ended
    recorded such members `in_flight_at_stop`: 48, a full buffer of ready groups."""
    cfg = _build_config(tmp_path, nats_server, redis_server, tiny_model_dir)

    async def main() -> tuple[int, int]:
        store = TrajectoryStore(cfg)
        await store.setup()
        repo = store.w.repo
        record = {"group_id": "ga", "group_size": 2, "source": "chain_sum", "admitted_at_version": 0}
        assert await repo.try_admit("ta", record, b"", 2)
        for i, reward in ((0, 1.0), (1, 0.0)):  # rewards differ: the group is kept, not filtered
            await store.w.bus.publish(busmod.SUBJECT_TRAJ_GRADED, _graded_with("ta", "ga", i, reward), msg_id=f"ta-{i}")
        incoming = []
        while len(incoming) < 2:
            for msg in await store.w.intake.fetch(batch=4, timeout=10.0):
                data = await store.w.intake.resolve(msg)
                traj = Trajectory.from_bytes(data)
                incoming.append(_Incoming(data, msg, traj, traj.pb.trajectory_id))
        await store._intake_run(incoming)
        assert (await store.w.gate.counters()).accepted == 2  # the group completed and was counted
        store.w.archive._rows.clear()  # the kill: the buffered `accepted` rows never reach disk
        await store.w.grpc_server.stop(grace=0)  # and its connections go (no stop(), no finalization)
        await store.w.bus.close()
        await store.w.redis.aclose()
        again = TrajectoryStore(cfg)
        await again.setup()
        await again.w.redis.set(again.w.repo.keys.run_finished, "budget")
        await again.stop()
        check = TrajectoryStore(cfg)
        await check.setup()
        counters = await check.w.gate.counters()
        await check.stop()
        return counters.accepted, counters.running

    accepted, running = asyncio.run(main())
    rows = read_archive(Path(cfg.run_dir) / "archive").to_pylist()
    accepted_ids = {r["trajectory_id"] for r in rows if r["outcome"] == "accepted"}
    assert (accepted, running) == (2, 0)
    assert accepted_ids == {"ta-0", "ta-1"}
    assert {r["reason"] for r in rows if r["outcome"] == "accepted"} == {"before_store_crash"}
    final = {tid: (r["outcome"], r["reason"]) for tid, r in final_outcomes(read_archive(Path(cfg.run_dir) / "archive")).items()}
    assert final == {"ta-0": ("filtered", "unused_at_end_of_run"), "ta-1": ("filtered", "unused_at_end_of_run")}
