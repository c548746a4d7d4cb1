"""Two store replicas and the learner's client (services/store/client.py), against real NATS and Redis.

Each replica is a real `TrajectoryStore` serving gRPC; groups are admitted through the shared gate
and taken in through each replica's own partition subject. The learner's `StoreClient` gathers a
batch across both: the oldest groups across replicas, none while a replica waits for a due group,
and its Report reaches the replica that handed each trajectory out; a replica that stops answering
is skipped after `skip_after_s`, and its Report waits for it.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pyarrow.parquet as pq
from prometheus_client import REGISTRY
from store_checks import graded, store_config, take

from trajmesh import bus as busmod
from trajmesh.infra import NatsServer, RedisServer, free_port
from trajmesh.services.store.client import StoreClient, shares
from trajmesh.services.store.repo import task_id_at
from trajmesh.services.store.service import TrajectoryStore
from trajmesh.v1 import services_pb2

G = 2


def _config(tmp_path: Path, nats: NatsServer, redis: RedisServer, model_dir: str) -> Any:
    return store_config(tmp_path, nats, redis, model_dir, **{
        "store.replicas": 2, "infra.store_addresses": [f"127.0.0.1:{free_port()}" for _ in range(2)],
        "tasks.group_size": G, "learner.batch_groups": 2, "gate.eta": 1,
        "store.drop_zero_variance_groups": False})


async def _admit(stores: list[TrajectoryStore], partition: int, *, arrive: bool = True) -> list[str]:
    """Admit one task at the gate's version whose group the replica `partition` owns; publish its
    members on that partition's subject and take them in there (unless not `arrive`). Returns the
    member ids."""
    store = stores[partition]
    version = await store.w.gate.version()
    cursor = await store.w.repo.next_cursor()
    base = next(b for b in (f"t{i}" for i in range(100)) if busmod.partition_of(f"g{cursor}-{b}", 2) == partition)
    task_id, gid = task_id_at(base, cursor), f"g{cursor}-{base}"
    record = {"group_id": gid, "group_size": G, "source": "chain_sum", "admitted_at_version": version,
              "cursor": cursor}
    assert await store.w.repo.try_admit(task_id, record, b"", G)
    if arrive:
        await _arrive(store, task_id, gid, version)
    return [f"{task_id}-{i}" for i in range(G)]


async def _arrive(store: TrajectoryStore, task_id: str, gid: str, version: int) -> None:
    subject = busmod.graded_subject(store.replica, store.partitions)
    for i in range(G):
        data = graded(task_id, gid, i, float(i), version, G)
        await store.w.bus.publish(subject, data, msg_id=f"{task_id}-{i}")
    await take(store, G)


@contextlib.asynccontextmanager
async def _replicas(cfg: Any) -> AsyncIterator[tuple[list[TrajectoryStore], StoreClient]]:
    """Two set-up store replicas and a learner's client of both; all stopped on the way out."""
    stores = [TrajectoryStore(cfg, replica=k) for k in range(2)]
    for s in stores:
        await s.setup()
    client = StoreClient(cfg, lambda call, request: call(request, timeout=30.0))
    try:
        yield stores, client
    finally:
        await client.close()
        for s in stores:
            await s.stop()


def _trained_rows(store: TrajectoryStore) -> set[str]:
    store.w.archive.flush()
    out: set[str] = set()
    for path in store.w.archive.directory.glob(f"part-store{store.replica}-*.parquet"):
        t = pq.read_table(path, columns=["trajectory_id", "outcome"]).to_pydict()
        out |= {tid for tid, o in zip(t["trajectory_id"], t["outcome"], strict=True) if o == "trained"}
    return out


def test_shares_take_the_oldest_groups_across_replicas() -> None:
    peeks = [services_pb2.NextBatchResponse(ready_versions=[1, 1, 3]),
             services_pb2.NextBatchResponse(ready_versions=[0, 2])]
    assert shares(peeks, 3) == {1: 1, 0: 2}  # v0 (replica 1), then v1 and v1 (replica 0)
    assert shares(peeks, 4) == {1: 2, 0: 2}


def test_gather_takes_oldest_across_replicas_and_reports_to_each(
        tmp_path: Path, nats_server: NatsServer, redis_server: RedisServer, tiny_model_dir: str) -> None:
    cfg = _config(tmp_path, nats_server, redis_server, tiny_model_dir)

    async def main() -> dict[str, Any]:
        async with _replicas(cfg) as (stores, client):
            a = await _admit(stores, 1)  # at v0, replica 1
            await stores[0].w.gate.set_version(1)
            b = await _admit(stores, 0)  # at v1, replica 0
            c = await _admit(stores, 0)  # at v1, replica 0 (younger than b)
            batch = await client.next_batch(1, timeout_s=5.0)
            ids = [t.trajectory_id for t in batch.trajectories]
            await client.report(services_pb2.ReportRequest(learner_version=1, trained_ids=ids),
                                {t.trajectory_id: t.group_id for t in batch.trajectories})
            return {"a": a, "b": b, "c": c, "ids": ids, "trained": [_trained_rows(s) for s in stores],
                    "held": [[s.state.holds(t) for t in ids] for s in stores],
                    "c_ready": all(stores[0].state.holds(t) for t in c)}

    out = asyncio.run(main())
    assert sorted(out["ids"]) == sorted(out["a"] + out["b"]), out  # oldest across replicas, not c
    assert out["trained"] == [set(out["b"]), set(out["a"])], out  # each replica archived its own
    assert out["held"] == [[False] * 4, [False] * 4] and out["c_ready"], out


def test_a_replica_waiting_for_a_due_group_holds_the_gather(
        tmp_path: Path, nats_server: NatsServer, redis_server: RedisServer, tiny_model_dir: str) -> None:
    cfg = _config(tmp_path, nats_server, redis_server, tiny_model_dir)

    async def main() -> dict[str, Any]:
        async with _replicas(cfg) as (stores, client):
            due = await _admit(stores, 1, arrive=False)  # at v0: due at v1 (η = 1), on its way
            await stores[0].w.gate.set_version(1)
            young = [await _admit(stores, 0) for _ in range(2)]  # a whole batch ready on replica 0
            held = await client.next_batch(1, timeout_s=1.0)  # replica 1 holds: nothing taken
            ready_while_held = [stores[0].state.holds(t) for g in young for t in g]
            task_id = due[0].rsplit("-", 1)[0]
            gid = next(gid for gid in await stores[1].w.repo.due_groups(0))
            await _arrive(stores[1], task_id, gid, 0)
            batch = await client.next_batch(1, timeout_s=5.0)
            return {"held": len(held.trajectories), "ready_while_held": ready_while_held, "due": due,
                    "young": young, "ids": [t.trajectory_id for t in batch.trajectories]}

    out = asyncio.run(main())
    assert out["held"] == 0 and all(out["ready_while_held"]), out
    assert sorted(out["ids"]) == sorted(out["due"] + out["young"][0]), out  # the due group first


class _Pausable:
    """A TCP proxy in front of one replica's gRPC port. While paused it forwards nothing (what
    the learner sees of a SIGSTOPped replica: connections stay open, calls get no answer)."""

    def __init__(self, target: str) -> None:
        self.target = target
        self.open = asyncio.Event()
        self.open.set()
        self.server: asyncio.Server | None = None
        self.address = ""

    async def start(self) -> None:
        self.server = await asyncio.start_server(self._connection, "127.0.0.1", 0)
        self.address = f"127.0.0.1:{self.server.sockets[0].getsockname()[1]}"

    async def _connection(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        host, port = self.target.rsplit(":", 1)
        up_reader, up_writer = await asyncio.open_connection(host, int(port))
        await asyncio.gather(self._pipe(reader, up_writer), self._pipe(up_reader, writer), return_exceptions=True)

    async def _pipe(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while data := await reader.read(65536):
                await self.open.wait()
                writer.write(data)
                await writer.drain()
        finally:
            writer.close()

    async def close(self) -> None:
        assert self.server is not None
        self.server.close()


def _trained_count(store: TrajectoryStore, tid: str) -> int:
    """`trained` rows of `tid` in the replica's archive."""
    store.w.archive.flush()
    rows = 0
    for path in store.w.archive.directory.glob(f"part-store{store.replica}-*.parquet"):
        t = pq.read_table(path, columns=["trajectory_id", "outcome"]).to_pydict()
        rows += sum(1 for i, o in zip(t["trajectory_id"], t["outcome"], strict=True) if i == tid and o == "trained")
    return rows


def _unreachable_s(replica: int) -> float:
    return REGISTRY.get_sample_value("trajmesh_learner_store_replica_unreachable_seconds",
                                     {"replica": str(replica)}) or 0.0


def _skipped(replica: int) -> float:
    return REGISTRY.get_sample_value("trajmesh_learner_store_replica_skipped_steps_total",
                                     {"replica": str(replica)}) or 0.0


def test_an_unanswering_replica_is_skipped_its_report_owed_until_it_answers(
        tmp_path: Path, nats_server: NatsServer, redis_server: RedisServer, tiny_model_dir: str) -> None:
    """Replica 1 stops answering (its connections held open, as a SIGSTOPped process's): its part
    of a Report is owed; once it has not answered for `skip_after_s` the learner gathers without
    it, and a batch short of `learner.batch_groups` comes after the timeout; when it answers
    again the owed Report reaches it first (archived as trained there, once), and it is gathered
    from again."""
    cfg = _config(tmp_path, nats_server, redis_server, tiny_model_dir)

    async def main() -> dict[str, Any]:
        proxy = _Pausable(cfg.store_endpoints[1])
        await proxy.start()
        through = cfg.model_copy(update={"infra": cfg.infra.model_copy(
            update={"store_addresses": [cfg.store_endpoints[0], proxy.address]})})
        async with _replicas(cfg) as (stores, _):
            client = StoreClient(through, lambda call, request: call(request, timeout=30.0))
            # The run's skip time is the straggler hold (≥ the grader's 30 s ack wait); 1 s here.
            client.skip_after_s = 1.0
            try:
                a = await _admit(stores, 1)  # at v0, replica 1
                await stores[0].w.gate.set_version(1)
                b, c = await _admit(stores, 0), await _admit(stores, 0)  # at v1, replica 0
                first = await client.next_batch(1, timeout_s=5.0)
                group_of = {t.trajectory_id: t.group_id for t in first.trajectories}
                proxy.open.clear()  # replica 1 stops answering
                skipped_before = _skipped(1)
                await client.report(services_pb2.ReportRequest(learner_version=1, trained_ids=list(group_of)),
                                    group_of)
                owed = len(client.owed[1])
                short = await client.next_batch(2, timeout_s=3.0)
                out = {"a": a, "b": b, "c": c, "first": sorted(group_of), "owed": owed,
                       "short": [t.trajectory_id for t in short.trajectories],
                       "skipped": _skipped(1) - skipped_before, "unreachable_s": _unreachable_s(1), "a_held": [stores[1].state.holds(t) for t in a],
                       "trained_while_stopped": [_trained_rows(s) for s in stores]}
                await client.report(services_pb2.ReportRequest(learner_version=2, trained_ids=out["short"]),
                                    {t.trajectory_id: t.group_id for t in short.trajectories})
                d, e = await _admit(stores, 1), await _admit(stores, 0)
                proxy.open.set()  # it answers again
                again = await client.next_batch(3, timeout_s=10.0)
                out.update(again=[t.trajectory_id for t in again.trajectories], owed_after=len(client.owed[1]),
                           d=d, e=e, trained=[_trained_rows(s) for s in stores],
                           a_rows=sum(_trained_count(stores[1], t) for t in a), unreachable_after=_unreachable_s(1))
                return out
            finally:
                await client.close()
                await proxy.close()

    out = asyncio.run(main())
    assert out["first"] == sorted(out["a"] + out["b"]), out  # oldest across replicas
    assert out["owed"] == 1 and all(out["a_held"]), out  # replica 1's part waits, a stays handed out
    assert out["short"] == out["c"] and out["skipped"] == 1, out  # gathered without replica 1: one group
    assert out["unreachable_s"] >= 1.0 and out["unreachable_after"] == 0.0, out
    assert out["trained_while_stopped"] == [set(out["b"]), set()], out
    assert sorted(out["again"]) == sorted(out["d"] + out["e"]) and out["owed_after"] == 0, out
    assert out["trained"] == [set(out["b"] + out["c"]), set(out["a"])], out  # the owed Report
    assert out["a_rows"] == len(out["a"]), out  # once
