"""The one place a run's config becomes a gate (`from_config`): both gate types get the run's keys,
the effective η (0 in sync mode), B and the concurrency cap (two of the five places that built a
gate by hand used to drop `gate.max_concurrent`)."""

from __future__ import annotations

import redis
import redis.asyncio

from trajmesh.config import load_config
from trajmesh.gate import AsyncStalenessGate, StalenessGate
from trajmesh.services.store.keys import RedisKeys


def test_from_config_maps_the_run_config() -> None:
    cfg = load_config(None, {"gate.eta": 3, "gate.max_concurrent": 40, "learner.batch_groups": 5,
                             "tasks.group_size": 4, "infra.namespace": "ns1"})
    for gate in (StalenessGate.from_config(redis.Redis(), cfg),
                 AsyncStalenessGate.from_config(redis.asyncio.Redis(), cfg)):
        spec = gate._spec
        assert (gate.eta, gate.batch_size, spec.max_concurrent) == (3, 20, 40)
        assert spec.key_prefix == RedisKeys("ns1").gate_prefix


def test_sync_mode_has_no_lag() -> None:
    cfg = load_config(None, {"mode": "sync", "gate.eta": 3})
    assert StalenessGate.from_config(redis.Redis(), cfg).eta == 0
