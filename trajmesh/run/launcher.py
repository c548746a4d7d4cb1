"""The local launcher behind `trajmesh train` / `trajmesh up`: the whole mesh as local processes.

::

    train CONFIG
      ├─ model: config path, or the embedded demo model (tiny Llama + SFT warm start, cached)
      ├─ held-out accuracy before RL (greedy and T=1)
      ├─ nats-server -js and redis-server on free loopback ports, data under RUN_DIR/infra
      ├─ the judge engine, when judged sources give no judge.urls (judge_engine.py)
      ├─ trajmesh serve environment|store|grader|rollout|learner  (one process each replica),
      │  and the evaluator with eval.in_mesh
      ├─ watch: progress from metrics.jsonl; any service dying stops the run
      ├─ learner exits after its budget → stop services (SIGTERM by pid, then SIGKILL to each
      │  service's process group: engines and other children never outlive it) → stop NATS/Redis
      └─ held-out accuracy after RL, summary.json, metrics.png

Ctrl-C stops everything cleanly (the learner checkpoints on stop); `train --resume` continues.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import time
import urllib.request
import weakref
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from trajmesh import security
from trajmesh.config import ConfigError, RunConfig, dump_config
from trajmesh.infra import NatsServer, RedisServer, die_with_parent, free_port
from trajmesh.rollout.engines import HttpEngineConfig
from trajmesh.run.judge_engine import JudgeEngine, needs_judge_engine, with_judge_url
from trajmesh.service import STOP_NOTICE, stop_budget_s

log = logging.getLogger("trajmesh.run.launcher")

SERVICE_ORDER = ("environment", "store", "grader", "rollout", "evaluator", "learner")
ENGINE_SERVICES = ("rollout", "evaluator")
"""Services that start an engine of `rollout.engine` and are healthy once it is."""


class StartupError(RuntimeError):
    """A service did not become healthy at start. `line`: one line saying which, what failed and
    which log to read (what `trajmesh train` prints); `tail`: the end of that log. str(): both."""

    def __init__(self, line: str, tail: str = "") -> None:
        super().__init__(line + (f"\n{tail}" if tail else ""))
        self.line, self.tail = line, tail


@dataclass
class Proc:
    name: str
    replica: int
    popen: subprocess.Popen[bytes]
    metrics_port: int
    log_path: Path
    extra: list[str] = field(default_factory=list)
    env: dict[str, str] = field(default_factory=dict)
    """Extra environment (a learner rank's RANK, WORLD_SIZE, MASTER_ADDR/PORT...)."""

    @property
    def label(self) -> str:
        return f"{self.name}-{self.replica}"


@dataclass
class Mesh:
    """The processes of one local run, stopped by pid in reverse start order."""

    cfg: RunConfig
    config_path: Path
    procs: list[Proc] = field(default_factory=list)
    nats: NatsServer | None = None
    redis: RedisServer | None = None
    restarts: dict[tuple[str, int], int] = field(default_factory=dict)
    credentials: security.LocalCredentials | None = None
    """Generated passwords of this run (auth on); each service gets its own by environment."""
    judge_engine: JudgeEngine | None = None
    """The judge engine this mesh started (judged sources without ``judge.urls``), else None."""
    serve_cmd: list[str] = field(default_factory=lambda: [sys.executable, "-m", "trajmesh.run.cli", "serve"])
    """The command that serves one service, followed by: NAME --config PATH --replica N
    --metrics-port PORT [extra...] (`trajmesh serve`; a test may serve its own service)."""

    def start_service(self, name: str, replica: int, extra: list[str] | None = None,
                      env_extra: dict[str, str] | None = None) -> Proc:
        run_dir = Path(self.cfg.run_dir)
        port = free_port()
        log_path = run_dir / "logs" / f"{name}-{replica}.log"
        log_path.parent.mkdir(parents=True, exist_ok=True)
        cmd = [*self.serve_cmd, name, "--config", str(self.config_path),
               "--replica", str(replica), "--metrics-port", str(port), *(extra or [])]
        env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1",
               **(env_extra or {})}
        if self.credentials is not None:
            sec = self.cfg.infra.security
            env.update(self.credentials.service_env(name, nats=self.nats is not None and sec.nats_auth,
                                                    redis=self.redis is not None and sec.redis_auth))
        with open(log_path, "ab") as fh:
            # Own process group (the launcher stops it whole); SIGTERM when the launcher dies, even by
            # SIGKILL, so no service outlives the run that started it.
            popen = subprocess.Popen(cmd, stdout=fh, stderr=subprocess.STDOUT, env=env, start_new_session=True,
                                     preexec_fn=die_with_parent(signal.SIGTERM))
        proc = Proc(name, replica, popen, port, log_path, list(extra or []), dict(env_extra or {}))
        self.procs.append(proc)
        return proc

    def start_learners(self) -> list[Proc]:
        """The learner group: ``learner.world_size`` processes (replica = rank) with the standard
        torch.distributed environment (RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR=127.0.0.1 and a
        fresh MASTER_PORT per start); one process without it when the world is one rank."""
        world = self.cfg.learner.world_size
        if world == 1:
            return [self.start_service("learner", 0)]
        master = str(free_port())
        return [self.start_service("learner", rank, env_extra={
            "RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(world),
            "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": master}) for rank in range(world)]

    def startup_bound_s(self, procs: list[Proc]) -> float:
        """How long `procs` may take to become healthy: 180 s, or for rollouts (and the evaluator)
        their engine's start-up allowance (`rollout.engine.startup_timeout_s`: each is healthy once
        its engine is, and a vLLM server takes minutes on a loaded CPU) plus 60 s. vLLM servers that
        compile start one at a time on a machine (rollout/engines/vllm_engine.py `StartLock`) and each
        one's allowance counts from its own start, so the last of N queued ones may take N
        allowances: the bound is N × the allowance + 60 s."""
        engine = self.cfg.rollout.engine
        engine_wait = getattr(engine, "startup_timeout_s", None)
        engines = sum(1 for p in procs if p.name in ENGINE_SERVICES)
        if engine_wait is None or not engines:
            return 180.0
        queued = engines if queued_engine_starts(engine) else 1
        return max(180.0, queued * float(engine_wait) + 60.0)

    def wait_healthy(self, procs: list[Proc], timeout_s: float | None = None) -> None:
        """Wait until every process in `procs` answers healthy (bound: `startup_bound_s`); a
        `StartupError` naming the process and its log if one exits first or the bound passes."""
        if timeout_s is None:
            timeout_s = self.startup_bound_s(procs)
        deadline = time.monotonic() + timeout_s
        pending = list(procs)
        while pending:
            for p in list(pending):
                if p.name == "learner" and p.popen.poll() == 0:
                    pending.remove(p)  # finished already (e.g. a stop rule fired on its first step)
                    continue
                if p.popen.poll() is not None:
                    reason = failure_line(p.log_path)
                    raise StartupError(f"{p.label} exited with {p.popen.returncode} during start"
                                       + (f": {reason}" if reason else "") + f" (log: {p.log_path})",
                                       tail(p.log_path))
                if healthy(p.metrics_port):
                    pending.remove(p)
            if time.monotonic() > deadline:
                logs = ", ".join(str(p.log_path) for p in pending)
                raise StartupError(f"not healthy after {timeout_s:.0f}s: {', '.join(p.label for p in pending)} "
                                   f"(logs: {logs})")
            time.sleep(0.2)

    def dead(self) -> list[Proc]:
        return [p for p in self.procs if p.popen.poll() is not None]

    def restart_dead(self, max_restarts: int = 5) -> list[Proc]:
        """Restart every service process that died (a learner only if it failed: exit 0 is done),
        as Kubernetes would restart a pod. Returns the new processes; raises after `max_restarts`
        restarts of one service. The learner ranks are one group: one failed rank kills every
        rank's process group and the group starts again together (resuming from its checkpoint);
        the new ranks come back last, rank 0 last of all, so a caller keeping the last learner it
        sees watches the leader."""
        started = []
        for server in (self.nats, self.redis):  # same ports and data dir: state survives on disk
            if server is not None and not server.running:
                log.warning("%s died; restarting it", type(server).__name__)
                server.restart()
        if self.judge_engine is not None and not self.judge_engine.running:  # same port: the graders' URL holds
            log.warning("the judge engine died; restarting it")
            self.judge_engine.restart()
        failed_ranks = [p for p in self.dead() if p.name == "learner" and p.popen.returncode != 0]
        for p in self.dead():
            if p.name == "learner":
                continue
            key = (p.name, p.replica)
            self.restarts[key] = self.restarts.get(key, 0) + 1
            if self.restarts[key] > max_restarts:
                raise RuntimeError(f"{p.label} died {max_restarts + 1} times; last exit {p.popen.returncode}:\n"
                                   f"{tail(p.log_path)}")
            log.warning("%s exited with %s; restarting (%d)", p.label, p.popen.returncode, self.restarts[key])
            kill_group(p.popen)  # what the dead service started (its engine) dies with it
            self.procs.remove(p)
            started.append(self.start_service(p.name, p.replica, p.extra, p.env))
        if failed_ranks:
            key = ("learner", 0)
            self.restarts[key] = self.restarts.get(key, 0) + 1
            first = failed_ranks[0]
            if self.restarts[key] > max_restarts:
                raise RuntimeError(f"{first.label} died {max_restarts + 1} times; last exit {first.popen.returncode}:\n"
                                   f"{tail(first.log_path)}")
            group = [p for p in self.procs if p.name == "learner"]
            log.warning("%s exited with %s; restarting the learner group of %d (%d)", first.label,
                        first.popen.returncode, len(group), self.restarts[key])
            for p in group:  # every rank and whatever it started, whether it noticed the failure yet or not
                kill_group(p.popen)
                self.procs.remove(p)
            started.extend(reversed(self.start_learners()))
        return started

    def stop_services(self, grace_s: float = 30.0) -> None:
        """SIGTERM the learner first and wait for it (it finishes its step and reports it to the
        store, then checkpoints: with the store stopped at the same moment a trained step could go
        unreported), then every other service; each gets up to ``grace_s``, then SIGKILL of its whole
        process group (its engine and anything else it started), stopped in time or not."""
        learners = [p for p in self.procs if p.name == "learner"]
        self._stop(learners, grace_s, notice=Path(self.cfg.run_dir) / STOP_NOTICE)
        self._stop([p for p in self.procs if p.name != "learner"], grace_s)

    def _stop(self, procs: list[Proc], grace_s: float, *, notice: Path | None = None) -> None:
        """SIGTERM each of `procs`, wait up to `grace_s` or the service's own stop budget, whichever
        is longer (`trajmesh.service.stop_budget_s`: the store's finalization reads the whole archive
        and may take longer than `grace_s`; killed in it, it would leave outcomes unwritten), or,
        with `notice`, until the deadline the learner wrote there in answer to this SIGTERM (it is
        finishing a step); then SIGKILL the group."""
        signalled = time.time()
        for p in reversed(procs):
            if p.popen.poll() is None:
                p.popen.send_signal(signal.SIGTERM)
        start = time.monotonic()
        for p in reversed(procs):
            deadline = start + max(grace_s, stop_budget_s(p.name, self.cfg.service.stop_timeout_s))
            while p.popen.poll() is None:
                left = max(deadline, _notice_deadline(notice, p.popen.pid, signalled)) - time.monotonic()
                if left <= 0:
                    log.warning("%s did not stop in %.0fs; killing pid %d", p.label, time.time() - signalled,
                                p.popen.pid)
                    break
                try:
                    p.popen.wait(timeout=min(1.0, left))
                except subprocess.TimeoutExpired:
                    continue
            kill_group(p.popen)

    def stop_infra(self) -> None:
        if self.judge_engine is not None:
            self.judge_engine.stop()
        if self.nats is not None:
            self.nats.stop()
        if self.redis is not None:
            self.redis.stop()


def _notice_deadline(notice: Path | None, pid: int, signalled: float) -> float:
    """The monotonic deadline of a stop notice `pid` wrote after `signalled` (time.time()), capped at
    two hours; 0 when there is none (trajmesh.service.STOP_NOTICE)."""
    if notice is None:
        return 0.0
    try:
        record = json.loads(notice.read_text())
        if int(record["pid"]) != pid or notice.stat().st_mtime < signalled - 1.0:
            return 0.0
        left = min(float(record["deadline_unix"]) - time.time(), 7200.0)
    except (OSError, ValueError, KeyError, TypeError):
        return 0.0
    return time.monotonic() + left


_groups_killed: weakref.WeakSet[subprocess.Popen[bytes]] = weakref.WeakSet()


def kill_group(popen: subprocess.Popen[bytes]) -> None:
    """SIGKILL the process group a service leads (started with ``start_new_session``: its pgid is
    its pid) and reap the leader: children it started die with it even when they outlived it
    (a SIGKILLed service cannot stop its engine). Once per process: a later call never signals
    a group id the kernel may have handed to another process since."""
    if popen in _groups_killed:
        return
    try:
        os.killpg(popen.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass  # the leader and every member are gone already
    _groups_killed.add(popen)
    popen.wait()


def queued_engine_starts(engine: Any) -> bool:
    """Whether engine starts of this `rollout.engine` queue on one machine: a vLLM server that each
    process starts itself (no `url`) with `compile` on."""
    return getattr(engine, "type", None) == "vllm" and getattr(engine, "url", None) is None \
        and bool(getattr(engine, "compile", False))


def failure_line(path: Path) -> str:
    """Why a service failed, from its log: its ``<worker> failed: ...`` line (trajmesh/service.py
    `serve`, the last one), else the log's last non-empty line (e.g. a traceback's last), "" if none."""
    try:
        lines = [ln.strip() for ln in path.read_text(errors="replace").splitlines() if ln.strip()]
    except OSError:
        return ""
    line = next((ln for ln in reversed(lines) if " failed: " in ln), lines[-1] if lines else "")
    line = line.split(" ERROR ", 1)[-1]  # without the log record's time and logger
    return line if len(line) <= 600 else line[:600] + "…"


def healthy(port: int) -> bool:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=1.0) as r:
            return bool(r.status == 200)
    except OSError:
        return False


def tail(path: Path, lines: int = 30) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"


def start_mesh(cfg: RunConfig, *, services: tuple[str, ...] = SERVICE_ORDER) -> Mesh:
    """Start NATS/Redis (unless URLs are given) and the services (all by default; a benchmark may
    leave out the learner and play it itself); returns once all are healthy."""
    run_dir = Path(cfg.run_dir)
    infra = cfg.infra
    mesh = Mesh(cfg, run_dir / "config.resolved.yaml")
    sec = infra.security
    try:
        local_nats, local_redis = infra.nats_url is None, infra.redis_url is None
        if (local_nats and sec.nats_auth) or (local_redis and sec.redis_auth):
            mesh.credentials = security.LocalCredentials.load_or_create(run_dir)  # reused on --resume
        creds = mesh.credentials
        if local_nats:
            auth = creds is not None and sec.nats_auth
            mesh.nats = NatsServer(run_dir / "infra" / "nats",
                                   authorization=security.nats_authorization(
                                       infra.namespace, store_replicas=cfg.store.replicas) if auth else None,
                                   env=creds.nats_server_env() if auth and creds else None)
            mesh.nats.start()
        if local_redis:
            mesh.redis = RedisServer(run_dir / "infra" / "redis",
                                     password=creds.redis_password if creds and sec.redis_auth else None)
            mesh.redis.start()
        if needs_judge_engine(cfg):  # before the graders: they read its URL from the resolved config
            mesh.judge_engine = JudgeEngine.for_run(cfg).start()
            cfg = with_judge_url(cfg, mesh.judge_engine.url)
        env_ports = [free_port() for _ in range(cfg.environment.replicas)]
        stores = [f"127.0.0.1:{free_port()}" for _ in range(cfg.store.replicas)]
        resolved = cfg.model_copy(update={"infra": infra.model_copy(update={
            "nats_url": infra.nats_url or (mesh.nats.url if mesh.nats else None),
            "redis_url": infra.redis_url or (mesh.redis.public_url if mesh.redis else None),
            "store_address": stores[0],
            "store_addresses": stores if len(stores) > 1 else [],
            "environment_addresses": [f"127.0.0.1:{p}" for p in env_ports],
        })})
        mesh.cfg = resolved
        dump_config(resolved, mesh.config_path)
        _store_manifest_id(resolved)
        if mesh.nats is not None and creds is not None and sec.nats_auth:
            asyncio.run(security.provision(resolved))  # services may only bind, not create
        replicas = {"environment": cfg.environment.replicas, "store": cfg.store.replicas, "grader": cfg.grader.replicas,
                    "rollout": cfg.rollout.replicas, "evaluator": 1 if cfg.eval.in_mesh else 0, "learner": 0}
        # All at once, as pods on a cluster start: every service waits for what it needs (the
        # rollout for its environment and engine, the learner for batches), so no order is needed.
        started = []
        for name in SERVICE_ORDER:
            if name not in services:
                continue
            if name == "learner":
                started.extend(mesh.start_learners())
            for i in range(replicas[name]):
                extra = ["--grpc-port", str(env_ports[i])] if name == "environment" else []
                started.append(mesh.start_service(name, i, extra))
        mesh.wait_healthy(started)
    except BaseException:
        mesh.stop_services(grace_s=10)
        mesh.stop_infra()
        raise
    return mesh


def _store_manifest_id(cfg: RunConfig) -> None:
    from trajmesh.services.store.record import SyncRunRecord

    manifest = json.loads((Path(cfg.run_dir) / "manifest.json").read_text())
    assert cfg.infra.redis_url
    r = security.redis_sync_client(cfg)
    SyncRunRecord(r, cfg.infra.namespace).set_manifest_id(manifest["manifest_id"])
    r.close()


def accounting(cfg: RunConfig) -> dict[str, Any]:
    """Admitted trajectories (Redis) against final outcomes in the archive."""
    from trajmesh.services.store.archive import final_outcomes, read_archive
    from trajmesh.services.store.record import SyncRunRecord

    assert cfg.infra.redis_url
    r = security.redis_sync_client(cfg)
    record = SyncRunRecord(r, cfg.infra.namespace)
    admitted, refills = record.admitted_trajectories(), record.refills_admitted()
    r.close()
    table = read_archive(Path(cfg.run_dir) / "archive")
    finals = final_outcomes(table)
    counts: dict[str, int] = {}
    for row in finals.values():
        counts[row["outcome"]] = counts.get(row["outcome"], 0) + 1
    reasons: dict[str, int] = {}
    for row in finals.values():
        key = f"{row['outcome']}:{row['reason'] or '-'}"
        reasons[key] = reasons.get(key, 0) + 1
    unparseable = sum(1 for row in table.to_pylist() if not row["trajectory_id"])
    return {"admitted": admitted, "outcomes": counts, "by_reason": reasons, "unparseable_quarantined": unparseable,
            "infra_refills": refills}


def _reachable(url: str, default_port: int) -> bool:
    import socket
    from urllib.parse import urlparse

    u = urlparse(url)
    try:
        with socket.create_connection((u.hostname or "127.0.0.1", u.port or default_port), timeout=3.0):
            return True
    except OSError:
        return False


def _check_binaries(cfg: RunConfig) -> None:
    """The servers the launcher starts itself (no URL given) must be installed."""
    from trajmesh.infra import MissingBinaryError, nats_server_binary, redis_server_binary

    needed = [(cfg.infra.nats_url, "infra.nats_url", nats_server_binary),
              (cfg.infra.redis_url, "infra.redis_url", redis_server_binary)]
    for url, key, find in needed:
        if url is None:
            try:
                find()
            except MissingBinaryError as err:
                raise ConfigError(f"{err} (or set {key} to a running server)") from None


def _check_reachable(cfg: RunConfig) -> None:
    """Servers and an engine the config points at must answer on their ports."""
    infra, engine = cfg.infra, cfg.rollout.engine
    engine_url = engine.url if isinstance(engine, HttpEngineConfig) else None
    targets = [(infra.nats_url, "infra.nats_url", 4222, "infra.nats_url to let trajmesh start its own"),
               (infra.redis_url, "infra.redis_url", 6379, "infra.redis_url to let trajmesh start its own"),
               (engine_url, "rollout.engine.url", 80, "rollout.engine.url to use the built-in torch engine")]
    for url, key, port, alternative in targets:
        if url is not None and not _reachable(url, port):
            raise ConfigError(f"{key}: cannot reach {url} (start that server, or remove {alternative})")


def _check_model_and_packages(cfg: RunConfig) -> None:
    """The model directory exists (and the judge's, when the launcher is to serve it); the learner's
    packages (torch, transformers) are installed."""
    import importlib.util

    if cfg.model.path is not None and not (Path(cfg.model.path) / "config.json").exists():
        raise ConfigError(f"model.path: {cfg.model.path} is not a Hugging Face model directory (no config.json); "
                          "point it at one, or remove model.path to build the embedded demo model")
    if needs_judge_engine(cfg) and not (Path(cfg.judge.model_path or "") / "config.json").exists():
        raise ConfigError(f"judge.model_path: {cfg.judge.model_path} is not a Hugging Face model directory (no "
                          "config.json); the launcher serves it as the judge because judge.urls is empty")
    missing = [m for m in ("torch", "transformers", "safetensors") if importlib.util.find_spec(m) is None]
    if missing:
        raise ConfigError(f"the learner needs {', '.join(missing)}: run `make setup` "
                          "(or pip install -e '.[learner]')")


def preflight(cfg: RunConfig) -> None:
    """Fail fast, before any long work (SFT, evaluation), on what validation alone cannot see: every
    server binary the run starts, every server and engine port it connects to, the model directory
    and the learner's packages. Each failure is a ConfigError of one line naming the fix; the CLI
    prints it and exits with code 2."""
    _check_binaries(cfg)
    _check_reachable(cfg)
    _check_model_and_packages(cfg)


SHIPPED_DEMO_STARTS = Path(__file__).resolve().parents[2] / "examples" / "demo-start"
"""Warm starts shipped with the repository, one folder per demo-model key (see demo_model_name). SFT on
a CPU is not bit-reproducible across machines (BLAS kernels and thread counts change the sums), so the
demo's default start is shipped: every machine begins RL from the same weights."""


def demo_model_name(cfg: RunConfig) -> str:
    """The cache/shipped folder name of the demo model this config builds (dims, SFT, knobs, seed)."""
    import hashlib

    src = cfg.tasks.sources[0]
    knobs = getattr(src, "knobs", {})
    key = json.dumps({"demo": cfg.model.demo.model_dump(), "knobs": knobs, "seed": cfg.seed}, sort_keys=True)
    return f"demo-model-{hashlib.sha256(key.encode()).hexdigest()[:12]}"


def build_demo_model(cfg: RunConfig, dest: Path) -> None:
    """Tokenizer + tiny Llama + SFT warm start for ``cfg`` under ``dest`` (written atomically)."""
    from trajmesh.learner.models import prepare_demo_model

    d = cfg.model.demo
    knobs = getattr(cfg.tasks.sources[0], "knobs", {})
    log.info("building the demo model (tiny Llama + SFT) in %s", dest)
    tmp = dest.with_name(dest.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    stats = prepare_demo_model(tmp, seed=cfg.seed, demo=d, knobs=knobs or None)
    (tmp / "sft_stats.json").write_text(json.dumps({k: v for k, v in stats.items() if k != "losses"},
                                                   default=str, indent=1))
    shutil.rmtree(dest, ignore_errors=True)
    os.replace(tmp, dest)


def prepare_model(cfg: RunConfig) -> RunConfig:
    """The model dir to train: config's `model.path`, the shipped demo warm start when one matches the
    config, or the embedded demo model built once and cached under RUN_DIR/../.cache."""
    if cfg.model.path is not None:
        preflight(cfg)
        return cfg
    name = demo_model_name(cfg)
    sft_dir = SHIPPED_DEMO_STARTS / name / "sft"
    if (sft_dir / "config.json").exists():
        log.info("demo model: the shipped warm start %s", sft_dir)
    else:
        cache = Path(cfg.run_dir).parent / ".cache" / name
        sft_dir = cache / "sft"
        if not (sft_dir / "config.json").exists():
            build_demo_model(cfg, cache)
    return cfg.model_copy(update={"model": cfg.model.model_copy(update={"path": str(sft_dir.resolve())})})
