"""The gate's per-group records stay bounded by what is in flight over a run of many groups.

An in-process store against real NATS and Redis (no other service) takes 40 groups through, two per
round: one kept group (handed to the learner, reported trained one round later, so one group is in
flight at every measurement) and one filtered group (zero variance). After each round's commit the
gate's per-group records (`groups_done`, `groups_accepted`), the open-group set, the per-group
membership keys, the task records, the final-id set and the whole key count must hold no more than
the groups still in flight, while the gate's counters and the archive still account for every
admitted trajectory exactly once — and a late redelivery of a settled group's member is still a
duplicate, and a learner's repeated report of it (a replay after a restart) records nothing twice.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
from contract_layouts import old_layout
from store_checks import admit_and_take, graded, store_config, take

from trajmesh import bus as busmod
from trajmesh.contract import Trajectory
from trajmesh.infra import NatsServer, RedisServer
from trajmesh.services.store.archive import final_outcomes, read_archive
from trajmesh.services.store.service import TrajectoryStore
from trajmesh.v1 import services_pb2

pytestmark = [pytest.mark.timeout(180)]

ROUNDS = 20
G = 2
CONFIG = {"tasks.group_size": G, "learner.batch_groups": 1, "gate.eta": 2, "store.drop_zero_variance_groups": True}


async def _sizes(store: TrajectoryStore) -> dict[str, int]:
    r, keys = store.w.redis, store.w.repo.keys
    group_keys = [k async for k in r.scan_iter(match=keys.group_received("*").replace(":received", ":*"))]
    return {"groups_done": int(await r.scard(keys.groups_done)),
            "groups_accepted": int(await r.hlen(keys.groups_accepted)),
            "open_groups": int(await r.scard(keys.open_groups)),
            "group_keys": len(group_keys),
            "tasks": int(await r.hlen(keys.tasks)),
            "final": int(await r.scard(keys.final_trajectories)),
            "dbsize": int(await r.dbsize())}


def test_gate_records_stay_flat_over_many_groups(tmp_path: Path, nats_server: NatsServer,
                                                 redis_server: RedisServer, tiny_model_dir: str) -> None:
    cfg = store_config(tmp_path, nats_server, redis_server, tiny_model_dir, **CONFIG)
    trained: list[str] = []

    async def main() -> tuple[list[dict[str, int]], int, int, int]:
        store = TrajectoryStore(cfg)
        await store.setup()
        measured: list[dict[str, int]] = []
        in_flight: list[str] = []  # the kept group the learner holds, reported next round
        first_kept = ""
        for k in range(ROUNDS):
            kept_task = await admit_and_take(store, f"keep{k}", [1.0, 0.0])  # rewards differ: kept
            first_kept = first_kept or kept_task
            await admit_and_take(store, f"drop{k}", [1.0, 1.0])  # zero variance: filtered
            version = await store.w.gate.version()
            if in_flight:  # the learner reports the batch it took last round, then takes this one
                await store.report(services_pb2.ReportRequest(learner_version=version, trained_ids=in_flight))
                trained.extend(in_flight)
                await store.w.gate.set_version(version + 1)
                version += 1
            batch = await store.next_batch(version, G, timeout_s=10.0)
            assert [t.group_id for t in batch] == [f"g{2 * k}-keep{k}"] * G
            in_flight = [t.trajectory_id for t in batch]
            await store._commit_final()
            measured.append(await _sizes(store))
        await store.report(services_pb2.ReportRequest(learner_version=await store.w.gate.version(),
                                                      trained_ids=in_flight))
        trained.extend(in_flight)
        await store._commit_final()
        # A late redelivery of the first group's members (trained, settled and trimmed long ago),
        # e.g. after a lost ack: still a duplicate, no new outcome.
        for i in range(G):
            await store.w.bus.publish(busmod.SUBJECT_TRAJ_GRADED, graded(first_kept, "g0-keep0", i, 0.5, 0, G),
                                      msg_id=f"late-{first_kept}-{i}")
        await take(store, G)
        # A malformed trajectory claiming that trimmed task under an id not one of its samples
        # (the mesh e2e's injected bad input, arriving after the task settled): quarantined for
        # what is wrong with it, not taken for a duplicate of a sample it never was.
        intruder = old_layout(Trajectory.from_bytes(graded(first_kept, "intruder-group", 0, 0.5, 0, G)))
        intruder.pb.trajectory_id = "intruder"
        intruder.pb.behavior_logprobs.append(-1.0)  # in the layout before the token block
        await store.w.bus.publish(busmod.SUBJECT_TRAJ_GRADED, intruder.to_bytes())
        await take(store, 1)
        await store._commit_final()
        # A learner replaying after its restart reports that group trained again: not recorded twice.
        await store.report(services_pb2.ReportRequest(learner_version=await store.w.gate.version(),
                                                      trained_ids=[f"{first_kept}-{i}" for i in range(G)]))
        counters = await store.w.gate.counters()
        admitted = int(await store.w.redis.get(store.w.repo.keys.admitted_trajectories) or 0)
        final = await _sizes(store)
        await store.stop()
        return measured + [final], counters.accepted, counters.running, admitted

    measured, accepted, running, admitted = asyncio.run(main())
    # Exactly one group is in flight (handed out, not reported) at every measurement but the last.
    for k, sizes in enumerate(measured[:-1]):
        assert sizes["groups_done"] <= 1 and sizes["groups_accepted"] <= 1, (k, sizes)
        assert sizes["open_groups"] <= 1 and sizes["group_keys"] <= 2, (k, sizes)
        assert sizes["tasks"] <= 1 and sizes["final"] == 0, (k, sizes)  # the held group: none final yet
    last = measured[-1]
    assert last["groups_done"] == last["groups_accepted"] == last["open_groups"] == last["tasks"] == last["final"] == 0
    assert max(s["dbsize"] for s in measured[3:]) <= max(s["dbsize"] for s in measured[:3]), measured
    # Exact accounting: every admitted trajectory has one final outcome, and the gate counted each
    # kept group once.
    assert admitted == 2 * ROUNDS * G and running == 0 and accepted == ROUNDS * G
    outcomes = {tid: row["outcome"] for tid, row in final_outcomes(read_archive(Path(cfg.run_dir) / "archive")).items()}
    expected = {f"keep{k}-c{2 * k}-{i}": "trained" for k in range(ROUNDS) for i in range(G)}
    expected.update({f"drop{k}-c{2 * k + 1}-{i}": "filtered" for k in range(ROUNDS) for i in range(G)})
    assert outcomes.pop("intruder", None) == "quarantined"  # never admitted: not in the gate's count
    assert outcomes == expected
    assert sorted(trained) == sorted(t for t in expected if t.startswith("keep"))
    rows = read_archive(Path(cfg.run_dir) / "archive").to_pylist()
    assert sorted(r["trajectory_id"] for r in rows if r["outcome"] == "trained") == sorted(trained)
    assert sorted(r["trajectory_id"] for r in rows if r["outcome"] == "duplicate") == [
        f"keep0-c0-{i}" for i in range(G)]
    assert [(r["outcome"], r["reason"]) for r in rows if r["trajectory_id"] == "intruder"] == [
        ("quarantined", "length_mismatch")]


class _Killed(BaseException):
    """The store process died here (no handler of the service catches a BaseException)."""


def test_a_store_killed_before_its_cleanup_leaves_no_records_behind(
        tmp_path: Path, nats_server: NatsServer, redis_server: RedisServer, tiny_model_dir: str) -> None:
    """Killed after marking a commit's ids final and acking them, before the cleanup: the groups it
    settled keep their records in Redis. The next store finds them settled (gate accounting done,
    all G members final) and drops them on start; nothing is owed, nothing counted twice."""
    cfg = store_config(tmp_path, nats_server, redis_server, tiny_model_dir, **CONFIG)

    async def main() -> tuple[dict[str, int], dict[str, int], bool, int, int]:
        store = TrajectoryStore(cfg)
        await store.setup()
        await admit_and_take(store, "keep", [1.0, 0.0])
        await admit_and_take(store, "drop", [1.0, 1.0])
        batch = await store.next_batch(0, G, timeout_s=10.0)

        async def killed(*_: object) -> None:
            raise _Killed
        store.w.repo.cleanup = killed  # type: ignore[method-assign]
        with pytest.raises(_Killed):
            await store.report(services_pb2.ReportRequest(learner_version=0,
                                                          trained_ids=[t.trajectory_id for t in batch]))
        left = await _sizes(store)
        await store.w.grpc_server.stop(grace=0)  # the kill: connections go, no stop()
        await store.w.bus.close()
        await store.w.redis.aclose()
        again = TrajectoryStore(cfg)
        await again.setup()
        after = await _sizes(again)
        recovering = again.recovery_pending
        counters = await again.w.gate.counters()
        await again.w.redis.set(again.w.repo.keys.run_finished, "budget")
        await again.stop()
        return left, after, recovering, counters.accepted, counters.running

    left, after, recovering, accepted, running = asyncio.run(main())
    assert left["groups_done"] == 2 and left["open_groups"] == 2  # what the killed store left
    assert after["groups_done"] == after["groups_accepted"] == after["open_groups"] == after["group_keys"] == 0, after
    assert after["tasks"] == after["final"] == 0, after
    assert not recovering and (accepted, running) == (G, 0)
    outcomes = {tid: row["outcome"] for tid, row in final_outcomes(read_archive(Path(cfg.run_dir) / "archive")).items()}
    assert outcomes == {"keep-c0-0": "trained", "keep-c0-1": "trained", "drop-c1-0": "filtered", "drop-c1-1": "filtered"}
