"""The JetStream layout and wrapper against a real nats-server."""

from __future__ import annotations

import asyncio
import os
from collections.abc import Coroutine
from pathlib import Path
from typing import Any

import nats.errors
import nats.js.errors
import pytest
from nats.js import api
from prometheus_client import REGISTRY

from trajmesh import bus as busmod
from trajmesh.bus import Bus
from trajmesh.infra import NatsServer

_TEST_DEADLINE_S = 30.0


def _run(coro: Coroutine[Any, Any, Any]) -> Any:
    """Run one async test body with a hard deadline (no pytest-asyncio needed)."""
    return asyncio.run(asyncio.wait_for(coro, _TEST_DEADLINE_S))


async def _build_bus(url: str, name: str = "test", namespace: str = "") -> Bus:
    bus = await busmod.connect(url, name=name, namespace=namespace, max_reconnect_attempts=0)
    await bus.ensure_streams()
    return bus


def test_streams_are_created_idempotently(nats_server: NatsServer) -> None:
    async def body() -> None:
        bus = await _build_bus(nats_server.url)
        await bus.ensure_streams()  # second call on the same connection
        other = await _build_bus(nats_server.url, name="other")  # and from another client
        for stream in (busmod.STREAM_TASKS, busmod.STREAM_TRAJ_RAW, busmod.STREAM_TRAJ_GRADED):
            info = await other.stream_info(stream)
            assert info.config.retention == api.RetentionPolicy.WORK_QUEUE
        weights = await bus.stream_info(busmod.STREAM_WEIGHTS)
        assert weights.config.retention == api.RetentionPolicy.LIMITS
        assert weights.config.subjects == [busmod.SUBJECT_WEIGHTS]
        await bus.js.key_value(busmod.KV_WEIGHTS)
        await bus.js.object_store(busmod.OBJ_BLOBS)
        # A changed mutable limit is applied as an update, not an error.
        await bus.ensure_streams(weights_history=3)
        weights = await bus.stream_info(busmod.STREAM_WEIGHTS)
        assert weights.config.max_msgs_per_subject == 3
        await bus.close()
        await other.close()

    _run(body())


def test_namespaces_share_a_server_without_mixing(nats_server: NatsServer) -> None:
    async def body() -> None:
        run_a = await _build_bus(nats_server.url, namespace="runA")
        run_b = await _build_bus(nats_server.url, namespace="runB")
        await run_a.publish(busmod.SUBJECT_TASKS, b"a")
        await run_b.publish(busmod.SUBJECT_TASKS, b"b")
        assert (await run_a.stream_info(busmod.STREAM_TASKS)).config.name == "runA_TASKS"
        for bus, expected in ((run_a, b"a"), (run_b, b"b")):
            consumer = await bus.pull_subscribe(busmod.STREAM_TASKS, "rollout")
            msgs = await consumer.fetch(10, timeout=1.0)
            assert [m.data for m in msgs] == [expected]
            await msgs[0].ack()
        await run_a.close()
        await run_b.close()

    _run(body())


def test_work_queue_shares_messages_between_subscribers(nats_server: NatsServer) -> None:
    n_tasks = 40

    async def drain(consumer: busmod.Consumer, out: list[bytes]) -> None:
        while True:
            msgs = await consumer.fetch(3, timeout=0.5)
            if not msgs:
                return
            for msg in msgs:
                out.append(bytes(msg.data))
                await msg.ack()
            await asyncio.sleep(0)  # let the other subscriber's fetch in

    async def body() -> None:
        producer = await _build_bus(nats_server.url, name="store")
        for i in range(n_tasks):
            await producer.publish(busmod.SUBJECT_TASKS, f"task-{i}".encode(), msg_id=f"task-{i}")
        worker_a = await _build_bus(nats_server.url, name="rollout-a")
        worker_b = await _build_bus(nats_server.url, name="rollout-b")
        consumer_a = await worker_a.pull_subscribe(busmod.STREAM_TASKS, "rollout")
        consumer_b = await worker_b.pull_subscribe(busmod.STREAM_TASKS, "rollout")
        got_a: list[bytes] = []
        got_b: list[bytes] = []
        await asyncio.gather(drain(consumer_a, got_a), drain(consumer_b, got_b))
        assert not set(got_a) & set(got_b)
        assert sorted(got_a + got_b) == sorted(f"task-{i}".encode() for i in range(n_tasks))
        assert got_a and got_b, "both subscribers should get a share"
        # Work-queue retention deletes acked messages.
        assert (await producer.stream_info(busmod.STREAM_TASKS)).state.messages == 0
        pending = await producer.pending(busmod.STREAM_TASKS, "rollout")
        assert pending.backlog == 0
        for bus in (producer, worker_a, worker_b):
            await bus.close()

    _run(body())


def test_unacked_message_is_redelivered_after_ack_wait(nats_server: NatsServer) -> None:
    async def body() -> None:
        bus = await _build_bus(nats_server.url)
        await bus.publish(busmod.SUBJECT_TRAJ_RAW, b"t-1", msg_id="t-1")
        await bus.publish(busmod.SUBJECT_TRAJ_RAW, b"t-2", msg_id="t-2")
        consumer = await bus.pull_subscribe(busmod.STREAM_TRAJ_RAW, "grader", ack_wait_s=1.0, max_deliveries=2)
        first = await consumer.fetch(1, timeout=1.0)
        assert [m.data for m in first] == [b"t-1"]
        assert first[0].metadata.num_delivered == 1
        pending = await consumer.pending()
        assert (pending.num_pending, pending.num_ack_pending) == (1, 1)
        second = await consumer.fetch(1, timeout=1.0)
        await second[0].ack()
        assert second[0].data == b"t-2"
        # t-1 was never acked: it comes back after ack_wait, marked as a redelivery.
        again = await consumer.fetch(1, timeout=3.0)
        assert [m.data for m in again] == [b"t-1"]
        assert again[0].metadata.num_delivered == 2
        await again[0].ack_sync()  # confirmed by the server before its state is read
        assert (await bus.stream_info(busmod.STREAM_TRAJ_RAW)).state.messages == 0
        await bus.close()

    _run(body())


def _poison_count(stream: str, durable: str) -> float:
    value = REGISTRY.get_sample_value("trajmesh_bus_poison_messages_total", {"stream": stream, "durable": durable})
    return value or 0.0


async def _fetch_until_poisoned(consumer: busmod.Consumer, poisoned: asyncio.Event) -> list[int]:
    """Fetch (never acking) until the poison hook fired; the delivery counts handed out."""
    handed_out = []
    while not poisoned.is_set():  # each fetch waits for the redelivery after ack_wait
        handed_out += [m.metadata.num_delivered for m in await consumer.fetch(1, timeout=2.0)]
    return handed_out


def test_poison_message_is_terminated_after_max_deliveries_counted_and_hooked(tmp_path: Path) -> None:
    max_payload = 64 * 1024
    big = os.urandom(2 * max_payload)

    async def body(url: str) -> None:
        bus = await _build_bus(url)
        await bus.publish(busmod.SUBJECT_TASKS, big, msg_id="task-poison")  # through the object store
        seen: list[bytes] = []
        poisoned = asyncio.Event()

        async def on_poison(msg: Any) -> None:
            seen.append(await bus.resolve(msg))  # the payload is still there for the archive
            poisoned.set()

        consumer = await bus.pull_subscribe(busmod.STREAM_TASKS, "rollout", ack_wait_s=1.0, max_deliveries=3,
                                            on_poison=on_poison)
        before = _poison_count(consumer.stream, "rollout")
        handed_out = await _fetch_until_poisoned(consumer, poisoned)
        assert handed_out == [1, 2, 3]  # the 4th delivery never reaches the caller
        assert seen == [big]
        assert _poison_count(consumer.stream, "rollout") == before + 1
        # Server side: the message is gone from the work queue and nothing waits for an ack.
        assert (await bus.stream_info(busmod.STREAM_TASKS)).state.messages == 0
        assert (await consumer.pending()).backlog == 0
        blobs = await bus.js.object_store(busmod.OBJ_BLOBS)
        with pytest.raises(nats.js.errors.NotFoundError):  # its blob was deleted with it
            await blobs.get("task-poison")
        await bus.close()

    with NatsServer(tmp_path, max_payload=max_payload) as server:
        _run(body(server.url))


def test_msg_id_dedupes_publishes(nats_server: NatsServer) -> None:
    async def body() -> None:
        bus = await _build_bus(nats_server.url)
        first = await bus.publish(busmod.SUBJECT_TRAJ_GRADED, b"g", msg_id="traj-42")
        again = await bus.publish(busmod.SUBJECT_TRAJ_GRADED, b"g", msg_id="traj-42")
        other = await bus.publish(busmod.SUBJECT_TRAJ_GRADED, b"h", msg_id="traj-43")
        assert not first.duplicate and again.duplicate and not other.duplicate
        assert again.seq == first.seq
        assert (await bus.stream_info(busmod.STREAM_TRAJ_GRADED)).state.messages == 2
        await bus.close()

    _run(body())


def test_large_payload_travels_through_object_store(tmp_path: Path) -> None:
    max_payload = 64 * 1024
    big = os.urandom(5 * max_payload + 123)

    async def body(url: str) -> None:
        grader = await _build_bus(url, name="grader")
        assert grader.nc.max_payload == max_payload
        with pytest.raises(nats.errors.MaxPayloadError):
            await grader.js.publish(busmod.SUBJECT_TRAJ_GRADED, big)
        ack = await grader.publish(busmod.SUBJECT_TRAJ_GRADED, big, msg_id="traj-big")
        small = await grader.publish_large(busmod.SUBJECT_TRAJ_GRADED, b"tiny", msg_id="traj-tiny")
        assert not ack.duplicate and not small.duplicate

        store = await _build_bus(url, name="store")
        consumer = await store.pull_subscribe(busmod.STREAM_TRAJ_GRADED, "store")
        msgs = await consumer.fetch(2, timeout=2.0)
        assert len(msgs) == 2
        assert msgs[0].headers is not None and msgs[0].headers[busmod.BLOB_HEADER] == "traj-big"
        assert len(msgs[0].data) == 0
        assert await consumer.resolve(msgs[0]) == big
        assert await store.resolve(msgs[1]) == b"tiny"
        blobs = await store.js.object_store(busmod.OBJ_BLOBS)
        assert (await blobs.get("traj-big")).data == big  # kept until the message is final
        for msg in msgs:
            await msg.ack()  # a blob message deletes its blob once the server confirmed the ack
        with pytest.raises(nats.js.errors.NotFoundError):
            await blobs.get("traj-big")
        with pytest.raises(nats.js.errors.NotFoundError):
            await blobs.get("traj-tiny")
        await consumer.discard_blob(msgs[0])  # idempotent
        assert (await store.stream_info(busmod.STREAM_TRAJ_GRADED)).state.messages == 0
        await grader.close()
        await store.close()

    with NatsServer(tmp_path, max_payload=max_payload) as server:
        _run(body(server.url))
