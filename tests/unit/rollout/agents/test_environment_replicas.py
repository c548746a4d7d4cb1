"""`sticky_call`: the one replica walk of every rollout-side call to the environment service (an
episode's Reset, an agent's RunAgent, a hosted environment's Reset)."""

from __future__ import annotations

import asyncio
from typing import Any

import grpc
import pytest

from trajmesh.rollout.agents.environment_replicas import first_replica, sticky_call


def _error(code: grpc.StatusCode) -> grpc.aio.AioRpcError:
    return grpc.aio.AioRpcError(code, grpc.aio.Metadata(), grpc.aio.Metadata(), details=code.name)


class Replica:
    """Fails its first `down` calls with `code`, then answers its name."""

    def __init__(self, name: str, down: int = 0, code: grpc.StatusCode = grpc.StatusCode.UNAVAILABLE) -> None:
        self.name, self.down, self.code, self.calls = name, down, code, 0

    async def call(self) -> str:
        self.calls += 1
        if self.calls <= self.down:
            raise _error(self.code)
        return self.name


def _run(stubs: list[Replica], key: str, wait_s: float, **kw: Any) -> Any:
    return asyncio.run(sticky_call(stubs, key, lambda s: s.call(), wait_s=wait_s, **kw))


def test_a_key_starts_on_its_own_replica_and_moves_on_past_a_failed_one() -> None:
    keys = [f"session-{i}" for i in range(40)]
    assert {first_replica(k, 3) for k in keys} == {0, 1, 2}  # spread over the replicas
    key = next(k for k in keys if first_replica(k, 3) == 1)
    stubs = [Replica("a"), Replica("b"), Replica("c")]
    assert _run(stubs, key, 0.0, failed=lambda exc: True) == (stubs[1], "b")
    assert [s.calls for s in stubs] == [0, 1, 0]
    failures: list[grpc.StatusCode] = []
    stubs = [Replica("a"), Replica("b", down=1), Replica("c")]
    assert _run(stubs, key, 0.0, failed=lambda exc: failures.append(exc.code()) is None) == (stubs[2], "c")
    assert failures == [grpc.StatusCode.UNAVAILABLE] and [s.calls for s in stubs] == [0, 1, 1]


def test_while_no_replica_answers_it_backs_off_until_one_does_or_the_wait_ends() -> None:
    waits: list[float] = []
    stubs = [Replica("a", down=3), Replica("b", down=3)]  # both away for three rounds
    assert _run(stubs, "k", 30.0, failed=lambda exc: True, waited=waits.append)[1] in ("a", "b")
    assert waits == [0.2, 0.4, 0.8]  # doubling backoff between rounds
    waits.clear()
    stubs = [Replica("a", down=10**6)]
    assert _run(stubs, "k", 0.5, failed=lambda exc: True, waited=waits.append) is None
    assert sum(waits) == pytest.approx(0.5, abs=0.05) and stubs[0].calls == len(waits) + 1
    assert _run([], "k", 10.0, failed=lambda exc: True) is None


def test_a_config_error_or_a_refused_retry_is_raised_at_once() -> None:
    stubs = [Replica("a", down=1, code=grpc.StatusCode.INVALID_ARGUMENT), Replica("b")]
    with pytest.raises(grpc.aio.AioRpcError) as err:
        _run(stubs, next(f"k{i}" for i in range(20) if first_replica(f"k{i}", 2) == 0), 30.0, failed=lambda exc: True)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and stubs[1].calls == 0
    stubs = [Replica("a", down=1), Replica("b", down=1)]
    with pytest.raises(grpc.aio.AioRpcError) as err:  # e.g. an agent that already ran: no second run
        _run(stubs, "k", 30.0, failed=lambda exc: False)
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE and sum(s.calls for s in stubs) == 1
