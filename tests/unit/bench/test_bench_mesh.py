"""The mesh benchmark's trajectory lengths (bench/bench_mesh.py `--tokens`): which path each length
takes on the bench's nats-server, checked against a real server and the Bus; the per-1k-token figure."""

from __future__ import annotations

import asyncio
import importlib.util
import sys
from pathlib import Path

from repo_paths import REPO

from trajmesh import bus as busmod
from trajmesh.contract import Trajectory
from trajmesh.infra import NatsServer

_spec = importlib.util.spec_from_file_location("bench_mesh", REPO / "bench" / "bench_mesh.py")
assert _spec is not None and _spec.loader is not None
bm = importlib.util.module_from_spec(_spec)
sys.modules["bench_mesh"] = bm  # its dataclass resolves its module by name, as under bench/run.py
_spec.loader.exec_module(bm)


def test_tokens_option_sets_the_cells_lengths_and_defaults_to_4k_and_64k() -> None:
    assert bm.parse_args([]).tokens == [4096, 65536]
    args = bm.parse_args(["--tokens", "1024,2048,8192", "--stores", "1"])
    assert args.tokens == [1024, 2048, 8192] and args.stores == [1]
    assert len(Trajectory.from_bytes(bm._sample_bytes(1024))) == 1024
    assert len(Trajectory.from_bytes(bm._sample_bytes(65536))) == 65536


def test_64k_travels_through_the_object_store_and_4k_inline_on_the_bench_server(tmp_path: Path) -> None:
    """Raw JetStream through the real Bus: the blob bucket's stream takes chunks for the 64k payload
    only; at nats-server's default max_payload both would travel inline."""
    short, long = bm._sample_bytes(4096), bm._sample_bytes(65536)
    assert bm.inline(short, bm.MAX_PAYLOAD) and not bm.inline(long, bm.MAX_PAYLOAD)
    assert bm.inline(long, bm.DEFAULT_MAX_PAYLOAD)

    async def blob_chunks(url: str, namespace: str) -> int:
        bus = await busmod.connect(url, name="bench-mesh-test", namespace=namespace)
        info = await bus.js.stream_info(f"OBJ_{bus.layout.bucket(busmod.OBJ_BLOBS)}")
        assert bus.max_inline_bytes >= len(short)
        await bus.close()
        return int(info.state.last_seq)

    with NatsServer(tmp_path, max_payload=bm.MAX_PAYLOAD) as server:
        for payload, namespace in ((short, "short"), (long, "long")):
            rate, cpu_ms = asyncio.run(bm.raw_jetstream(server.url, 3, payload, namespace, server.pid))
            assert rate > 0 and set(cpu_ms) == {"bench client", "nats-server"}
        assert asyncio.run(blob_chunks(server.url, "short")) == 0
        assert asyncio.run(blob_chunks(server.url, "long")) > 3  # 3 blobs of several chunks and their metadata


def test_per_1k_tokens_divides_by_the_tokens_received() -> None:
    cell = bm.MeshCell(stores=1, tokens=65536, rate=9.0, tokens_received=64000.0,
                       cpu_ms={"store-0": 16.0, "nats-server": 8.0, "bench learner": 4.0})
    assert cell.mesh_ms == 24.0  # the bench learner is not the mesh
    assert cell.per_1k(cell.mesh_ms) == 24.0 / 64
