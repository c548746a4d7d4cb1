"""The grader reads the store's task records once per fetch, not once per trajectory (real Redis,
the grader's own `_grade`).

A fetch's messages are graded concurrently (`grade_loop`: one task each in a TaskGroup), so the G
samples of a task all missed the cache together and each made its own HGET. Now the ids missing
in one turn of the event loop are read together: 16 trajectories of 4 tasks graded as the loop
grades them make one round trip (one HMGET), every one graded with its task's record; graded
again, none (a record never changes once written); an id the store has not written yet is not
cached, and is read again once it is there.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest
import redis.asyncio
from store_checks import recorded_round_trips

from trajmesh.config import load_config
from trajmesh.contract import Trajectory
from trajmesh.infra import RedisServer
from trajmesh.services.grader import GraderService
from trajmesh.services.store.keys import RedisKeys
from trajmesh.services.store.record import RunRecord
from trajmesh.tasks import load_split
from trajmesh.tokenizer import load_tokenizer
from trajmesh.v1 import trajectory_pb2

pytestmark = [pytest.mark.timeout(60)]

G = 4


def _sample(task_id: str, index: int, tokenizer: Any) -> bytes:
    t = Trajectory.new(trajectory_pb2.Task(task_id=task_id, group_id=f"g-{task_id}", source="chain_sum"),
                       trajectory_id=f"{task_id}-{index}")
    t.append_prompt(tokenizer.encode("1+2")[:4])
    ids = tokenizer.encode(str(index)) + [tokenizer.eos_token_id]
    t.append_sampled(ids, [-1.0] * len(ids), 0)
    t.finish(trajectory_pb2.EOS)
    return t.to_bytes()


async def _grade_as_the_loop_does(svc: GraderService, samples: list[bytes]) -> list[Trajectory]:
    """`_grade` of each sample in a task of its own, as `grade_loop` grades a fetch."""
    async with asyncio.TaskGroup() as tg:
        graded = [tg.create_task(svc._grade(data)) for data in samples]
    return [Trajectory.from_bytes(g.result()[0]) for g in graded]


def test_a_fetch_reads_its_task_records_in_one_round_trip(redis_server: RedisServer, tiny_model_dir: str) -> None:
    cfg = load_config(None, {})
    specs = load_split(cfg.tasks.sources[0], 5, 1)[0][:5]
    keys = RedisKeys("")

    async def main() -> None:
        r = redis.asyncio.Redis.from_url(redis_server.public_url)
        svc = GraderService(cfg)
        svc.redis, svc.record = r, RunRecord(r, "")
        svc.tokenizer = load_tokenizer(tiny_model_dir)
        task_ids = [f"t{k}" for k in range(5)]
        for task_id, spec in zip(task_ids[:4], specs, strict=False):
            await r.hset(keys.tasks, task_id, json.dumps({
                "group_id": f"g-{task_id}", "group_size": G, "source": spec.source, "answer": spec.answer,
                "prompt": spec.prompt, "metadata": spec.metadata}))
        with recorded_round_trips(r.connection_pool.connection_class) as trips:
            try:
                fetch = [_sample(task_id, i, svc.tokenizer) for task_id in task_ids[:4] for i in range(G)]
                out = await _grade_as_the_loop_does(svc, fetch)
                assert trips == [["HMGET"]], trips
                assert all(t.graded for t in out), [t.pb.verifier_output for t in out]

                trips.clear()  # the same tasks again: the records are kept
                out = await _grade_as_the_loop_does(svc, fetch[:G] + fetch[-G:])
                assert trips == [] and all(t.graded for t in out)

                late = [_sample(task_ids[4], i, svc.tokenizer) for i in range(2)]
                out = await _grade_as_the_loop_does(svc, late)  # not written yet: forwarded ungraded
                assert trips == [["HMGET"]] and not any(t.graded for t in out)
                await r.hset(keys.tasks, task_ids[4], json.dumps({
                    "group_id": f"g-{task_ids[4]}", "group_size": G, "source": specs[4].source,
                    "answer": specs[4].answer, "prompt": specs[4].prompt, "metadata": specs[4].metadata}))
                trips.clear()
                out = await _grade_as_the_loop_does(svc, late)  # an unknown id was not cached
                assert trips == [["HMGET"]] and all(t.graded for t in out)
            finally:
                await r.aclose()

    asyncio.run(main())
