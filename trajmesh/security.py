"""Who may do what on the mesh, and where the secrets come from (docs/SECURITY.md).

::

    launcher (local run)                                   service process (role = its name)
      credentials.json (0600, RUN_DIR/infra) ──env──▶  TRAJMESH_NATS_USER / TRAJMESH_NATS_PASSWORD
      │                                                 TRAJMESH_REDIS_PASSWORD   (or *_FILE: a path)
      ├─ nats.conf: one user per role, passwords as $VARS from nats-server's environment
      ├─ redis: default user with a SHA-256 password hash (no plaintext on disk or in argv)
      └─ admin user provisions streams/KV/object store; services only bind to them

    connect_bus(cfg, role) ── user/password from env (or the run's credentials file) + TLS ──▶ NATS
    redis_client(cfg)      ── password from env (or the credentials file), never from the URL file

Secrets never go into a config file, a URL written to disk, a log line or a metric: they travel in
environment variables (or files mounted by the orchestrator, named by ``*_FILE``) and are injected
at connect time. Every role's NATS permissions are an allow list (:func:`nats_permissions`); the
server refuses everything else.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import secrets
import ssl
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

if TYPE_CHECKING:
    import grpc
    import redis
    import redis.asyncio

    from trajmesh.bus import Bus
    from trajmesh.config import RunConfig, TlsConfig

__all__ = [
    "CREDENTIALS_FILE",
    "ENV_NATS_PASSWORD",
    "ENV_NATS_USER",
    "ENV_REDIS_PASSWORD",
    "NATS_ROLES",
    "LocalCredentials",
    "Permissions",
    "Role",
    "add_grpc_port",
    "connect_bus",
    "grpc_channel",
    "inbox_prefix",
    "nats_authorization",
    "nats_permissions",
    "nats_tls_block",
    "provision",
    "read_secret",
    "redis_client",
    "redis_password",
    "redis_sync_client",
    "ssl_context",
]

log = logging.getLogger("trajmesh.security")

Role = Literal["admin", "store", "rollout", "grader", "learner", "evaluator", "environment"]
# Roles with a NATS user. The environment service never talks to NATS.
NATS_ROLES: tuple[Role, ...] = ("admin", "store", "rollout", "grader", "learner", "evaluator")

# Environment variables a service reads its credentials from; NAME_FILE names a file holding it.
ENV_NATS_USER = "TRAJMESH_NATS_USER"
ENV_NATS_PASSWORD = "TRAJMESH_NATS_PASSWORD"
ENV_REDIS_PASSWORD = "TRAJMESH_REDIS_PASSWORD"
# nats-server reads each role's password from this variable of its own environment ($VAR in nats.conf).
_ENV_NATS_SERVER_PASSWORD = "TRAJMESH_NATS_PASSWORD_{role}"
# The launcher's generated credentials, relative to the run dir (mode 0600).
CREDENTIALS_FILE = Path("infra") / "credentials.json"
# Random bytes per generated password (64 hex digits after a letter prefix).
_PASSWORD_BYTES = 32
# How long a service that may not create streams waits for the admin to provision them.
_BIND_TIMEOUT_S = 60.0


def _new_password() -> str:
    """A random password that nats-server reads back from ``$VAR`` as a string: it parses the
    variable's value as a config value, so a leading digit or '-' would make it a number."""
    return "tm" + secrets.token_hex(_PASSWORD_BYTES)


def read_secret(name: str, env: Mapping[str, str] | None = None) -> str | None:
    """The secret in environment variable ``name``, or the contents of the file named by
    ``name_FILE`` (a mounted secret; one trailing newline stripped); None when neither is set."""
    env = os.environ if env is None else env
    value, path = env.get(name), env.get(f"{name}_FILE")
    if value and path:
        raise ValueError(f"both {name} and {name}_FILE are set: set only one")
    if value:
        return value
    if path:
        text = Path(path).read_text()
        return text[:-1] if text.endswith("\n") else text
    return None


# --------------------------------------------------------------------------------------------
# NATS permissions


@dataclass(frozen=True)
class Permissions:
    """Subjects a NATS user may publish to and subscribe to (allow lists; everything else denied)."""

    publish: tuple[str, ...]
    subscribe: tuple[str, ...]


def inbox_prefix(role: str, namespace: str = "") -> str:
    """Reply-subject prefix of a role: each user subscribes only to its own inboxes, so no service
    can read another's JetStream replies (pulled messages arrive on the puller's inbox)."""
    return f"_INBOX_{namespace}_{role}" if namespace else f"_INBOX_{role}"


def _consume(stream: str, durable: str) -> list[str]:
    """Bind a pull subscriber to durable ``durable`` on ``stream`` and ack/nak/extend its messages."""
    api = "$JS.API.CONSUMER"
    return [f"{api}.CREATE.{stream}.{durable}", f"{api}.CREATE.{stream}.{durable}.>",
            f"{api}.INFO.{stream}.{durable}", f"{api}.MSG.NEXT.{stream}.{durable}",
            f"$JS.ACK.{stream}.{durable}.>", f"$JS.API.STREAM.INFO.{stream}"]


def _read_stream(stream: str) -> list[str]:
    """Stream info and single-message reads (KV get, object-store metadata, oldest-message age)."""
    return [f"$JS.API.STREAM.INFO.{stream}", f"$JS.API.STREAM.MSG.GET.{stream}",
            f"$JS.API.DIRECT.GET.{stream}", f"$JS.API.DIRECT.GET.{stream}.>"]


def _watch_stream(stream: str) -> list[str]:
    """Ephemeral ordered consumers (KV watch, object-store chunk reads) with flow control."""
    return [f"$JS.API.CONSUMER.CREATE.{stream}", f"$JS.API.CONSUMER.CREATE.{stream}.>",
            f"$JS.API.CONSUMER.INFO.{stream}.>", f"$JS.API.CONSUMER.DELETE.{stream}.>", f"$JS.FC.{stream}.>"]


def nats_permissions(role: Role, namespace: str = "", store_replicas: int = 1) -> Permissions:
    """The allow lists of ``role`` for the mesh in ``namespace`` with ``store_replicas`` store
    partitions (see the matrix in docs/SECURITY.md).

    store: publishes TASKS; consumes TRAJ_GRADED; reads the backlog of every work queue.
    rollout: consumes TASKS; publishes TRAJ_RAW; reads and watches the weights KV; writes its
      ``anchor_request`` key (``weights.sync: delta``).
    grader: consumes TRAJ_RAW; publishes TRAJ_GRADED; answers the evaluator's grading requests
      (subscribes to ``trajmesh.grade.eval``, replies on the evaluator's inboxes).
    learner: the only writer of weights (KV ``latest`` + WEIGHTS stream); reads the EVAL records.
    evaluator: reads and watches the weights KV; publishes EVAL; asks the graders to grade its
      episodes (``trajmesh.grade.eval``; it never touches the training streams).
    store, rollout, grader: read/write the blob object store (large messages travel through it).
    admin: everything (the launcher/operator provisions streams and inspects the run).
    """
    from trajmesh import bus as busmod
    from trajmesh.weights import announce

    if role == "admin":
        return Permissions(publish=(">",), subscribe=(">",))
    if role not in NATS_ROLES:
        raise ValueError(f"role {role!r} has no NATS user; roles with one: {', '.join(NATS_ROLES)}")
    lay = busmod.Layout(namespace)
    tasks, raw, graded = (lay.stream(s) for s in (busmod.STREAM_TASKS, busmod.STREAM_TRAJ_RAW,
                                                   busmod.STREAM_TRAJ_GRADED))
    kv_bucket, obj_bucket = lay.bucket(busmod.KV_WEIGHTS), lay.bucket(busmod.OBJ_BLOBS)
    kv_stream, obj_stream = f"KV_{kv_bucket}", f"OBJ_{obj_bucket}"
    eval_stream = lay.stream(busmod.STREAM_EVAL)
    blobs = [f"$O.{obj_bucket}.>", *_read_stream(obj_stream), *_watch_stream(obj_stream),
             f"$JS.API.STREAM.PURGE.{obj_stream}", "$JS.API.STREAM.NAMES"]  # get() looks the stream up by subject
    pub: list[str]
    n = store_replicas
    if role == "store":
        consume = [p for k in range(n) for p in _consume(graded, busmod.store_durable(k, n))]
        pub = [lay.subject(busmod.SUBJECT_TASKS), *consume, *blobs]
        for stream, durable in ((tasks, "rollout"), (raw, "grader")):
            pub.append(f"$JS.API.CONSUMER.INFO.{stream}.{durable}")
        for stream in (tasks, raw, graded):
            pub += _read_stream(stream)
    elif role == "rollout":
        pub = [lay.subject(busmod.SUBJECT_TRAJ_RAW), *_consume(tasks, "rollout"), *blobs,
               *_read_stream(kv_stream), *_watch_stream(kv_stream), f"$KV.{kv_bucket}.{announce.ANCHOR_REQUEST_KEY}"]
    elif role == "grader":
        pub = [*(lay.subject(busmod.graded_subject(k, n)) for k in range(n)), *_consume(raw, "grader"), *blobs,
               f"{inbox_prefix('evaluator', namespace)}.>"]
    elif role == "evaluator":
        pub = [lay.subject(busmod.SUBJECT_EVAL), f"$JS.API.STREAM.INFO.{eval_stream}",
               *_read_stream(kv_stream), *_watch_stream(kv_stream), lay.subject(busmod.SUBJECT_EVAL_GRADE)]
    else:  # learner
        pub = [lay.subject(busmod.SUBJECT_WEIGHTS), f"$KV.{kv_bucket}.{announce.LATEST_KEY}",
               *_read_stream(kv_stream), f"$JS.API.STREAM.INFO.{lay.stream(busmod.STREAM_WEIGHTS)}",
               *_read_stream(eval_stream), *_watch_stream(eval_stream)]
    sub = [f"{inbox_prefix(role, namespace)}.>"]
    if role == "grader":
        sub.append(lay.subject(busmod.SUBJECT_EVAL_GRADE))
    return Permissions(publish=tuple(dict.fromkeys(pub)), subscribe=tuple(sub))


def nats_authorization(namespace: str = "", users: Mapping[Role, str] | None = None, store_replicas: int = 1) -> str:
    """An ``authorization { users = [...] }`` block for nats.conf with one user per NATS role.

    Passwords are not in the text: each is ``$TRAJMESH_NATS_PASSWORD_<ROLE>``, which nats-server
    resolves from its own environment (see :meth:`LocalCredentials.nats_server_env`). ``users`` maps
    a role to its user name (default: the role's name).
    """
    entries = []
    for role in NATS_ROLES:
        perms = nats_permissions(role, namespace, store_replicas)
        user = (users or {}).get(role, role)
        var = _ENV_NATS_SERVER_PASSWORD.format(role=role.upper())
        entries.append(
            f"    {{user: {json.dumps(user)}, password: ${var}, permissions: {{\n"
            f"      publish: {{allow: {json.dumps(list(perms.publish))}}},\n"
            f"      subscribe: {{allow: {json.dumps(list(perms.subscribe))}}}\n"
            f"    }}}}"
        )
    return "authorization {\n  users = [\n" + ",\n".join(entries) + "\n  ]\n}\n"


def nats_tls_block(cert_file: str, key_file: str, ca_file: str | None = None, *, verify: bool = False) -> str:
    """A nats.conf ``tls {...}`` block: serve TLS with cert/key; with ``verify`` require client
    certificates signed by ``ca_file``."""
    lines = [f"  cert_file: {json.dumps(cert_file)}", f"  key_file: {json.dumps(key_file)}"]
    if ca_file:
        lines.append(f"  ca_file: {json.dumps(ca_file)}")
    if verify:
        lines.append("  verify: true")
    return "tls {\n" + "\n".join(lines) + "\n}\n"


# --------------------------------------------------------------------------------------------
# Generated credentials of a local run


@dataclass(frozen=True)
class LocalCredentials:
    """Random passwords for one local run: one per NATS role and one for Redis.

    Stored at RUN_DIR/infra/credentials.json with mode 0600 and reused on ``--resume``, so a NATS
    or Redis server restarted in the same data dir accepts the same clients. This file is the only
    place in the run dir a secret is written.
    """

    nats_passwords: Mapping[str, str]
    redis_password: str

    @staticmethod
    def path(run_dir: str | Path) -> Path:
        return Path(run_dir) / CREDENTIALS_FILE

    @classmethod
    def generate(cls) -> LocalCredentials:
        return cls({role: _new_password() for role in NATS_ROLES}, _new_password())

    @classmethod
    def load(cls, run_dir: str | Path) -> LocalCredentials | None:
        """The run's credentials, None when the run has none (auth off or an external setup)."""
        path = cls.path(run_dir)
        try:
            data = json.loads(path.read_text())
        except FileNotFoundError:
            return None
        return cls(dict(data["nats"]), str(data["redis"]))

    @classmethod
    def load_or_create(cls, run_dir: str | Path) -> LocalCredentials:
        """Reuse the run's credentials (resume) or generate and store new ones (created 0600)."""
        existing = cls.load(run_dir)
        if existing is not None and set(existing.nats_passwords) >= set(NATS_ROLES):
            return existing
        creds = cls.generate()
        path = cls.path(run_dir)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(path.name + ".tmp")
        tmp.unlink(missing_ok=True)
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as fh:
            json.dump({"nats": dict(creds.nats_passwords), "redis": creds.redis_password}, fh)
        os.replace(tmp, path)
        return creds

    def nats_server_env(self) -> dict[str, str]:
        """Environment of nats-server: the password variables its nats.conf refers to."""
        return {_ENV_NATS_SERVER_PASSWORD.format(role=r.upper()): p for r, p in self.nats_passwords.items()}

    def service_env(self, role: str, *, nats: bool = True, redis: bool = True) -> dict[str, str]:
        """Environment variables carrying ``role``'s credentials to its process."""
        env: dict[str, str] = {}
        if nats and role in self.nats_passwords:
            env[ENV_NATS_USER] = role
            env[ENV_NATS_PASSWORD] = self.nats_passwords[role]
        if redis and role != "environment":
            env[ENV_REDIS_PASSWORD] = self.redis_password
        return env

    def __repr__(self) -> str:  # never print a secret by accident
        return f"LocalCredentials(nats_roles={sorted(self.nats_passwords)}, redis=<hidden>)"


# --------------------------------------------------------------------------------------------
# Clients


def _nats_credentials(cfg: RunConfig, role: str) -> tuple[str | None, str | None]:
    """(user, password): from the environment, else the run's generated credentials, else none."""
    user, password = read_secret(ENV_NATS_USER), read_secret(ENV_NATS_PASSWORD)
    if user or password:
        return user, password
    local = LocalCredentials.load(cfg.run_dir) if cfg.infra.security.nats_auth else None
    if local is not None and role in local.nats_passwords:
        return role, local.nats_passwords[role]
    return None, None


def redis_password(cfg: RunConfig) -> str | None:
    """Redis password: from the environment, else the run's generated credentials, else none."""
    password = read_secret(ENV_REDIS_PASSWORD)
    if password is None and cfg.infra.security.redis_auth:
        local = LocalCredentials.load(cfg.run_dir)
        password = local.redis_password if local is not None else None
    return password


def _retrying(asyncio_client: bool) -> dict[str, Any]:
    """Ride out a Redis restart: reconnect and retry a command for ~30 s with backoff."""
    from redis.asyncio.retry import Retry as AsyncRetry
    from redis.backoff import ExponentialBackoff
    from redis.exceptions import ConnectionError as RedisConnectionError
    from redis.exceptions import TimeoutError as RedisTimeoutError
    from redis.retry import Retry

    retry_cls = AsyncRetry if asyncio_client else Retry
    return {"retry": retry_cls(ExponentialBackoff(cap=2.0, base=0.1), 20),
            "retry_on_error": [RedisConnectionError, RedisTimeoutError, OSError]}


def redis_client(cfg: RunConfig) -> redis.asyncio.Redis:
    """An asyncio Redis client for ``infra.redis_url`` with the password injected at connect time
    (a password already inside the URL, e.g. from a Helm entrypoint, wins)."""
    import redis.asyncio

    assert cfg.infra.redis_url, "infra.redis_url is not set"
    return redis.asyncio.Redis.from_url(cfg.infra.redis_url, password=redis_password(cfg), **_retrying(True))


def redis_sync_client(cfg: RunConfig) -> redis.Redis:
    """A blocking Redis client (launcher, tools, tests), credentials as in :func:`redis_client`."""
    import redis

    assert cfg.infra.redis_url, "infra.redis_url is not set"
    return redis.Redis.from_url(cfg.infra.redis_url, password=redis_password(cfg), **_retrying(False))


def ssl_context(tls: TlsConfig, *, server: bool = False) -> ssl.SSLContext:
    """A TLS context from cert/key/CA paths: trusts ``ca_file`` (system roots without it) and
    presents ``cert_file``/``key_file`` (client certificate for mutual TLS, or the server's own)."""
    purpose = ssl.Purpose.CLIENT_AUTH if server else ssl.Purpose.SERVER_AUTH
    ctx = ssl.create_default_context(purpose, cafile=tls.ca_file)
    if tls.cert_file and tls.key_file:
        ctx.load_cert_chain(tls.cert_file, tls.key_file)
    return ctx


async def connect_bus(cfg: RunConfig, role: Role, name: str) -> Bus:
    """Connect to NATS as ``role`` (credentials from env/file, TLS from ``infra.security.nats_tls``).

    Who creates streams: without credentials (an open server) every service creates them as
    before (idempotent); with credentials only the admin creates them (:func:`provision`, run by
    the launcher before any service starts) and every other role binds, waiting for them.
    """
    from trajmesh import bus as busmod

    assert cfg.infra.nats_url, "infra.nats_url is not set"
    user, password = _nats_credentials(cfg, role)
    tls_cfg = cfg.infra.security.nats_tls
    bus = await busmod.connect(
        cfg.infra.nats_url, name=name, user=user, password=password,
        tls=ssl_context(tls_cfg) if tls_cfg is not None else None,
        namespace=cfg.infra.namespace, inbox_prefix=inbox_prefix(role, cfg.infra.namespace),
        max_deliveries=cfg.infra.max_deliveries,
    )
    try:
        if user is None or role == "admin":
            await bus.ensure_streams()
        else:
            await _bind(bus, role)
    except BaseException:
        await bus.close()
        raise
    return bus


async def _bind(bus: Bus, role: Role, timeout_s: float = _BIND_TIMEOUT_S) -> None:
    """Wait until the streams ``role`` uses exist (the admin provisions them)."""
    import nats.js.errors

    from trajmesh import bus as busmod

    needs = {"store": (busmod.STREAM_TASKS, busmod.STREAM_TRAJ_GRADED),
             "rollout": (busmod.STREAM_TASKS,), "grader": (busmod.STREAM_TRAJ_RAW,),
             "learner": (busmod.STREAM_WEIGHTS, busmod.STREAM_EVAL),
             "evaluator": (busmod.STREAM_EVAL,)}.get(role, ())
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    for stream in needs:
        while True:
            try:
                await bus.stream_info(stream)
                break
            except nats.js.errors.NotFoundError:
                if loop.time() > deadline:
                    raise RuntimeError(f"stream {stream} does not exist after {timeout_s:.0f}s: with NATS auth "
                                       "on, the admin creates streams (python -m trajmesh.security provision "
                                       "CONFIG, or `trajmesh train`)") from None
                # Stream creation has no event this role may subscribe to; short poll with a deadline.
                await asyncio.sleep(0.5)


async def provision(cfg: RunConfig) -> None:
    """As admin, create or update every stream, the weights KV and the blob object store."""
    bus = await connect_bus(cfg, "admin", name="trajmesh-admin")
    await bus.close()


GRPC_MESSAGE_OPTIONS = [("grpc.max_receive_message_length", -1), ("grpc.max_send_message_length", -1)]
"""Every trajmesh gRPC channel and server: no message size cap below protobuf's own 2 GiB. gRPC's
default receive cap, 4 MiB, refused a learner batch of long trajectories (RESOURCE_EXHAUSTED: 8
groups of 65,536-token trajectories make a 16.7 MB NextBatch; bench/bench_mesh.py), and a 7B
run's batch of 512 trajectories of 32k tokens is about 230 MB."""


def grpc_server() -> grpc.aio.Server:
    """An asyncio gRPC server with `GRPC_MESSAGE_OPTIONS` (listen with `add_grpc_port`)."""
    import grpc

    return grpc.aio.server(options=GRPC_MESSAGE_OPTIONS)


def grpc_channel(address: str, tls: TlsConfig | None) -> grpc.aio.Channel:
    """An asyncio gRPC channel with `GRPC_MESSAGE_OPTIONS`: insecure without ``tls`` (the local
    default), else TLS verifying the server against ``ca_file`` and presenting
    ``cert_file``/``key_file`` when both are set."""
    import grpc

    if tls is None:
        return grpc.aio.insecure_channel(address, options=GRPC_MESSAGE_OPTIONS)
    root = Path(tls.ca_file).read_bytes() if tls.ca_file else None
    key = Path(tls.key_file).read_bytes() if tls.key_file else None
    chain = Path(tls.cert_file).read_bytes() if tls.cert_file else None
    creds = grpc.ssl_channel_credentials(root_certificates=root, private_key=key, certificate_chain=chain)
    options = [("grpc.ssl_target_name_override", tls.server_name)] if tls.server_name else []
    return grpc.aio.secure_channel(address, creds, options=[*GRPC_MESSAGE_OPTIONS, *options])


def add_grpc_port(server: grpc.aio.Server, address: str, tls: TlsConfig | None) -> int:
    """Listen on ``address``: insecure without ``tls``, else TLS with ``cert_file``/``key_file``,
    requiring client certificates signed by ``ca_file`` when it is set. Returns the bound port."""
    import grpc

    if tls is None:
        return int(server.add_insecure_port(address))
    if not (tls.cert_file and tls.key_file):
        raise ValueError("gRPC TLS needs cert_file and key_file on the serving side")
    pair = (Path(tls.key_file).read_bytes(), Path(tls.cert_file).read_bytes())
    root = Path(tls.ca_file).read_bytes() if tls.ca_file else None
    creds = grpc.ssl_server_credentials([pair], root_certificates=root, require_client_auth=root is not None)
    return int(server.add_secure_port(address, creds))


def _main(argv: list[str] | None = None) -> int:
    """`python -m trajmesh.security provision CONFIG` | `nats-conf [--namespace NS]`."""
    import argparse

    from trajmesh.config import load_config

    parser = argparse.ArgumentParser(prog="python -m trajmesh.security")
    sub = parser.add_subparsers(dest="command", required=True)
    p_prov = sub.add_parser("provision", help="create the streams as admin (credentials from env)")
    p_prov.add_argument("config")
    p_conf = sub.add_parser("nats-conf", help="print the nats.conf authorization block")
    p_conf.add_argument("--namespace", default="")
    p_conf.add_argument("--store-replicas", type=int, default=1)
    args = parser.parse_args(argv)
    if args.command == "provision":
        asyncio.run(provision(load_config(args.config)))
    else:
        print(nats_authorization(args.namespace, store_replicas=args.store_replicas), end="")
    return 0


if __name__ == "__main__":
    raise SystemExit(_main())
