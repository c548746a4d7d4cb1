"""One call on a session's sticky environment replica, shared by every caller of the environment
service from the rollout side: an episode's Reset (services/rollout.py), an agent's RunAgent and a
hosted environment's Reset (rollout/agents/agent_episodes.py).

::

    sha256(key) % replicas ── call(stub) ── reply ──▶ (stub, reply)
         │ infrastructure error (UNAVAILABLE, DEADLINE_EXCEEDED, ...): `failed(exc)` counts it and
         │   says whether to go on (False: re-raised, e.g. an agent that already ran)
         ▼ the next replica ... none answered: back off (0.2 s doubling to 2 s) and try them all
           again, until `wait_s` has passed ──▶ None
    INVALID_ARGUMENT (a config error: an unknown environment, no agent hook) is raised at once.

The same key always starts on the same replica, so a session's calls meet the replica that holds
its state while that replica lives.
"""

from __future__ import annotations

import asyncio
import hashlib
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, TypeVar

import grpc

R = TypeVar("R")

BACKOFF_FIRST_S = 0.2
BACKOFF_MAX_S = 2.0


def first_replica(key: str, replicas: int) -> int:
    """The sticky replica of `key` among `replicas`."""
    return int(hashlib.sha256(key.encode()).hexdigest(), 16) % replicas


async def sticky_call(stubs: Sequence[Any], key: str, call: Callable[[Any], Awaitable[R]], *, wait_s: float,
                      failed: Callable[[grpc.aio.AioRpcError], bool],
                      waited: Callable[[float], None] | None = None) -> tuple[Any, R] | None:
    """`call(stub)` on `key`'s sticky replica of `stubs`, the next ones on an infrastructure error,
    all of them again with backoff while none answers for `wait_s` (`waited` is told of each wait).
    None: no replica answered by then (or `stubs` is empty)."""
    if not stubs:
        return None
    first = first_replica(key, len(stubs))
    deadline = time.monotonic() + wait_s
    delay = BACKOFF_FIRST_S
    while True:
        for k in range(len(stubs)):
            stub = stubs[(first + k) % len(stubs)]
            try:
                return stub, await call(stub)
            except grpc.aio.AioRpcError as exc:
                if exc.code() == grpc.StatusCode.INVALID_ARGUMENT or not failed(exc):
                    raise
        left = deadline - time.monotonic()
        if left <= 0:
            return None
        pause = min(delay, left)
        if waited is not None:
            waited(pause)
        await asyncio.sleep(pause)  # backoff while the environment is away
        delay = min(delay * 2, BACKOFF_MAX_S)
