"""The staleness gate against a real redis-server: hand-worked admission, atomicity, recovery."""

from __future__ import annotations

import asyncio
import random
import threading
from collections.abc import Iterator

import pytest
import redis
import redis.asyncio

from trajmesh.gate import AsyncStalenessGate, StalenessGate
from trajmesh.infra import RedisServer


@pytest.fixture
def client(redis_server: RedisServer) -> Iterator[redis.Redis]:
    r = redis.Redis.from_url(redis_server.url)
    try:
        yield r
    finally:
        r.close()


def _build_gate(client: redis.Redis, **kw: int) -> StalenessGate:
    params = {"eta": 1, "batch_size": 4} | kw
    return StalenessGate(client, key_prefix="run0:gate", **params)


def test_hand_worked_admission_sequence(client: redis.Redis) -> None:
    gate = _build_gate(client)  # eta=1, B=4
    # v=0: capacity (1 + 0 + 1)·4 − 0 = 8.
    assert gate.capacity() == 8 and gate.version() == 0
    assert gate.try_admit(4)  # running 4, capacity 4
    assert gate.try_admit(4)  # running 8, capacity 0
    assert not gate.try_admit(4)
    assert not gate.try_admit(1)
    c = gate.counters()
    assert (c.version, c.accepted, c.running, c.capacity) == (0, 0, 8, 0)
    # One group trained-to-be, one filtered out (frees its capacity).
    gate.finish(4, accepted=True)  # accepted 4, running 4, capacity 0
    assert gate.capacity() == 0
    gate.finish(4, accepted=False)  # running 0, capacity 4
    assert gate.capacity() == 4
    assert gate.try_admit(4)
    assert not gate.try_admit(1)
    # The learner steps to v=1: capacity (1+1+1)·4 − (4 + 4) = 4, exactly B more.
    assert gate.set_version(1) == 1
    assert gate.capacity() == 4
    assert gate.try_admit(3)
    assert not gate.try_admit(2)
    assert gate.try_admit(1)
    assert gate.counters().as_dict() == {"version": 1, "accepted": 4, "running": 8, "capacity": 0, "unfilled": 0}
    # Version is monotone.
    assert gate.set_version(0) == 1
    assert gate.version() == 1


def test_max_concurrent_caps_running(client: redis.Redis) -> None:
    gate = _build_gate(client, eta=4, max_concurrent=6)  # staleness capacity 20, fleet cap 6
    assert gate.capacity() == 6
    assert gate.try_admit(4)
    assert not gate.try_admit(4)
    assert gate.try_admit(2)
    gate.finish(4, accepted=True)
    assert gate.capacity() == 4


def test_invalid_arguments_are_refused(client: redis.Redis) -> None:
    gate = _build_gate(client)
    with pytest.raises(ValueError):
        gate.try_admit(0)
    with pytest.raises(ValueError):
        _build_gate(client, batch_size=0)
    with pytest.raises(ValueError):
        _build_gate(client, eta=-1)


def test_concurrent_admission_never_exceeds_bound(client: redis.Redis, redis_server: RedisServer) -> None:
    eta, batch_size, n_threads, tries = 2, 8, 8, 200
    violations: list[str] = []
    totals = {"admitted": 0, "accepted": 0}
    lock = threading.Lock()

    def worker(seed: int) -> None:
        rng = random.Random(seed)
        r = redis.Redis.from_url(redis_server.url)
        gate = StalenessGate(r, key_prefix="run0:gate", eta=eta, batch_size=batch_size)
        admitted = accepted = 0
        for _ in range(tries):
            n = rng.randint(1, 4)
            if gate.try_admit(n):
                admitted += n
                snap = gate.counters()  # one MGET: a consistent snapshot
                if snap.accepted + snap.running > (eta + snap.version + 1) * batch_size:
                    violations.append(repr(snap))
                ok = rng.random() < 0.5
                gate.finish(n, accepted=ok)
                accepted += n if ok else 0
            elif rng.random() < 0.05:
                # Some worker plays learner now and then: the version only moves forward.
                gate.set_version(gate.version() + 1)
        r.close()
        with lock:
            totals["admitted"] += admitted
            totals["accepted"] += accepted

    threads = [threading.Thread(target=worker, args=(seed,)) for seed in range(n_threads)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    assert not any(t.is_alive() for t in threads)
    assert violations == []
    final = _build_gate(client, eta=eta, batch_size=batch_size).counters()
    assert final.running == 0
    assert final.accepted == totals["accepted"]
    assert final.accepted <= (eta + final.version + 1) * batch_size
    assert totals["admitted"] > 0


def test_concurrent_admission_fills_capacity_exactly(client: redis.Redis, redis_server: RedisServer) -> None:
    """Without finishes, racing admits of 1 succeed exactly (eta + 1)·B times in total."""
    wins: list[int] = []

    def worker() -> None:
        r = redis.Redis.from_url(redis_server.url)
        gate = StalenessGate(r, key_prefix="run1:gate", eta=1, batch_size=4)
        wins.append(sum(gate.try_admit(1) for _ in range(50)))
        r.close()

    threads = [threading.Thread(target=worker) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    assert sum(wins) == 8


def test_rebase_after_recovery(client: redis.Redis) -> None:
    gate = _build_gate(client)  # eta=1, B=4
    gate.set_version(5)
    for _ in range(6):
        assert gate.try_admit(4)
    for _ in range(4):
        gate.finish(4, accepted=True)
    # Crash: accepted 16, running 8 (two groups in flight), v=5. The learner resumes from v=3.
    gate.rebase_after_recovery(3)
    c = gate.counters()
    assert (c.version, c.accepted, c.running) == (3, 12, 0)
    assert c.capacity == (1 + 3 + 1) * 4 - 12 == 2 * 4  # (eta + 1)·B again
    # A finish for work admitted before the rebase never drives running negative.
    gate.finish(4, accepted=False)
    assert gate.counters().running == 0
    # Trajectories the store still buffers count as accepted.
    gate.rebase_after_recovery(3, buffered=5)
    assert gate.counters().accepted == 17


def test_unfilled_places_take_capacity_and_a_rebase_clears_them(client: redis.Redis) -> None:
    """`unfilled` (the places of kept groups their members did not fill, written by the store's
    finish_group) counts in the capacity like `accepted`, in the admission script and the snapshot."""
    gate = _build_gate(client)  # eta=1, B=4: capacity 8
    client.set(gate.spec.unfilled_key, 3)
    c = gate.counters()
    assert (c.unfilled, c.capacity) == (3, 8 - 3) and gate.capacity() == 5
    assert not gate.try_admit(6)
    assert gate.try_admit(5)
    assert gate.capacity() == 0
    gate.rebase_after_recovery(0)
    assert gate.counters().unfilled == 0 and gate.capacity() == 8


def test_counters_survive_redis_restart(redis_server: RedisServer) -> None:
    r = redis.Redis.from_url(redis_server.url)
    gate = StalenessGate(r, key_prefix="run0:gate", eta=1, batch_size=4)
    gate.set_version(2)
    assert gate.try_admit(4) and gate.try_admit(3)
    gate.finish(4, accepted=True)
    before = gate.counters()
    r.close()

    redis_server.restart()

    r = redis.Redis.from_url(redis_server.url)
    gate = StalenessGate(r, key_prefix="run0:gate", eta=1, batch_size=4)
    assert gate.counters() == before
    assert (before.version, before.accepted, before.running) == (2, 4, 3)
    assert gate.try_admit(1)  # scripts are re-registered transparently after the restart
    r.close()


def test_async_gate_matches_sync_gate(redis_server: RedisServer) -> None:
    async def body() -> None:
        r = redis.asyncio.Redis.from_url(redis_server.url)
        gate = AsyncStalenessGate(r, key_prefix="run2:gate", eta=1, batch_size=4)
        assert await gate.capacity() == 8
        results = await asyncio.gather(*(gate.try_admit(1) for _ in range(12)))
        assert sum(results) == 8
        await gate.finish(4, accepted=True)
        await gate.finish(4, accepted=False)
        assert await gate.set_version(1) == 1
        assert await gate.capacity() == 8
        await gate.rebase_after_recovery(1)
        c = await gate.counters()
        assert (c.version, c.accepted, c.running) == (1, 4, 0)
        await r.aclose()

    asyncio.run(asyncio.wait_for(body(), 30))
