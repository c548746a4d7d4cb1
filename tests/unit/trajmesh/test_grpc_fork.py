"""A process that imported trajmesh can fork children while its event loop is inside gRPC calls.

gRPC core's fork handlers (on by default in grpcio 1.85) make such a fork racy: children died of
SIGABRT or SIGSEGV before their exec (a CI run lost the rollout's teacher engine this way). trajmesh
turns them off at import (trajmesh/__init__.py). The probe below forks /bin/true 150 times beside 8
calls in flight; without the setting, 23 of 150 (and 60 of 300) children died on this machine.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

PROBE = r"""
import trajmesh  # first: it must disable gRPC's fork handlers before grpc is imported
import asyncio, json, subprocess, grpc

async def echo(req, ctx):
    return req

async def main():
    server = grpc.aio.server()
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(
        "t.T", {"E": grpc.unary_unary_rpc_method_handler(echo)}),))
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
    call = channel.unary_unary("/t.T/E")
    stop = asyncio.Event()
    calls = [0]

    async def pound():
        while not stop.is_set():
            await call(b"x")
            calls[0] += 1

    tasks = [asyncio.create_task(pound()) for _ in range(8)]
    loop = asyncio.get_running_loop()
    codes = []
    for _ in range(150):  # preexec_fn: a real fork (no vfork), as the services' spawns do
        done = await loop.run_in_executor(None, lambda: subprocess.run(["/bin/true"], preexec_fn=lambda: None))
        codes.append(done.returncode)
        await asyncio.sleep(0)
    stop.set()
    await asyncio.gather(*tasks)
    await channel.close()
    await server.stop(None)
    print(json.dumps({"calls": calls[0], "died": [c for c in codes if c != 0]}))

asyncio.run(main())
"""


def test_children_forked_beside_grpc_calls_all_reach_their_exec() -> None:
    env = {k: v for k, v in os.environ.items() if k != "GRPC_ENABLE_FORK_SUPPORT"}
    done = subprocess.run([sys.executable, "-c", PROBE], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    seen = json.loads(done.stdout)
    assert seen["calls"] > 150, f"too few gRPC calls in flight beside the forks: {seen['calls']}"
    assert seen["died"] == [], f"{len(seen['died'])} of 150 children died before exec: {seen['died']}"
