"""NATS users and subject permissions, Redis AUTH, NATS and gRPC TLS — against real servers.

One nats-server (users + permissions from trajmesh.security, passwords from its environment) and one
redis-server (password) on free ports for the module, stopped by pid. Each forbidden publish and
subscribe of each role is refused by the server; each path the mesh uses works without a single
permissions violation.
"""

from __future__ import annotations

import asyncio
import os
import stat
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import nats
import nats.errors
import pytest
import redis
import redis.exceptions

from trajmesh import bus as busmod
from trajmesh import security
from trajmesh.config import RunConfig, TlsConfig, load_config
from trajmesh.infra import NatsServer, RedisServer
from trajmesh.weights import announce

pytestmark = pytest.mark.timeout(120)

NS = ""  # the default namespace; namespaced permissions are checked on the generated text below


class _Mesh:
    def __init__(self, root: Path) -> None:
        self.creds = security.LocalCredentials.load_or_create(root / "run")
        self.nats = NatsServer(root / "nats", authorization=security.nats_authorization(NS),
                               env=self.creds.nats_server_env())
        self.redis = RedisServer(root / "redis", password=self.creds.redis_password)

    def cfg(self, run_dir: Path | None = None, **over: object) -> RunConfig:
        return load_config(None, {"run_dir": str(run_dir or Path("/nonexistent-run")),
                                  "infra.nats_url": self.nats.url, "infra.redis_url": self.redis.public_url,
                                  "model.path": "unused", **over})


@pytest.fixture(scope="module")
def mesh(tmp_path_factory: pytest.TempPathFactory) -> Iterator[_Mesh]:
    m = _Mesh(tmp_path_factory.mktemp("secured"))
    m.nats.start()
    m.redis.start()
    try:
        asyncio.run(_provision(m))
        yield m
    finally:
        m.nats.stop()
        m.redis.stop()


async def _provision(m: _Mesh) -> None:
    bus = await busmod.connect(m.nats.url, name="admin", user="admin", password=m.creds.nats_passwords["admin"],
                               inbox_prefix=security.inbox_prefix("admin"), max_reconnect_attempts=0)
    await bus.ensure_streams()
    await bus.close()


async def _connect(m: _Mesh, role: str, errors: list[str], password: str | None = None) -> nats.NATS:
    async def on_error(err: Exception) -> None:
        errors.append(str(err))

    return await nats.connect(m.nats.url, user=role, password=password or m.creds.nats_passwords[role],
                              inbox_prefix=security.inbox_prefix(role), error_cb=on_error,
                              allow_reconnect=False, max_reconnect_attempts=0, connect_timeout=2)


async def _wait_for(errors: list[str], needle: str, timeout_s: float = 2.0) -> bool:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while loop.time() < deadline:
        if any(needle.lower() in e.lower() for e in errors):
            return True
        await asyncio.sleep(0.02)  # the server's -ERR arrives asynchronously; no event to await
    return False


# (role, subject): publishes the server must refuse. Streams and KV in the default namespace.
FORBIDDEN_PUBLISH = [
    ("rollout", busmod.SUBJECT_TASKS), ("rollout", busmod.SUBJECT_WEIGHTS),
    ("rollout", busmod.SUBJECT_TRAJ_GRADED), ("rollout", "$KV.trajmesh_weights.latest"),
    ("rollout", "$JS.API.STREAM.CREATE.TASKS"), ("rollout", "$JS.API.STREAM.DELETE.TASKS"),
    ("rollout", "$JS.API.STREAM.PURGE.TASKS"), ("rollout", "$JS.API.CONSUMER.CREATE.TRAJ_RAW.grader"),
    ("grader", busmod.SUBJECT_TASKS), ("grader", busmod.SUBJECT_WEIGHTS), ("grader", busmod.SUBJECT_TRAJ_RAW),
    ("grader", "$KV.trajmesh_weights.latest"), ("grader", "$JS.API.CONSUMER.MSG.NEXT.TASKS.rollout"),
    ("store", busmod.SUBJECT_WEIGHTS), ("store", busmod.SUBJECT_TRAJ_RAW), ("store", busmod.SUBJECT_TRAJ_GRADED),
    ("store", "$KV.trajmesh_weights.latest"), ("store", "$JS.API.STREAM.DELETE.WEIGHTS"),
    ("store", "$JS.API.CONSUMER.MSG.NEXT.TRAJ_RAW.grader"),
    ("learner", busmod.SUBJECT_TASKS), ("learner", busmod.SUBJECT_TRAJ_RAW),
    ("learner", busmod.SUBJECT_TRAJ_GRADED), ("learner", "$JS.API.STREAM.PURGE.TRAJ_GRADED"),
    ("learner", "$JS.API.CONSUMER.CREATE.TRAJ_GRADED.store"), ("learner", "$O.trajmesh_blobs.C.x"),
]

# (role, subject): subscriptions the server must refuse (sniffing work, weights or others' replies).
FORBIDDEN_SUBSCRIBE = [
    ("rollout", busmod.SUBJECT_TASKS), ("rollout", ">"), ("rollout", "_INBOX.>"), ("rollout", "_INBOX_store.>"),
    ("grader", busmod.SUBJECT_TRAJ_RAW), ("grader", "_INBOX_learner.>"),
    ("store", busmod.SUBJECT_TRAJ_GRADED), ("store", "$KV.trajmesh_weights.>"), ("store", "_INBOX_rollout.>"),
    ("learner", busmod.SUBJECT_WEIGHTS), ("learner", "_INBOX_store.>"),
]


@pytest.mark.parametrize(("role", "subject"), FORBIDDEN_PUBLISH, ids=[f"{r}->{s}" for r, s in FORBIDDEN_PUBLISH])
def test_forbidden_publish_is_refused(mesh: _Mesh, role: str, subject: str) -> None:
    async def go() -> None:
        errors: list[str] = []
        nc = await _connect(mesh, role, errors)
        try:
            await nc.publish(subject, b"forged")
            await nc.flush()
            assert await _wait_for(errors, "Permissions Violation for Publish"), errors
        finally:
            await nc.close()

    asyncio.run(go())


@pytest.mark.parametrize(("role", "subject"), FORBIDDEN_SUBSCRIBE, ids=[f"{r}->{s}" for r, s in FORBIDDEN_SUBSCRIBE])
def test_forbidden_subscribe_is_refused(mesh: _Mesh, role: str, subject: str) -> None:
    async def go() -> None:
        errors: list[str] = []
        nc = await _connect(mesh, role, errors)
        try:
            await nc.subscribe(subject)
            await nc.flush()
            assert await _wait_for(errors, "Permissions Violation for Subscription"), errors
        finally:
            await nc.close()

    asyncio.run(go())


def test_forged_messages_never_reach_a_stream(mesh: _Mesh) -> None:
    """After every forbidden publish above, the streams hold only what allowed roles put there."""
    async def go() -> None:
        errors: list[str] = []
        for role, subject in FORBIDDEN_PUBLISH:
            if subject.startswith("trajmesh."):
                nc = await _connect(mesh, role, errors)
                await nc.publish(subject, b"forged")
                await nc.flush()
                await nc.close()
        admin = await _connect(mesh, "admin", errors)
        js = admin.jetstream()
        for stream in ("TASKS", "TRAJ_RAW", "TRAJ_GRADED", "WEIGHTS"):
            info = await js.stream_info(stream)
            seq = info.state.first_seq
            for _ in range(info.state.messages):
                msg = await js.get_msg(stream, seq=seq)
                assert msg.data != b"forged", stream
                seq += 1
        await admin.close()

    asyncio.run(go())


@pytest.mark.parametrize("who", ["wrong-password", "anonymous", "unknown-user", "environment"])
def test_bad_credentials_are_refused(mesh: _Mesh, who: str) -> None:
    user, password = {"wrong-password": ("store", "not-the-password"), "anonymous": (None, None),
                      "unknown-user": ("mallory", "x"), "environment": ("environment", "x")}[who]

    async def go() -> None:
        with pytest.raises((nats.errors.Error, OSError)):
            nc = await nats.connect(mesh.nats.url, user=user, password=password, allow_reconnect=False,
                                    max_reconnect_attempts=0, connect_timeout=2)
            await nc.close()

    asyncio.run(go())


def test_every_allowed_path_works_without_a_violation(mesh: _Mesh, monkeypatch: pytest.MonkeyPatch,
                                                     tmp_path: Path) -> None:
    """store → TASKS → rollout → TRAJ_RAW (inline and via the blob store) → grader → TRAJ_GRADED →
    store; learner → weights KV + WEIGHTS → rollout (get and watch); store's backlog reads. Each role
    connects through security.connect_bus with its credentials from the environment (or a file)."""
    log_before = mesh.nats.log_path.read_text(errors="replace")
    pw_file = tmp_path / "rollout-password"
    pw_file.write_text(mesh.creds.nats_passwords["rollout"] + "\n")

    async def as_role(role: security.Role) -> busmod.Bus:
        monkeypatch.setenv(security.ENV_NATS_USER, role)
        if role == "rollout":  # a mounted secret file instead of the value
            monkeypatch.delenv(security.ENV_NATS_PASSWORD, raising=False)
            monkeypatch.setenv(f"{security.ENV_NATS_PASSWORD}_FILE", str(pw_file))
        else:
            monkeypatch.delenv(f"{security.ENV_NATS_PASSWORD}_FILE", raising=False)
            monkeypatch.setenv(security.ENV_NATS_PASSWORD, mesh.creds.nats_passwords[role])
        return await security.connect_bus(mesh.cfg(), role, name=f"test-{role}")

    async def go() -> None:
        store, rollout, grader, learner = [await as_role(r) for r in ("store", "rollout", "grader", "learner")]
        try:
            v1 = announce.announcement(1, tmp_path, "ab" * 32)
            await announce.publish(learner, v1)
            assert await announce.latest(learner) == v1
            assert await announce.latest(rollout) == v1
            watch = announce.watch(rollout, include_current=True)
            assert await asyncio.wait_for(watch.__anext__(), 5) == v1
            await watch.aclose()
            # A rollout whose delta rebuild failed asks the learner for a full anchor.
            revision = await announce.request_anchor(rollout, "rollout-0", 1)
            assert revision > 0 and await announce.anchor_request_revision(learner) == revision

            await store.publish(busmod.SUBJECT_TASKS, b"task-1", msg_id="task-1")
            tasks = await rollout.pull_subscribe(busmod.STREAM_TASKS, "rollout")
            [msg] = await tasks.fetch(1, timeout=5)
            assert await tasks.resolve(msg) == b"task-1"
            await msg.in_progress()
            await msg.ack()

            big = os.urandom(rollout.max_inline_bytes + 10)
            await rollout.publish(busmod.SUBJECT_TRAJ_RAW, b"traj-1", msg_id="traj-1")
            await rollout.publish(busmod.SUBJECT_TRAJ_RAW, big, msg_id="traj-big")
            raw = await grader.pull_subscribe(busmod.STREAM_TRAJ_RAW, "grader")
            got: list[bytes] = []
            while len(got) < 2:
                for msg in await raw.fetch(2, timeout=5):
                    data = await raw.resolve(msg)
                    await grader.publish(busmod.SUBJECT_TRAJ_GRADED, data, msg_id=f"g-{len(got)}")
                    await msg.ack()
                    await raw.discard_blob(msg)
                    got.append(data)
            assert sorted(map(len, got)) == [6, len(big)]

            graded = await store.pull_subscribe(busmod.STREAM_TRAJ_GRADED, "store")
            seen: list[bytes] = []
            while len(seen) < 2:
                for msg in await graded.fetch(2, timeout=5):
                    seen.append(await graded.resolve(msg))
                    await msg.ack()
                    await graded.discard_blob(msg)
            assert sorted(map(len, seen)) == [6, len(big)]

            for stream, durable in ((busmod.STREAM_TASKS, "rollout"), (busmod.STREAM_TRAJ_RAW, "grader"),
                                    (busmod.STREAM_TRAJ_GRADED, "store")):
                assert (await store.pending(stream, durable)).backlog == 0
                await store.stream_info(stream)
            await store.publish(busmod.SUBJECT_TASKS, b"task-2", msg_id="task-2")
            info = await store.stream_info(busmod.STREAM_TASKS)
            assert (await store.js.get_msg("TASKS", seq=info.state.first_seq)).data == b"task-2"
        finally:
            for b in (store, rollout, grader, learner):
                await b.close()

    asyncio.run(go())
    new_log = mesh.nats.log_path.read_text(errors="replace")[len(log_before):]
    assert "Violation" not in new_log, new_log[-3000:]


def test_namespaced_permissions_name_only_that_namespace() -> None:
    text = security.nats_authorization("run1")
    assert '"run1.trajmesh.tasks"' in text and "$JS.API.CONSUMER.MSG.NEXT.run1_TASKS.rollout" in text
    assert '"trajmesh.tasks"' not in text and "_INBOX_run1_rollout.>" in text
    perms = security.nats_permissions("rollout", "run1")
    assert "run1.trajmesh.weights" not in perms.publish and "run1.trajmesh.tasks" not in perms.publish
    assert security.nats_permissions("learner", "run1").publish[0] == "run1.trajmesh.weights"


def test_secrets_are_not_in_server_config_argv_or_url(mesh: _Mesh) -> None:
    conf = (mesh.nats.data_dir / "nats.conf").read_text()
    cmdlines = [Path(f"/proc/{pid}/cmdline").read_bytes() for pid in (mesh.nats.pid, mesh.redis.pid)]
    for secret in [*mesh.creds.nats_passwords.values(), mesh.creds.redis_password]:
        assert secret not in conf
        assert all(secret.encode() not in c for c in cmdlines)
    assert mesh.creds.redis_password not in mesh.redis.public_url
    assert mesh.creds.redis_password not in repr(mesh.creds)


def test_redis_requires_auth(mesh: _Mesh, monkeypatch: pytest.MonkeyPatch) -> None:
    anonymous = redis.Redis.from_url(mesh.redis.public_url)
    with pytest.raises(redis.exceptions.AuthenticationError):
        anonymous.ping()
    anonymous.close()
    wrong = redis.Redis.from_url(mesh.redis.public_url, password="wrong")
    with pytest.raises(redis.exceptions.AuthenticationError):
        wrong.ping()
    wrong.close()
    monkeypatch.setenv(security.ENV_REDIS_PASSWORD, mesh.creds.redis_password)
    cfg = mesh.cfg()
    assert mesh.creds.redis_password not in (cfg.infra.redis_url or "")
    client = security.redis_sync_client(cfg)
    assert client.ping()
    client.close()

    async def go() -> None:
        r = security.redis_client(cfg)
        assert await r.ping()
        await r.aclose()

    asyncio.run(go())


def test_credentials_file_is_private_and_stable(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    first = security.LocalCredentials.load_or_create(tmp_path)
    path = security.LocalCredentials.path(tmp_path)
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert security.LocalCredentials.load_or_create(tmp_path) == first  # --resume reuses it
    env = first.service_env("grader")
    assert env == {security.ENV_NATS_USER: "grader", security.ENV_NATS_PASSWORD: first.nats_passwords["grader"],
                   security.ENV_REDIS_PASSWORD: first.redis_password}
    assert first.service_env("environment") == {}
    # Without env vars, a tool on the run dir (the launcher, a test) falls back to the file.
    for name in (security.ENV_NATS_USER, security.ENV_NATS_PASSWORD, security.ENV_REDIS_PASSWORD):
        monkeypatch.delenv(name, raising=False)
        monkeypatch.delenv(f"{name}_FILE", raising=False)
    cfg = load_config(None, {"run_dir": str(tmp_path)})
    assert security.redis_password(cfg) == first.redis_password
    assert security.redis_password(load_config(None, {"run_dir": str(tmp_path),
                                                      "infra.security.redis_auth": False})) is None


def test_read_secret_from_env_or_file(tmp_path: Path) -> None:
    (tmp_path / "pw").write_text("from-file\n")
    assert security.read_secret("X", {"X": "v"}) == "v"
    assert security.read_secret("X", {"X_FILE": str(tmp_path / "pw")}) == "from-file"
    assert security.read_secret("X", {}) is None
    with pytest.raises(ValueError, match="only one"):
        security.read_secret("X", {"X": "v", "X_FILE": str(tmp_path / "pw")})


# --------------------------------------------------------------------------------------------
# TLS: a self-signed certificate for 127.0.0.1 made with openssl.


@pytest.fixture(scope="module")
def cert(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, str]:
    d = tmp_path_factory.mktemp("tls")
    crt, key = d / "cert.pem", d / "key.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1",
                    "-keyout", str(key), "-out", str(crt), "-subj", "/CN=127.0.0.1",
                    "-addext", "subjectAltName=IP:127.0.0.1,DNS:localhost"],
                   check=True, capture_output=True)
    return str(crt), str(key)


def test_nats_tls_with_auth(tmp_path: Path, cert: tuple[str, str], monkeypatch: pytest.MonkeyPatch) -> None:
    crt, key = cert
    creds = security.LocalCredentials.load_or_create(tmp_path / "run")
    server = NatsServer(tmp_path / "nats", authorization=security.nats_authorization(),
                        tls=security.nats_tls_block(crt, key), env=creds.nats_server_env())
    server.start()
    try:
        cfg = load_config(None, {"run_dir": str(tmp_path / "run"), "infra.nats_url": server.url,
                                 "infra.security.nats_tls": {"ca_file": crt}})
        for name in (security.ENV_NATS_USER, security.ENV_NATS_PASSWORD):
            monkeypatch.delenv(name, raising=False)

        async def go() -> None:
            bus = await security.connect_bus(cfg, "admin", name="tls-admin")  # credentials from the run's file
            assert bus.nc.connected_url is not None
            await bus.publish(busmod.SUBJECT_TASKS, b"over-tls")
            assert (await bus.stream_info(busmod.STREAM_TASKS)).state.messages == 1
            await bus.close()
            with pytest.raises((nats.errors.Error, OSError)):  # plain client: server requires TLS
                await nats.connect(server.url, user="admin", password=creds.nats_passwords["admin"],
                                   allow_reconnect=False, max_reconnect_attempts=0, connect_timeout=2)
            untrusted = load_config(None, {"run_dir": str(tmp_path / "run"), "infra.nats_url": server.url})
            with pytest.raises((nats.errors.Error, OSError)):  # TLS without trusting the CA: refused
                ctx = security.ssl_context(TlsConfig())
                await nats.connect(untrusted.infra.nats_url or "", tls=ctx, user="admin",
                                   password=creds.nats_passwords["admin"], allow_reconnect=False,
                                   max_reconnect_attempts=0, connect_timeout=2)

        asyncio.run(go())
    finally:
        server.stop()


async def _echo_server(method: str, handler: Any, tls: TlsConfig | None) -> tuple[Any, int]:
    """A started `security.grpc_server` answering ``/trajmesh.test.Echo/<method>`` with `handler`,
    listening on a free loopback port (TLS with `tls`): the server and its port."""
    import grpc

    server = security.grpc_server()
    server.add_generic_rpc_handlers([grpc.method_handlers_generic_handler(
        "trajmesh.test.Echo", {method: grpc.unary_unary_rpc_method_handler(handler)})])
    port = security.add_grpc_port(server, "127.0.0.1:0", tls)
    await server.start()
    return server, port


def test_grpc_tls_channel_and_server(cert: tuple[str, str]) -> None:
    import grpc

    crt, key = cert
    tls = TlsConfig(ca_file=None, cert_file=crt, key_file=key)
    client_tls = TlsConfig(ca_file=crt)

    async def ping(request: bytes, context: object) -> bytes:
        return b"pong:" + request

    async def go() -> None:
        server, port = await _echo_server("Ping", ping, tls)
        try:
            async with security.grpc_channel(f"127.0.0.1:{port}", client_tls) as channel:
                call = channel.unary_unary("/trajmesh.test.Echo/Ping")
                assert await call(b"hi", timeout=5) == b"pong:hi"
            async with security.grpc_channel(f"127.0.0.1:{port}", None) as plain:
                with pytest.raises(grpc.aio.AioRpcError):
                    await plain.unary_unary("/trajmesh.test.Echo/Ping")(b"hi", timeout=2)
        finally:
            await server.stop(grace=None)

    asyncio.run(go())


@pytest.mark.parametrize("tls_on", [False, True])
def test_grpc_messages_past_the_4_mib_default_go_both_ways(cert: tuple[str, str], tls_on: bool) -> None:
    """A learner batch of long trajectories is one NextBatch reply far above gRPC's default 4 MiB
    receive cap (bench/bench_mesh.py: 16.7 MB for 8 groups of 65,536 tokens). Our servers and
    channels take it, with TLS and without; gRPC's defaults fail it with RESOURCE_EXHAUSTED."""
    import grpc

    crt, key = cert
    server_tls = TlsConfig(ca_file=None, cert_file=crt, key_file=key) if tls_on else None
    client_tls = TlsConfig(ca_file=crt) if tls_on else None
    big = bytes(range(256)) * (24 * 1024 * 1024 // 256)  # 24 MiB each way

    async def echo(request: bytes, context: object) -> bytes:
        return request + b"!"

    async def go() -> None:
        server, port = await _echo_server("Big", echo, server_tls)
        try:
            async with security.grpc_channel(f"127.0.0.1:{port}", client_tls) as channel:
                assert await channel.unary_unary("/trajmesh.test.Echo/Big")(big, timeout=60) == big + b"!"
            if not tls_on:  # gRPC's default channel refuses the same reply
                async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as plain:
                    with pytest.raises(grpc.aio.AioRpcError) as err:
                        await plain.unary_unary("/trajmesh.test.Echo/Big")(big, timeout=60)
                    assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        finally:
            await server.stop(grace=None)

    asyncio.run(go())
