"""The store takes a run of graded trajectories in with one Redis round trip, and leaves exactly
what the separate round trips leave (real NATS and Redis, the store's own intake).

The same two runs of messages go through an in-process store twice, in two namespaces of one
Redis: with `store.pipelined_intake` (one script per run: lookup, membership, finish of the groups
the run completes) and without (a lookup, a membership MULTI, a finish script per completed group
and a ZREM per filtered one). The runs hold every kind of message the intake judges: a group
completed and kept, one completed and filtered (zero variance), one that completes across the two
runs with a member from the future (quarantined, a member all the same), an unknown task, a
member claiming another group, members stale on arrival beside fresh ones, and a duplicate of a
final id. Checked: the archive's final outcomes, every key of the store's Redis record and the
gate's counters, and the groups handed to the learner are the same both ways; and the pipelined
store made one round trip (one EVALSHA) per run, plus one finish script for the group whose
members were cut on arrival (the script finishes a group only when each member it expected valid
was), where the other made a lookup, a MULTI and one script per completed group.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest
from store_checks import graded, recorded_round_trips, store_config, take

from trajmesh import bus as busmod
from trajmesh.contract import Trajectory
from trajmesh.infra import NatsServer, RedisServer
from trajmesh.services.store.archive import final_outcomes, read_archive
from trajmesh.services.store.repo import task_id_at
from trajmesh.services.store.service import TrajectoryStore
from trajmesh.v1 import trajectory_pb2

pytestmark = [pytest.mark.timeout(180)]

G = 4
ETA = 3


def _mismatched(task_id: str) -> bytes:
    """A trajectory of `task_id` that claims a group that is not its task's."""
    task = trajectory_pb2.Task(task_id=task_id, group_id="g-other", source="chain_sum", group_size=G)
    t = Trajectory.new(task, trajectory_id=f"{task_id}-9")
    t.append_prompt([1, 5, 6])
    t.append_sampled([7, 3], [-0.5, -0.1], 0)
    t.finish(trajectory_pb2.EOS)
    t.set_reward(1.0)
    return t.to_bytes()


async def _admit(store: TrajectoryStore, base: str) -> tuple[str, str]:
    """Admit a task at the gate's version as the store does; (task id, group id)."""
    cursor = await store.w.repo.next_cursor()
    task_id, gid = task_id_at(base, cursor), f"g{cursor}-{base}"
    record = {"group_id": gid, "group_size": G, "source": "chain_sum", "cursor": cursor,
              "admitted_at_version": await store.w.gate.version()}
    assert await store.w.repo.try_admit(task_id, record, b"", G)
    return task_id, gid


async def _dump(store: TrajectoryStore, prefix: str) -> dict[str, Any]:
    """Every key under `prefix` with its value, the prefix cut off."""
    r = store.w.redis
    out: dict[str, Any] = {}
    async for raw in r.scan_iter(match=f"{prefix}*"):
        key = raw.decode()
        kind = (await r.type(key)).decode()
        if kind == "string":
            value: Any = await r.get(key)
        elif kind == "set":
            value = sorted(await r.smembers(key))
        elif kind == "hash":
            value = sorted((await r.hgetall(key)).items())
        elif kind == "zset":
            value = await r.zrange(key, 0, -1, withscores=True)
        else:
            raise AssertionError(f"{key}: a {kind}")
        out[key[len(prefix):]] = value
    return out


def _scenario(tmp_path: Path, nats: NatsServer, redis: RedisServer, model: str, *, pipelined: bool
              ) -> tuple[dict[str, tuple[str, str]], dict[str, Any], list[str], list[list[list[str]]]]:
    namespace = "one" if pipelined else "sep"
    cfg = store_config(tmp_path / namespace, nats, redis, model, **{
        "tasks.group_size": G, "gate.eta": ETA, "learner.batch_groups": 1, "infra.namespace": namespace,
        "store.pipelined_intake": pipelined})

    async def main() -> tuple[dict[str, Any], list[str], list[list[list[str]]]]:
        store = TrajectoryStore(cfg)
        await store.setup()
        runs: list[list[list[str]]] = []

        async def run(messages: list[tuple[bytes, str]]) -> None:
            for data, msg_id in messages:
                await store.w.bus.publish(busmod.SUBJECT_TRAJ_GRADED, data, msg_id=msg_id)
            trips.clear()
            await take(store, len(messages))
            runs.append(list(trips))
            await store._commit_final()

        admission = store.w.repo.admission  # every script loaded: no NOSCRIPT retry in the count
        for script in (admission._admit, admission._finish_group, admission._refill, admission._intake):
            await store.w.redis.script_load(script.script)
        cls = store.w.redis.connection_pool.connection_class
        try:
            with recorded_round_trips(cls) as trips:  # what `run` reads
                (a, ga), (b, gb), (c, gc), (d, gd) = [await _admit(store, base) for base in "abcd"]
                first = [(graded(a, ga, i, float(i % 2), 0, G), f"{a}-{i}") for i in range(G)]
                first += [(graded(b, gb, i, 1.0, 0, G), f"{b}-{i}") for i in range(G)]  # zero variance
                first += [(graded(c, gc, i, float(i), 0, G), f"{c}-{i}") for i in range(2)]
                first += [(graded(c, gc, 2, 0.5, 9, G), f"{c}-2"),  # a version the learner has not reached
                          (graded("nope-c99", "g99-nope", 0, 1.0, 0, G), "nope"),  # unknown task
                          (_mismatched(a), "mismatched")]
                await run(first)
                await store.w.gate.set_version(ETA + 2)  # what was sampled at v0 is stale on arrival
                second = [(graded(c, gc, 3, 3.0, ETA + 2, G), f"{c}-3"), (graded(a, ga, 0, 0.0, 0, G), "again")]
                second += [(graded(d, gd, i, float(i), 0 if i < 2 else ETA + 2, G), f"{d}-{i}") for i in range(G)]
                await run(second)
                # Every group is due at v5 (admitted at v0, eta 3): one batch takes them all.
                handed = sorted(t.trajectory_id for t in await store.next_batch(ETA + 2, 64, timeout_s=5.0))
                return await _dump(store, f"{namespace}:"), handed, runs
        finally:
            await store.stop()

    dump, handed, runs = asyncio.run(main())
    final = {tid: (r["outcome"], r["reason"])
             for tid, r in final_outcomes(read_archive(Path(cfg.run_dir) / "archive")).items()}
    return final, dump, handed, runs


def test_one_round_per_run_leaves_what_separate_round_trips_leave(
        tmp_path: Path, nats_server: NatsServer, redis_server: RedisServer, tiny_model_dir: str) -> None:
    one = _scenario(tmp_path, nats_server, redis_server, tiny_model_dir, pipelined=True)
    sep = _scenario(tmp_path, nats_server, redis_server, tiny_model_dir, pipelined=False)
    final, dump, handed, runs = one
    assert final == sep[0]
    assert dump == sep[1]
    assert handed == sep[2]
    # What the scenario is: every kind of verdict happened.
    by_reason = {(o, r) for o, r in final.values()}
    assert {("filtered", "zero_variance"), ("quarantined", "version_from_future"),
            ("quarantined", "group_mismatch"), ("filtered", "stale_on_arrival")} <= by_reason, final
    assert sum(o == "accepted" for o, _ in final.values()) == G + 3 + 2, final  # a, c (3 valid), d (2 fresh)
    assert len(handed) == G + 3 + 2, handed
    # The pipelined store: one round trip per run (the intake script), but for group d, whose
    # members cut on arrival were not the valid members the store expected: the script leaves its
    # finish to the store (one more script). The other: a lookup, the membership MULTI, and per
    # completed group its finish (and a filtered one's ZREM).
    assert runs == [[["EVALSHA"]], [["EVALSHA"], ["EVALSHA"]]], runs
    sep_runs = sep[3]
    assert sep_runs[0][0][0] == "GET" and sep_runs[0][1][0] == "MULTI", sep_runs
    assert sum(t == ["EVALSHA"] for t in sep_runs[0]) == 2 and ["ZREM"] in sep_runs[0], sep_runs
    assert sum(t == ["EVALSHA"] for t in sep_runs[1]) == 2, sep_runs
