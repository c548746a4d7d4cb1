"""The store's admission loop costs two Redis round trips per admitted task, against a real Redis.

The real `admission_loop` of an in-process store (real NATS and Redis) runs with gate capacity for
two groups. A connection class on the store's Redis client records every round trip (each
`send_packed_command`: one command, or one pipeline) with the names of the commands it carried.
Checked: each admission is one pipelined round (the finished flag, the gate's counters, the next
sampler position, the previous task's unpublished mark cleared) and its admission script, so two
tasks take four round trips (one at a time: EXISTS, MGET, MGET, INCR, EVALSHA, HDEL per task,
six); a round without capacity draws no new position, and the one drawn there is the next task's
when the learner's version frees capacity (no position skipped); no unpublished mark is left.
"""

from __future__ import annotations

import asyncio
import contextlib
from pathlib import Path
from typing import Any

import nats.errors
from store_checks import recorded_round_trips, store_config

from trajmesh import bus as busmod
from trajmesh.infra import NatsServer, RedisServer
from trajmesh.learner.models import build_char_tokenizer
from trajmesh.services.store.service import TrajectoryStore
from trajmesh.v1 import trajectory_pb2

G = 4


async def _wait_for(check: Any, what: str, timeout_s: float = 60.0) -> None:
    try:
        async with asyncio.timeout(timeout_s):
            while not await check():
                await asyncio.sleep(0.02)
    except TimeoutError:
        raise AssertionError(f"no {what} within {timeout_s:.0f}s") from None


async def _cancel(task: asyncio.Future[Any]) -> None:
    """Cancels `task` until it ends: on 3.11 a cancel that lands as an `asyncio.wait_for` completes
    is lost, and the loop's publish waits for its JetStream ack under one (nats-py)."""
    while not task.done():
        task.cancel()
        await asyncio.wait([task], timeout=1.0)


def test_an_admission_is_one_round_and_one_script(tmp_path: Path, nats_server: NatsServer,
                                                  redis_server: RedisServer) -> None:
    model = tmp_path / "model"
    build_char_tokenizer(model)
    (model / "config.json").write_text("{}")
    cfg = store_config(tmp_path, nats_server, redis_server, str(model), **{
        "tasks.group_size": G, "learner.batch_groups": 3, "gate.eta": 0})

    async def main() -> tuple[list[list[str]], int, list[int], int]:
        store = TrajectoryStore(cfg)
        await store.setup()
        loop = None
        try:
            tasks = await store.w.bus.pull_subscribe(busmod.STREAM_TASKS, "rollout", ack_wait_s=30.0)
            assert await store.w.gate.capacity() == 3 * G  # (eta + v + 1)·B at v 0: three groups
            assert await store._publish_next_task(0)  # one admitted outside the loop (loads the script)
            seeds: list[int] = []

            async def tasks_on_bus(n: int) -> bool:
                with contextlib.suppress(nats.errors.TimeoutError):
                    for msg in await tasks.fetch(batch=n - len(seeds), timeout=0.2):
                        seeds.append(trajectory_pb2.Task.FromString(await tasks.resolve(msg)).seed)
                        await msg.ack()
                return len(seeds) >= n

            # Every round trip of the store's Redis client from here (nothing else in this process
            # talks to Redis), a new connection's handshake left out.
            with recorded_round_trips(store.w.redis.connection_pool.connection_class) as trips:
                loop = asyncio.ensure_future(store.admission_loop())

                async def idle_round_done() -> bool:
                    return len(trips) >= 6  # 2 tasks, the round clearing the last mark, a round without capacity

                await _wait_for(lambda: tasks_on_bus(3), "the loop's two tasks on TASKS")
                await _wait_for(idle_round_done, "a round without capacity")
                first = list(trips)
            draws = sum(t.count("INCRBY") for t in first)
            await store.w.gate.set_version(1)  # B more slots: the position held is admitted
            store.capacity_changed.set()
            await _wait_for(lambda: tasks_on_bus(4), "a task after the version")
            await _cancel(loop)
            loop = None
            for task_id in store.published_tasks:  # what the next round would have cleared
                await store.w.repo.published(task_id)
            return first, draws, seeds, len(await store.w.repo.unpublished())
        finally:
            if loop is not None:
                await _cancel(loop)
            await store.stop()

    trips, draws, seeds, unpublished = asyncio.run(main())
    # Two tasks: a round and the admission script each.
    assert [k for k, t in enumerate(trips) if t == ["EVALSHA"]][:2] == [1, 3], trips
    rounds = [trips[0], trips[2]]
    assert all(t[-3:] == ["EXISTS", "MGET", "INCRBY"] for t in rounds), rounds
    assert trips[2][0] == "HDEL", trips  # the first task's unpublished mark, cleared in the second round
    # Then the round that cleared the second task's mark, drew a position and found no capacity,
    # and rounds without capacity that draw nothing more.
    assert trips[4][0] == "HDEL" and all(t == ["EXISTS", "MGET"] for t in trips[5:]), trips
    assert draws == 3, trips
    base = cfg.seed * 1_000_003
    assert [s - base for s in seeds] == [0, 1, 2, 3]  # the seed follows the position: none skipped
    assert unpublished == 0
