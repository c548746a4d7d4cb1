"""Mesh throughput vs raw JetStream, measured side by side in one run (issue: mesh benchmark (b)).

(a) raw: one process publishes N messages of the size of a synthetic 4,096-token trajectory to a
    JetStream stream while a pull consumer consumes them; messages per second.
(b) mesh: synthetic 4,096-token trajectories flow store → TASKS → rollout (synthetic engine; 1
    process by default, --rollouts; chain_sum's stateless environment played in that process, no
    environment RPC) → TRAJ_RAW → grader (1 process by default, --graders; chain_sum's verifier on
    the random text, which fails fast) → TRAJ_GRADED →
    store → gRPC NextBatch; this script plays the learner (NextBatch, Report, version + 1), so the
    gate keeps admitting. Trajectories per second reaching the learner. On 2 cores one process per
    service with 16 groups of 4 in flight beat two of each (more processes only compete for CPU).
(c) the same mesh with `store.replicas: 2` (--stores): each store owns half the groups, and the
    learner gathers each batch from both (services/store/client.py, the learner's own client).

(d) `--variants base,new --rounds N`: the one-store mesh N times per variant, alternating (base,
    new, base, new, ...), in one run: `base` with `rollout.stateless_environments_in_process` and
    `store.pipelined_admission` off (every episode Reset/Closed over gRPC, six Redis round trips
    per admission), `new` with both on (the defaults). Compare CPU ms per trajectory per process.

Prints `mesh_vs_raw_jetstream_ratio` (one store; goal ≥ 0.3, issue #24) and
`two_stores_vs_one_ratio` (goal ≥ 1.6). Both sides run on the same NATS server build,
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


def _sample_bytes() -> bytes:
    t = Trajectory.new(trajectory_id="x" * 40)
    t.pb.task_id, t.pb.group_id = "t" * 24, "g" * 30
    t.append_prompt(list(range(8)))
    t.append_sampled([i % 20 for i in range(TOKENS - 8)], [-2.9] * (TOKENS - 8), 3)
    t.finish(trajectory_pb2.MAX_TOKENS)
    t.set_reward(0.0, components={"correct": 0.0, "format_eos": 0.0})
    return t.to_bytes()


async def raw_jetstream(url: str, n: int, payload: bytes) -> float:
    bus = await busmod.connect(url, name="bench-raw", namespace="rawbench")
    await bus.ensure_streams()
    consumer = await bus.pull_subscribe(busmod.STREAM_TRAJ_RAW, "bench")
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
    await bus.close()
    return n / elapsed


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


async def play_learner(cfg, seconds: float, warmup: float,  # type: ignore[no-untyped-def]
                       pids: dict[str, int | None] | None = None) -> tuple[float, dict[str, float]]:
    """Trajectories per second reaching the learner over `seconds` after `warmup`, and the CPU
    milliseconds per trajectory of each process in `pids` over the same window."""
    r = security.redis_client(cfg)
    gate = AsyncStalenessGate.from_config(r, cfg)
    bus = await security.connect_bus(cfg, "learner", name="bench-learner")
    store = StoreClient(cfg, lambda call, request: call(request, timeout=60.0))
    version, counted, t0 = 0, 0, None
    cpu0: dict[str, float | None] = {}
    start = time.perf_counter()
    while True:
        now = time.perf_counter()
        if t0 is None and now - start > warmup:
            t0, counted = now, 0
            cpu0 = _cpu_snapshot(pids or {})
        if t0 is not None and now - t0 > seconds:
            break
        resp = await store.next_batch(version, timeout_s=10.0)
        ids = [t.trajectory_id for t in resp.trajectories]
        counted += len(ids)
        await store.report(services_pb2.ReportRequest(learner_version=version, trained_ids=ids),
                           {t.trajectory_id: t.group_id for t in resp.trajectories})
        version += 1
        # What a learner does after a step: announce the version (the synthetic engine loads nothing).
        await announce.publish(bus, announce.Announcement(version=version, path="synthetic"))
        await gate.set_version(version)
    elapsed = time.perf_counter() - (t0 or start)
    cpu1 = _cpu_snapshot(pids or {})
    cpu_ms = {name: 1e3 * (after - before) / max(counted, 1) for name, after in cpu1.items()
              if after is not None and (before := cpu0.get(name)) is not None}
    await bus.close()
    await store.close()
    await r.aclose()
    return counted / elapsed, cpu_ms


VARIANTS: dict[str, dict[str, object]] = {
    "base": {"rollout.stateless_environments_in_process": False, "store.pipelined_admission": False},
    "new": {},
}
"""--variants: config overrides of each (new: the defaults)."""


def mesh_cell(root: Path, args: argparse.Namespace, stores: int,
              over: dict[str, object] | None = None) -> tuple[float, dict[str, float]]:
    """The mesh with `stores` store replicas and config overrides `over`: (trajectories/s reaching
    the learner, CPU ms per trajectory by process)."""
    cfg = load_config(None, {**(over or {}),
        "run_dir": str(root / "run"), "model.path": _model_dir(root / "model"), "gate.eta": 2,
        "tasks.group_size": 4, "tasks.train_size": 500, "tasks.heldout_size": 10,
        "tasks.sampling.max_new_tokens": TOKENS - 8, "rollout.engine.type": "synthetic",
        "rollout.replicas": args.rollouts, "rollout.concurrent_tasks": args.concurrent_tasks,
        "grader.replicas": args.graders, "store.drop_zero_variance_groups": False,
        "learner.batch_groups": args.batch_groups, "store.replicas": stores,
    })
    Path(cfg.run_dir).mkdir(parents=True)
    (Path(cfg.run_dir) / "manifest.json").write_text('{"manifest_id": "bench"}')
    mesh: Mesh = start_mesh(cfg, services=("environment", "store", "grader", "rollout"))
    try:
        return asyncio.run(play_learner(mesh.cfg, args.seconds, args.warmup, _mesh_pids(mesh)))
    finally:
        mesh.stop_services()
        mesh.stop_infra()


def main(argv: list[str] | None = None) -> float:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--raw-messages", type=int, default=3000)
    ap.add_argument("--seconds", type=float, default=30.0)
    ap.add_argument("--warmup", type=float, default=5.0)
    ap.add_argument("--rollouts", type=int, default=1, help="rollout processes")
    ap.add_argument("--graders", type=int, default=1, help="grader processes")
    ap.add_argument("--concurrent-tasks", type=int, default=16, help="groups in flight per rollout process")
    ap.add_argument("--batch-groups", type=int, default=8, help="groups per learner batch")
    ap.add_argument("--stores", default="1,2", help="store replicas of each mesh cell, in run order")
    ap.add_argument("--variants", default="", help=f"compare these ({', '.join(VARIANTS)}) with one store, "
                    "alternating, instead of --stores")
    ap.add_argument("--rounds", type=int, default=2, help="cells per variant with --variants")
    args = ap.parse_args(argv)
    payload = _sample_bytes()
    if args.variants:
        return compare_variants(args, payload, args.variants.split(","))
    cells: dict[int, tuple[float, dict[str, float]]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        with NatsServer(root / "nats-raw") as nats:
            raw = asyncio.run(raw_jetstream(nats.url, args.raw_messages, payload))
        for stores in (int(n) for n in args.stores.split(",")):
            cells[stores] = mesh_cell(root / f"stores{stores}", args, stores)
    print(f"trajectory size: {len(payload)} bytes ({TOKENS} tokens)")
    print(f"raw JetStream publish+consume: {raw:.1f} msg/s")
    for stores, (rate, cpu_ms) in cells.items():
        print(f"mesh with {stores} store replica(s), rollout→grader→store→learner batch: {rate:.1f} trajectories/s "
              f"({args.rollouts} rollout, {args.graders} grader processes, {args.concurrent_tasks} groups of 4 in "
              f"flight per rollout, {args.batch_groups} groups per batch)")
        mesh_ms = sum(v for k, v in cpu_ms.items() if k != "bench learner")
        print("  CPU ms per trajectory (user + system): " + ", ".join(f"{k} {v:.2f}" for k, v in cpu_ms.items())
              + f"; mesh total (without the bench learner) {mesh_ms:.2f}")
    first = next(iter(cells.values()))[0]
    ratio = first / raw
    print(f"mesh_vs_raw_jetstream_ratio={ratio:.3f} ({next(iter(cells))} store replica(s); goal >= 0.3)")
    if 1 in cells and 2 in cells:
        print(f"two_stores_vs_one_ratio={cells[2][0] / cells[1][0]:.3f} (goal >= 1.6)")
    return ratio


def compare_variants(args: argparse.Namespace, payload: bytes, variants: list[str]) -> float:
    """`--variants`: one-store mesh cells alternating between the variants, `args.rounds` each;
    prints every cell and each variant's median CPU ms per trajectory by process. Returns the
    first variant's median mesh total over the last's."""
    cells: list[tuple[str, float, dict[str, float]]] = []
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        with NatsServer(root / "nats-raw") as nats:
            raw = asyncio.run(raw_jetstream(nats.url, args.raw_messages, payload))
        for k in range(args.rounds):
            for name in variants:
                rate, cpu_ms = mesh_cell(root / f"{name}{k}", args, 1, VARIANTS[name])
                cells.append((name, rate, cpu_ms))
                print(f"{name} round {k}: {rate:.1f} trajectories/s; CPU ms per trajectory: "
                      + ", ".join(f"{p} {v:.2f}" for p, v in cpu_ms.items()), flush=True)
    print(f"raw JetStream publish+consume (before the cells): {raw:.1f} msg/s")
    totals: dict[str, float] = {}
    for name in variants:
        mine = [c for c in cells if c[0] == name]
        procs = list(mine[0][2])
        med = {p: statistics.median(c[2].get(p, 0.0) for c in mine) for p in procs}
        totals[name] = sum(v for p, v in med.items() if p != "bench learner")
        print(f"{name}: median of {len(mine)} cells, CPU ms per trajectory: "
              + ", ".join(f"{p} {v:.2f}" for p, v in med.items())
              + f"; mesh total {totals[name]:.2f}; trajectories/s "
              + ", ".join(f"{c[1]:.1f}" for c in mine))
    ratio = totals[variants[0]] / totals[variants[-1]]
    print(f"mesh_cpu_{variants[0]}_over_{variants[-1]}={ratio:.3f}")
    return ratio


if __name__ == "__main__":
    main()
