"""An in-process store against real NATS and Redis, fed by hand (imported by tests; not a test module).

What the store tests that drive `TrajectoryStore` directly share: their config, a graded
trajectory of a task, and admitting a task the way the store does (the id it gives the task at the
next sampler position) and taking its members in through the real intake.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from trajmesh import bus as busmod
from trajmesh.config import RunConfig, load_config
from trajmesh.contract import Trajectory
from trajmesh.infra import NatsServer, RedisServer, free_port
from trajmesh.services.store.repo import task_id_at
from trajmesh.services.store.service import TrajectoryStore, _Incoming
from trajmesh.v1 import trajectory_pb2


def store_config(tmp_path: Path, nats: NatsServer, redis: RedisServer, model_dir: str, **over: Any) -> RunConfig:
    """A run config for a store on these servers (no auth), with `over` on top."""
    return load_config(None, {
        "run_dir": str(tmp_path / "run"), "model.path": model_dir,
        "infra.nats_url": nats.url, "infra.redis_url": redis.public_url,
        "infra.store_address": f"127.0.0.1:{free_port()}",
        "infra.security.nats_auth": False, "infra.security.redis_auth": False, **over,
    })


def graded(task_id: str, group_id: str, index: int, reward: float, version: int, group_size: int) -> bytes:
    """Member `index` of a task, sampled with `version` (two tokens after a 3-token prompt; the
    second depends on the index, so members differ), graded `reward`."""
    task = trajectory_pb2.Task(task_id=task_id, group_id=group_id, source="chain_sum", group_size=group_size)
    t = Trajectory.new(task, trajectory_id=f"{task_id}-{index}")
    t.append_prompt([1, 5, 6])
    t.append_sampled([7, 2 + index], [-0.5, -0.1], version)
    t.finish(trajectory_pb2.EOS)
    t.set_reward(reward)
    return t.to_bytes()


async def admit_and_take(store: TrajectoryStore, base: str, rewards: list[float],
                         sampled_with: int | None = None) -> str:
    """Admit one task at the gate's version with the id the store gives the task at the next
    sampler position, publish its members (one per reward, sampled with `sampled_with`, default
    the gate's version) and take them in as one run. Returns the task id."""
    version = await store.w.gate.version()
    cursor = await store.w.repo.next_cursor()
    task_id, gid, g = task_id_at(base, cursor), f"g{cursor}-{base}", len(rewards)
    record = {"group_id": gid, "group_size": g, "source": "chain_sum", "admitted_at_version": version,
              "cursor": cursor}
    assert await store.w.repo.try_admit(task_id, record, b"", g)
    for i, reward in enumerate(rewards):
        data = graded(task_id, gid, i, reward, version if sampled_with is None else sampled_with, g)
        await store.w.bus.publish(busmod.SUBJECT_TRAJ_GRADED, data, msg_id=f"{task_id}-{i}")
    await take(store, g)
    return task_id


async def take(store: TrajectoryStore, n: int) -> None:
    """Fetch `n` messages from TRAJ_GRADED and take them in as one run."""
    incoming: list[_Incoming] = []
    while len(incoming) < n:
        for msg in await store.w.intake.fetch(batch=n, timeout=10.0):
            data = await store.w.intake.resolve(msg)
            traj = Trajectory.from_bytes(data)
            incoming.append(_Incoming(data, msg, traj, traj.pb.trajectory_id))
    await store._intake_run(incoming)


HANDSHAKE = {"HELLO", "CLIENT", "AUTH", "SELECT"}
"""What a new Redis connection sends before any command of the store's."""


def redis_command_names(packed: Any) -> list[str]:
    """The command names in a packed RESP request (one command or a pipeline of them)."""
    data = packed if isinstance(packed, (bytes, bytearray, memoryview)) else b"".join(bytes(p) for p in packed)
    data, names, i = bytes(data), [], 0
    while i < len(data):
        assert data[i:i + 1] == b"*", data[i:i + 20]
        end = data.index(b"\r\n", i)
        n, i = int(data[i + 1:end]), end + 2
        for k in range(n):
            end = data.index(b"\r\n", i)
            size = int(data[i + 1:end])
            if k == 0:
                names.append(data[end + 2:end + 2 + size].decode().upper())
            i = end + 2 + size + 2
    return names


@contextmanager
def recorded_round_trips(connection_class: Any) -> Iterator[list[list[str]]]:
    """Every round trip made through `connection_class` (a redis-py async connection class:
    `client.connection_pool.connection_class`) while the block runs, as the command names it
    carried (one command, or a pipeline's); a new connection's handshake left out. The class's
    `send_packed_command` is restored after."""
    trips: list[list[str]] = []
    send = connection_class.send_packed_command

    async def recording(self: Any, command: Any, check_health: bool = True) -> None:
        names = redis_command_names(command)
        if not set(names) <= HANDSHAKE:
            trips.append(names)
        await send(self, command, check_health)

    connection_class.send_packed_command = recording
    try:
        yield trips
    finally:
        connection_class.send_packed_command = send
