"""Infra failures refill the sample, not the group (issue 41 item 4).

Three levels: the pure state machine (a group with a refill completes at G + refills members),
the refill's atomic gate step against a real redis-server (capacity unchanged, `admitted` + 1,
idempotent, bounded, refused once the run is finished, and seen by the end of a run), and the
store itself against real NATS and Redis: a member that ends INFRA_FAILURE is archived
`failed_infra:infra_environment`, a refill of its task appears on TASKS, and the group completes
with G valid members once the refill is back.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
import redis.asyncio
from store_checks import store_config

from trajmesh import bus as busmod
from trajmesh.contract import Trajectory
from trajmesh.gate import AsyncStalenessGate
from trajmesh.infra import NatsServer, RedisServer
from trajmesh.services.store.archive import final_outcomes, read_archive
from trajmesh.services.store.intake import judge
from trajmesh.services.store.keys import RedisKeys
from trajmesh.services.store.repo import StoreRepo
from trajmesh.services.store.service import TrajectoryStore, _Incoming
from trajmesh.services.store.state import StoreState, TrajectoryState
from trajmesh.v1 import trajectory_pb2

pytestmark = [pytest.mark.timeout(120)]

G = 3


def _traj(tid: str, gid: str, reward: float = 1.0) -> Trajectory:
    t = Trajectory.new(trajectory_id=tid)
    t.pb.task_id, t.pb.group_id = f"task-{gid}", gid
    t.append_prompt([1, 2])
    t.append_sampled([3], [-0.5], 0)
    t.finish(trajectory_pb2.EOS)
    t.set_reward(reward)
    return t


def _take(s: StoreState, tid: str, received: int, valid_count: int, *, refills: int, valid: bool = True):  # type: ignore[no-untyped-def]
    return s.take_member(_traj(tid, "a"), f"msg-{tid}", valid=valid, expected=G, order=0, source="src",
                         received=received, valid_count=valid_count, refills=refills)


# ---------------------------------------------------------------------------------------------- state
def test_a_group_with_a_refill_completes_at_g_plus_one_with_g_valid_members() -> None:
    s = StoreState()
    assert _take(s, "a-0", 1, 1, refills=0) is None
    assert _take(s, "a-1", 2, 1, refills=1, valid=False) is None  # infra-failed; its refill admitted
    assert _take(s, "a-2", 3, 2, refills=1) is None, "completed at G received, without the refill"
    group = _take(s, "a-3", 4, 3, refills=1)  # the refill (sample index G)
    assert group is not None
    assert [t.trajectory_id for t in group.members] == ["a-0", "a-2", "a-3"]
    s.make_ready(group, now=0.0)
    assert all(s.state(t) is TrajectoryState.READY for t in ("a-0", "a-2", "a-3"))


def test_a_groups_refills_never_go_back_down() -> None:
    """A member looked up before the refill was admitted (same intake run) reports fewer refills:
    the group keeps waiting for the refill."""
    s = StoreState()
    _take(s, "a-0", 1, 0, refills=1, valid=False)
    _take(s, "a-1", 2, 1, refills=0)
    assert _take(s, "a-2", 3, 2, refills=0) is None
    assert _take(s, "a-3", 4, 3, refills=0) is not None


def test_without_a_refill_the_group_completes_at_g_with_the_rest() -> None:
    """Today's rule past the cap: G received, G − 1 valid."""
    s = StoreState()
    _take(s, "a-0", 1, 0, refills=0, valid=False)
    _take(s, "a-1", 2, 1, refills=0)
    group = _take(s, "a-2", 3, 2, refills=0)
    assert group is not None and len(group.members) == G - 1


# ---------------------------------------------------------------------------------------------- contract
def test_the_infra_cause_is_the_failed_infra_reason_and_an_old_record_still_reads() -> None:
    task = {"group_id": "a", "group_size": G}
    for cause, reason in ((trajectory_pb2.INFRA_ENVIRONMENT, "infra_environment"),
                          (trajectory_pb2.INFRA_DEADLINE, "infra_deadline"),
                          (trajectory_pb2.INFRA_GRADER, "infra_grader")):
        t = _traj("task-a-0", "a")
        t.fail_infra(cause)
        assert t.terminal_reason == trajectory_pb2.INFRA_FAILURE
        verdict = judge(t.to_bytes(), task, vocab_size=10, learner_version=0)
        assert (verdict.outcome, verdict.reason, verdict.member) == ("failed_infra", reason, True)
    old = _traj("task-a-0", "a")  # written before infra_cause: INFRA_FAILURE alone
    old.finish(trajectory_pb2.INFRA_FAILURE)
    verdict = judge(old.to_bytes(), task, vocab_size=10, learner_version=0)
    assert (verdict.outcome, verdict.reason) == ("failed_infra", "infra_failure")


# ---------------------------------------------------------------------------------------------- repo + gate
KEYS = RedisKeys("t")


def test_a_refill_takes_the_failed_members_slot_once_up_to_the_cap(redis_server: RedisServer) -> None:
    async def main() -> None:
        r = redis.asyncio.Redis.from_url(redis_server.url)
        try:
            gate = AsyncStalenessGate(r, key_prefix=KEYS.gate_prefix, eta=0, batch_size=G)
            repo = StoreRepo(r, KEYS, gate)
            record = {"group_id": "ga", "group_size": G, "source": "s", "admitted_at_version": 0, "cursor": 0}
            assert await repo.try_admit("ta", record, b"task", G)
            assert (await gate.counters()).running == G and await gate.capacity() == 0  # a full gate

            assert await repo.refill("ga", "ta-1", G, "ta-refill3", b"r1", cap=2) == (1, 1)
            c = await gate.counters()
            assert (c.running, await gate.capacity()) == (G, 0), "capacity must not change"
            assert int(await r.get(KEYS.admitted_trajectories)) == G + 1
            assert int(await r.get(KEYS.refills_admitted)) == 1
            assert await repo.unpublished() == {"ta": b"task", "ta-refill3": b"r1"}
            # A redelivered failed member: nothing admitted twice.
            assert await repo.refill("ga", "ta-1", G, "ta-refill3", b"r1", cap=2) == (0, 1)
            assert int(await r.get(KEYS.admitted_trajectories)) == G + 1
            assert (await repo.lookup([("ta", "ta-0")], ["ga"]))[1][0].refills == 1
            # The end of a run knows the refill's id (it never came back: no final outcome).
            assert {m.trajectory_id for m in await repo.unfinished_members()} == {"ta-0", "ta-1", "ta-2", "ta-3"}
            # The cap.
            assert await repo.refill("ga", "ta-3", G + 1, "ta-refill4", b"r2", cap=2) == (1, 2)
            assert await repo.refill("ga", "ta-4", G + 2, "ta-refill5", b"r3", cap=2) == (-2, 2)
            assert int(await r.get(KEYS.admitted_trajectories)) == G + 2
            # A finished run admits no refill.
            assert await repo.try_admit("tb", {**record, "group_id": "gb", "cursor": 1}, b"", 1) is False  # full
            await r.set(KEYS.run_finished, "budget")
            assert await repo.refill("gb", "tb-0", G, "tb-refill3", b"r", cap=2) == (-1, 0)
            # A settled group's refills go with it.
            await repo.cleanup(["ga"], ["ga"])
            assert not await r.exists(KEYS.group_refills("ga"))
        finally:
            await r.aclose()
    asyncio.run(main())


# ---------------------------------------------------------------------------------------------- the store
def _member(task: trajectory_pb2.Task, index: int, reward: float, *, infra: bool = False) -> bytes:
    t = Trajectory.new(task, trajectory_id=f"{task.task_id}-{index}")
    t.append_prompt([1, 5, 6])
    if infra:  # the environment failed mid-episode
        t.fail_infra(trajectory_pb2.INFRA_ENVIRONMENT)
        return t.to_bytes()
    t.append_sampled([7, 2 + index], [-0.5, -0.1], 0)
    t.finish(trajectory_pb2.EOS)
    t.set_reward(reward)
    return t.to_bytes()


def _store_config(tmp_path: Path, nats: NatsServer, redis_server: RedisServer, model_dir: str, **over: object):  # type: ignore[no-untyped-def]
    return store_config(tmp_path, nats, redis_server, model_dir, **{
        "tasks.group_size": G, "learner.batch_groups": 1, "gate.eta": 0, **over})


async def _take_all(store: TrajectoryStore, datas: list[bytes]) -> None:
    for data in datas:
        t = Trajectory.from_bytes(data)
        await store.w.bus.publish(busmod.SUBJECT_TRAJ_GRADED, data, msg_id=t.trajectory_id)
    incoming: list[_Incoming] = []
    while len(incoming) < len(datas):
        for msg in await store.w.intake.fetch(batch=len(datas), timeout=10.0):
            data = await store.w.intake.resolve(msg)
            incoming.append(_Incoming(data, msg, Trajectory.from_bytes(data), Trajectory.from_bytes(data).trajectory_id))
    await store._intake_run(incoming)
    await store._commit_final()


@pytest.mark.parametrize("cap", [1, 0])
def test_an_infra_failed_member_is_refilled_and_its_group_keeps_g(
        tmp_path: Path, nats_server: NatsServer, redis_server: RedisServer, tiny_model_dir: str, cap: int) -> None:
    """cap 1: the refill goes out on TASKS and the group is ready with G members; cap 0 (off): the
    group completes at G received with G − 1."""
    cfg = _store_config(tmp_path, nats_server, redis_server, tiny_model_dir, **{"store.infra_refills_per_group": cap})

    async def main() -> None:
        store = TrajectoryStore(cfg)
        await store.setup()
        try:
            tasks = await store.w.bus.pull_subscribe(busmod.STREAM_TASKS, "rollout", ack_wait_s=30.0)
            assert await store._publish_next_task(0)
            [msg] = await tasks.fetch(batch=1, timeout=10.0)
            task = trajectory_pb2.Task.FromString(await tasks.resolve(msg))
            assert (task.group_size, task.first_sample, task.refill_of) == (G, 0, "")
            await _take_all(store, [_member(task, 0, 1.0), _member(task, 1, 0.0, infra=True), _member(task, 2, 0.0)])
            failed = f"{task.task_id}-1"
            rows = final_outcomes(read_archive(Path(cfg.run_dir) / "archive"))
            assert (rows[failed]["outcome"], rows[failed]["reason"]) == ("failed_infra", "infra_environment")
            admitted = int(await store.w.redis.get(store.w.repo.keys.admitted_trajectories))
            if cap == 0:
                assert store.state.ready_count == 1 and len(store.state.ready[0].members) == G - 1
                assert admitted == G and not await tasks.fetch(batch=1, timeout=1.0)
                return
            assert store.state.ready_count == 0, "the group completed without its refill"
            assert admitted == G + 1
            [refill_msg] = await tasks.fetch(batch=1, timeout=10.0)
            refill = trajectory_pb2.Task.FromString(await tasks.resolve(refill_msg))
            assert (refill.task_id, refill.group_id, refill.group_size, refill.first_sample, refill.refill_of) == (
                task.task_id, task.group_id, 1, G, failed)
            assert (refill.prompt, refill.answer, refill.environment, refill.seed, refill.admitted_at_version) == (
                task.prompt, task.answer, task.environment, task.seed, task.admitted_at_version)
            await _take_all(store, [_member(refill, G, 1.0)])
            assert store.state.ready_count == 1
            members = sorted(t.trajectory_id for t in store.state.ready[0].members)
            assert members == sorted(f"{task.task_id}-{i}" for i in (0, 2, G))
            c = await store.w.gate.counters()
            assert (c.running, c.accepted) == (0, G), "the gate releases G + 1 admitted: G kept, one failed"
        finally:
            await store.stop()
    asyncio.run(main())

