"""Mesh throughput vs raw JetStream, measured side by side in one run (issue: mesh benchmark (b)).

(a) raw: one process publishes N messages of the size of a synthetic trajectory to a JetStream
    stream while a pull consumer consumes them; messages per second, and CPU ms per message of that
    process and the nats-server.
(b) mesh: synthetic trajectories (4,096 tokens; `--tokens`) flow store → TASKS → rollout (synthetic engine; 1
    process by default, --rollouts; chain_sum's stateless environment played in that process, no
    environment RPC) → TRAJ_RAW → grader (1 process by default, --graders; chain_sum's verifier on
    the random text, which fails fast) → TRAJ_GRADED →
    store → gRPC NextBatch; this script plays the learner (NextBatch, Report, version + 1), so the
    gate keeps admitting. Trajectories per second reaching the learner. On 2 cores one process per
    service with 16 groups of 4 in flight beat two of each (more processes only compete for CPU).
(c) the same mesh with `store.replicas: 2` (--stores): each store owns half the groups, and the
    learner gathers each batch from both (services/store/client.py, the learner's own client).

(d) `--variants base,new --rounds N`: the one-store mesh N times per variant, alternating (base,
    new, base, new, ...), in one run: `base` with `store.pipelined_intake` off (a run of graded
    trajectories costs the store a lookup, a membership MULTI and a finish script per completed
    group), `new` with it on (the default: one script per run). Compare CPU ms per trajectory per
    process.

(e) `--tokens 4096,65536` (the default; issue #45 item 3): one-store mesh cells of each trajectory
    length, alternating, `--rounds` each (default 1), beside raw JetStream with the same payloads.
    Both run on a nats-server the bench starts with `--max-payload` (256 KiB by default, no NATS
    auth), so a 65,536-token trajectory (459 KB) travels through the object store by reference
    (`trajmesh/bus.py` `publish_large`, above `max_inline_bytes` = max_payload - 4 KiB) while a
    4,096-token one (29 KB) travels inline; raw JetStream sends its payloads through the same `Bus`,
    so its 64k messages take the same object-store path (put + reference, get, delete on ack). At
    nats-server's own 1 MiB default both lengths would travel inline (`--max-payload 0`: the
    launcher's server). 8 groups of 64k-token trajectories make a 16.7 MB NextBatch, past gRPC's
    default 4 MiB cap, which trajmesh's channels lift (`trajmesh/security.py`
    `GRPC_MESSAGE_OPTIONS`). The `--stores` cells (other than 1) run at the first length.

Prints per process CPU ms per trajectory and per 1k tokens received, trajectories/s,
`mesh_cpu_per_1k_tokens_65536_over_4096` (goal ≤ 1.5), `mesh_vs_raw_jetstream_ratio` (one store,
the first length; goal ≥ 0.3, issue #24) and `two_stores_vs_one_ratio` (goal ≥ 1.6). Both sides run on the same NATS server build,
on this machine, in the same run. It also prints each mesh process's CPU time per trajectory over
the measured window (Linux /proc: user + system): where the per-trajectory cost is, and whether a
change cut it. A busy machine disturbs it less than the rates, but it too grows under contention
(cache, context switches), so compare runs made side by side.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from trajmesh import bus as busmod
from trajmesh import security
from trajmesh.config import load_config
from trajmesh.contract import Trajectory
from trajmesh.gate import AsyncStalenessGate
from trajmesh.infra import NatsServer
from trajmesh.run.launcher import Mesh, start_mesh
from trajmesh.services.store.client import StoreClient
from trajmesh.v1 import services_pb2, trajectory_pb2
from trajmesh.weights import announce

TOKENS = 4096
"""Tokens of one trajectory in the mesh cells of `--stores` and `--variants` (`--tokens` sets the others')."""
MAX_PAYLOAD = 256 * 1024
"""`--max-payload` default (bytes): a 4,096-token trajectory (29 KB) travels inline and a 65,536-token
one (459 KB) through the object store; at nats-server's own default (1 MiB) both would travel inline."""
DEFAULT_MAX_PAYLOAD = 1024 * 1024
"""nats-server's own max_payload (the launcher's server: `--max-payload 0`)."""
GROUP_SIZE = 4


def _sample_bytes(tokens: int = TOKENS) -> bytes:
    t = Trajectory.new(trajectory_id="x" * 40)
    t.pb.task_id, t.pb.group_id = "t" * 24, "g" * 30
    t.append_prompt(list(range(8)))
    t.append_sampled([i % 20 for i in range(tokens - 8)], [-2.9] * (tokens - 8), 3)
    t.finish(trajectory_pb2.MAX_TOKENS)
    t.set_reward(0.0, components={"correct": 0.0, "format_eos": 0.0})
    return t.to_bytes()


async def raw_jetstream(url: str, n: int, payload: bytes, namespace: str = "rawbench",
                        nats_pid: int | None = None) -> tuple[float, dict[str, float]]:
    """Messages per second of `payload` published and consumed through JetStream (through the
    object store where it exceeds the server's max_payload, as the mesh's `Bus` sends it), and the
    CPU ms per message of this process and of the nats-server (`nats_pid`) over the same window."""
    bus = await busmod.connect(url, name="bench-raw", namespace=namespace)
    await bus.ensure_streams()
    consumer = await bus.pull_subscribe(busmod.STREAM_TRAJ_RAW, "bench")
    pids = {"bench client": os.getpid(), "nats-server": nats_pid}
    cpu0 = _cpu_snapshot(pids)
    start = time.perf_counter()

    async def produce() -> None:
        for i in range(n):
            await bus.publish(busmod.SUBJECT_TRAJ_RAW, payload, msg_id=f"m{i}")

    async def consume() -> None:
        got = 0
        while got < n:
            for msg in await consumer.fetch(batch=64, timeout=1.0):
                await consumer.resolve(msg)
                await msg.ack()
                got += 1

    await asyncio.gather(produce(), consume())
    elapsed = time.perf_counter() - start
    cpu1 = _cpu_snapshot(pids)
    await bus.close()
    return n / elapsed, _cpu_ms_per_item(cpu0, cpu1, n)


def inline(payload: bytes, max_payload: int) -> bool:
    """Whether the Bus sends `payload` inline on a server with `max_payload` (else through the object store)."""
    return len(payload) <= max_payload - busmod._HEADER_HEADROOM_BYTES


def _model_dir(root: Path) -> str:
    """Only the tokenizer matters here (the engine is synthetic); the demo's char tokenizer."""
    from trajmesh.learner.models import build_char_tokenizer

    build_char_tokenizer(root)
    (root / "config.json").write_text("{}")
    return str(root)


def _cpu_seconds(pid: int | None) -> float | None:
    """User + system CPU seconds of a live process (Linux /proc), None where unreadable."""
    if pid is None:
        return None
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime, stime (fields 14, 15)


def _mesh_pids(mesh: Mesh) -> dict[str, int | None]:
    pids: dict[str, int | None] = {p.label: p.popen.pid for p in mesh.procs}
    pids["nats-server"] = mesh.nats.pid if mesh.nats is not None else None
    pids["redis"] = mesh.redis.pid if mesh.redis is not None else None
    pids["bench learner"] = os.getpid()
    return pids


def _cpu_snapshot(pids: dict[str, int | None]) -> dict[str, float | None]:
    return {name: _cpu_seconds(pid) for name, pid in pids.items()}


def _cpu_ms_per_item(cpu0: dict[str, float | None], cpu1: dict[str, float | None], items: int) -> dict[str, float]:
    return {name: 1e3 * (after - before) / max(items, 1) for name, after in cpu1.items()
            if after is not None and (before := cpu0.get(name)) is not None}


async def play_learner(cfg, seconds: float, warmup: float,  # type: ignore[no-untyped-def]
                       pids: dict[str, int | None] | None = None) -> tuple[float, dict[str, float], float]:
    """Trajectories per second reaching the learner over `seconds` after `warmup`, the CPU
    milliseconds per trajectory of each process in `pids` over the same window, and the mean tokens
    of those trajectories (as received: prompt and response)."""
    r = security.redis_client(cfg)
    gate = AsyncStalenessGate.from_config(r, cfg)
    bus = await security.connect_bus(cfg, "learner", name="bench-learner")
    store = StoreClient(cfg, lambda call, request: call(request, timeout=60.0))
    version, counted, tokens, t0 = 0, 0, 0, None
    cpu0: dict[str, float | None] = {}
    start = time.perf_counter()
    while True:
        now = time.perf_counter()
        if t0 is None and now - start > warmup:
            t0, counted, tokens = now, 0, 0
            cpu0 = _cpu_snapshot(pids or {})
        if t0 is not None and now - t0 > seconds:
            break
        resp = await store.next_batch(version, timeout_s=10.0)
        ids = [t.trajectory_id for t in resp.trajectories]
        counted += len(ids)
        tokens += sum(len(Trajectory(t)) for t in resp.trajectories)  # the block's T (or the old fields')
        await store.report(services_pb2.ReportRequest(learner_version=version, trained_ids=ids),
                           {t.trajectory_id: t.group_id for t in resp.trajectories})
        version += 1
        # What a learner does after a step: announce the version (the synthetic engine loads nothing).
        await announce.publish(bus, announce.Announcement(version=version, path="synthetic"))
        await gate.set_version(version)
    elapsed = time.perf_counter() - (t0 or start)
    cpu_ms = _cpu_ms_per_item(cpu0, _cpu_snapshot(pids or {}), counted)
    await bus.close()
    await store.close()
    await r.aclose()
    return counted / elapsed, cpu_ms, tokens / max(counted, 1)


VARIANTS: dict[str, dict[str, object]] = {
    "base": {"store.pipelined_intake": False},
    "new": {},
}
"""--variants: config overrides of each (new: the defaults)."""


@dataclass
class MeshCell:
    """One measured mesh: its set-up and its figures."""

    stores: int
    tokens: int
    """Trajectory length the cell asked for (`tasks.sampling.max_new_tokens` = tokens - 8)."""
    rate: float
    """Trajectories per second reaching the learner."""
    cpu_ms: dict[str, float]
    """CPU ms per trajectory by process (the bench learner included)."""
    tokens_received: float
    """Mean tokens per trajectory the learner received (prompt and response)."""

    @property
    def mesh_ms(self) -> float:
        """CPU ms per trajectory of the mesh's processes (the bench learner left out)."""
        return sum(v for k, v in self.cpu_ms.items() if k != "bench learner")

    def per_1k(self, ms: float) -> float:
        """`ms` per trajectory as ms per 1,000 received tokens."""
        return 1e3 * ms / max(self.tokens_received, 1.0)


def mesh_cell(root: Path, args: argparse.Namespace, stores: int,
              over: dict[str, object] | None = None, tokens: int = TOKENS) -> MeshCell:
    """The mesh with `stores` store replicas, `tokens`-token trajectories and config overrides
    `over`. With `args.max_payload` the mesh runs on a nats-server this function starts with that
    max_payload (no NATS auth: the launcher's auth set-up is for the nats-server it starts)."""
    nats = NatsServer(root / "nats", max_payload=args.max_payload) if args.max_payload else None
    if nats is not None:
        nats.start()
    try:
        cfg = load_config(None, {**(over or {}),
            "run_dir": str(root / "run"), "model.path": _model_dir(root / "model"), "gate.eta": 2,
            "tasks.group_size": GROUP_SIZE, "tasks.train_size": 500, "tasks.heldout_size": 10,
            "tasks.sampling.max_new_tokens": tokens - 8, "rollout.engine.type": "synthetic",
            "rollout.replicas": args.rollouts, "rollout.concurrent_tasks": args.concurrent_tasks,
            "grader.replicas": args.graders, "store.drop_zero_variance_groups": False,
            "learner.batch_groups": args.batch_groups, "store.replicas": stores,
            **({"infra.nats_url": nats.url, "infra.security.nats_auth": False} if nats is not None else {}),
        })
        Path(cfg.run_dir).mkdir(parents=True)
        (Path(cfg.run_dir) / "manifest.json").write_text('{"manifest_id": "bench"}')
        mesh: Mesh = start_mesh(cfg, services=("environment", "store", "grader", "rollout"))
        pids = _mesh_pids(mesh)
        if nats is not None:
            pids["nats-server"] = nats.pid
        try:
            rate, cpu_ms, received = asyncio.run(play_learner(mesh.cfg, args.seconds, args.warmup, pids))
        finally:
            mesh.stop_services()
            mesh.stop_infra()
    finally:
        if nats is not None:
            nats.stop()
    return MeshCell(stores, tokens, rate, cpu_ms, received)


def _ints(text: str) -> list[int]:
    return [int(n) for n in text.split(",") if n]


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("--raw-messages", type=int, default=3000,
                    help=f"raw JetStream messages of {TOKENS} tokens (scaled down for longer trajectories)")
    ap.add_argument("--seconds", type=float, default=30.0)
    ap.add_argument("--warmup", type=float, default=5.0)
    ap.add_argument("--rollouts", type=int, default=1, help="rollout processes")
    ap.add_argument("--graders", type=int, default=1, help="grader processes")
    ap.add_argument("--concurrent-tasks", type=int, default=16, help="groups in flight per rollout process")
    ap.add_argument("--batch-groups", type=int, default=8, help="groups per learner batch")
    ap.add_argument("--tokens", type=_ints, default=[TOKENS, 16 * TOKENS],
                    help="trajectory lengths of the one-store cells, alternating, `--rounds` each")
    ap.add_argument("--stores", type=_ints, default=[1, 2],
                    help="store replicas of the mesh cells at the first --tokens (1: the token cells' own)")
    ap.add_argument("--max-payload", type=int, default=MAX_PAYLOAD,
                    help="nats-server max_payload in bytes, raw and mesh (0: the launcher's server, 1 MiB)")
    ap.add_argument("--variants", default="", help=f"compare these ({', '.join(VARIANTS)}) with one store, "
                    f"{TOKENS} tokens and the launcher's nats-server, alternating, instead of --stores and --tokens")
    ap.add_argument("--rounds", type=int, default=None,
                    help="cells per variant with --variants (default 2), per --tokens entry otherwise (default 1)")
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> float:
    args = parse_args(argv)
    if args.variants:
        args.max_payload = 0  # the launcher's own nats-server (with auth), as before --max-payload
        return compare_variants(args, _sample_bytes(), args.variants.split(","))
    rounds = args.rounds or 1
    payloads = {tokens: _sample_bytes(tokens) for tokens in args.tokens}
    cells: list[MeshCell] = []
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        raw = raw_cells(root, args, payloads)
        for k in range(rounds):
            for tokens in args.tokens:
                cells.append(mesh_cell(root / f"t{tokens}r{k}", args, 1, tokens=tokens))
                print_cell(cells[-1], args, payloads[tokens])
        for stores in (n for n in args.stores if n != 1):
            cells.append(mesh_cell(root / f"stores{stores}", args, stores, tokens=args.tokens[0]))
            print_cell(cells[-1], args, payloads[args.tokens[0]])
    return summarize(args, raw, cells, payloads)


def raw_cells(root: Path, args: argparse.Namespace,
              payloads: dict[int, bytes]) -> dict[int, tuple[float, dict[str, float]]]:
    """Raw JetStream at each trajectory length on one nats-server with `args.max_payload`:
    (messages/s, CPU ms per message by process). Longer payloads send proportionally fewer
    messages (at least 200)."""
    raw: dict[int, tuple[float, dict[str, float]]] = {}
    with NatsServer(root / "nats-raw", max_payload=args.max_payload or None) as nats:
        for tokens, payload in payloads.items():
            n = max(200, args.raw_messages * TOKENS // tokens)
            raw[tokens] = asyncio.run(raw_jetstream(nats.url, n, payload, f"raw{tokens}", nats.pid))
            path = "inline" if inline(payload, args.max_payload or DEFAULT_MAX_PAYLOAD) else "object store"
            rate, cpu_ms = raw[tokens]
            print(f"raw JetStream, {tokens} tokens ({len(payload)} bytes, {path}), {n} messages: {rate:.1f} msg/s; "
                  "CPU ms per message: " + _procs(cpu_ms) + f"; per 1k tokens: {_procs(cpu_ms, tokens)}",
                  flush=True)
    return raw


def _procs(cpu_ms: dict[str, float], tokens: float | None = None) -> str:
    scale = 1e3 / tokens if tokens else 1.0
    return ", ".join(f"{p} {v * scale:.3f}" for p, v in cpu_ms.items())


def print_cell(cell: MeshCell, args: argparse.Namespace, payload: bytes) -> None:
    path = "inline" if inline(payload, args.max_payload or DEFAULT_MAX_PAYLOAD) else "object store"
    print(f"mesh, {cell.stores} store replica(s), {cell.tokens}-token trajectories ({cell.tokens_received:.0f} "
          f"received, ~{len(payload)} bytes, {path}): {cell.rate:.1f} trajectories/s ({args.rollouts} rollout, "
          f"{args.graders} grader processes, {args.concurrent_tasks} groups of 4 in flight per rollout, "
          f"{args.batch_groups} groups per batch)\n"
          f"  CPU ms per trajectory (user + system): {_procs(cell.cpu_ms)}; mesh total (without the bench "
          f"learner) {cell.mesh_ms:.2f}\n"
          f"  CPU ms per 1k tokens: {_procs(cell.cpu_ms, cell.tokens_received)}; mesh total "
          f"{cell.per_1k(cell.mesh_ms):.3f}", flush=True)


def summarize(args: argparse.Namespace, raw: dict[int, tuple[float, dict[str, float]]],
              cells: list[MeshCell], payloads: dict[int, bytes]) -> float:
    """The medians per trajectory length, their ratios and goals; returns mesh / raw at the first length."""
    one = [c for c in cells if c.stores == 1]
    per_1k: dict[int, float] = {}
    rate: dict[int, float] = {}
    for tokens in args.tokens:
        mine = [c for c in one if c.tokens == tokens]
        per_1k[tokens] = statistics.median(c.per_1k(c.mesh_ms) for c in mine)
        rate[tokens] = statistics.median(c.rate for c in mine)
        raw_rate, raw_ms = raw[tokens]
        raw_total = sum(raw_ms.values())
        print(f"{tokens} tokens, median of {len(mine)} cell(s): mesh {rate[tokens]:.1f} trajectories/s, "
              f"{per_1k[tokens]:.3f} CPU ms per 1k tokens; raw JetStream {raw_rate:.1f} msg/s, "
              f"{1e3 * raw_total / tokens:.3f} CPU ms per 1k tokens (client + nats-server); "
              f"mesh_vs_raw_jetstream_ratio={rate[tokens] / raw_rate:.3f}, "
              f"mesh_over_raw_cpu_ratio={per_1k[tokens] / (1e3 * raw_total / tokens):.1f}")
    first, last = args.tokens[0], args.tokens[-1]
    if last != first:
        ratio = per_1k[last] / per_1k[first]
        print(f"mesh_cpu_per_1k_tokens_{last}_over_{first}={ratio:.3f} (goal <= 1.5: "
              f"{'met' if ratio <= 1.5 else 'NOT met'})")
    print(f"mesh_vs_raw_jetstream_ratio={rate[first] / raw[first][0]:.3f} ({first} tokens, one store; goal >= 0.3)")
    two = [c for c in cells if c.stores == 2]
    if two and first in rate:
        print(f"two_stores_vs_one_ratio={two[0].rate / rate[first]:.3f} (goal >= 1.6)")
    return rate[first] / raw[first][0]


def compare_variants(args: argparse.Namespace, payload: bytes, variants: list[str]) -> float:
    """`--variants`: one-store mesh cells alternating between the variants, `args.rounds` each;
    prints every cell and each variant's median CPU ms per trajectory by process. Returns the
    first variant's median mesh total over the last's."""
    cells: list[tuple[str, MeshCell]] = []
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        with NatsServer(root / "nats-raw") as nats:
            raw, _ = asyncio.run(raw_jetstream(nats.url, args.raw_messages, payload))
        for k in range(args.rounds or 2):
            for name in variants:
                cell = mesh_cell(root / f"{name}{k}", args, 1, VARIANTS[name])
                cells.append((name, cell))
                print(f"{name} round {k}: {cell.rate:.1f} trajectories/s; CPU ms per trajectory: "
                      + _procs(cell.cpu_ms), flush=True)
    print(f"raw JetStream publish+consume (before the cells): {raw:.1f} msg/s")
    totals: dict[str, float] = {}
    for name in variants:
        mine = [c for n, c in cells if n == name]
        procs = list(mine[0].cpu_ms)
        med = {p: statistics.median(c.cpu_ms.get(p, 0.0) for c in mine) for p in procs}
        totals[name] = sum(v for p, v in med.items() if p != "bench learner")
        print(f"{name}: median of {len(mine)} cells, CPU ms per trajectory: "
              + ", ".join(f"{p} {v:.2f}" for p, v in med.items())
              + f"; mesh total {totals[name]:.2f}; trajectories/s "
              + ", ".join(f"{c.rate:.1f}" for c in mine))
    ratio = totals[variants[0]] / totals[variants[-1]]
    print(f"mesh_cpu_{variants[0]}_over_{variants[-1]}={ratio:.3f}")
    return ratio


if __name__ == "__main__":
    main()
