"""Groups that end short of members hold their whole batch place in the gate (issue #41 item 1).

An in-process store against real NATS and Redis (no other service), driven the way a run drives it:
before each learner step it admits every group the gate lets in (at the gate's version) and takes
its members in; the learner then takes a batch, reports it trained and moves to the next version.

- Every group ends with 2 of its G = 3 members kept, the third quarantined at intake. The gate
  counts trajectories, a batch takes `learner.batch_groups` whole groups: if a short group's
  missing member freed its slot, each step would consume fewer trajectories than the B = 6 it
  opens, the gate would admit more groups than the steps take, and more due groups (admitted at
  ≤ v − η) than a batch holds would pile up (without `unfilled`: 3 due groups for a batch of 2 at
  every step from the second on). With the gate's `unfilled` the bound holds: never more due groups
  than a batch, every batch exactly `batch_groups`, nothing trained more than η behind, and the
  gate still reconciles with the archive (`accepted` = the accepted rows).
- With η = 2 the bound holds in total, not in order: groups that end out of their admission order
  can still leave more due groups than a batch holds in a healthy run (a newer group, ready first,
  took a place while two older ones were still sampling). The store hands every ready due group
  out in that step, past `batch_groups` (`StoreState.hand_out`), so none is trained stale.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
from contract_layouts import old_layout
from store_checks import graded, store_config, take

from trajmesh import bus as busmod
from trajmesh.contract import Trajectory
from trajmesh.infra import NatsServer, RedisServer
from trajmesh.services.store.archive import final_outcomes, read_archive
from trajmesh.services.store.repo import task_id_at
from trajmesh.services.store.service import TrajectoryStore
from trajmesh.v1 import services_pb2

pytestmark = [pytest.mark.timeout(240)]


async def _admit(store: TrajectoryStore, base: str, g: int) -> tuple[str, str, int]:
    """Admit one task of `g` samples at the gate's version, as the store does (asserting the gate let
    it in). Returns (task id, group id, admission version)."""
    version = await store.w.gate.version()
    cursor = await store.w.repo.next_cursor()
    task_id, gid = task_id_at(base, cursor), f"g{cursor}-{base}"
    record = {"group_id": gid, "group_size": g, "source": "chain_sum", "admitted_at_version": version,
              "cursor": cursor}
    assert await store.w.repo.try_admit(task_id, record, b"", g)
    return task_id, gid, version


async def _send(store: TrajectoryStore, task_id: str, gid: str, version: int, g: int, *,
                quarantined: int = 0) -> None:
    """Publish the task's members, sampled with `version`, rewards alternating 1, 0; the last
    `quarantined` of them break the contract (a log-prob without a token: `length_mismatch`) and
    are quarantined at intake. Takes them in."""
    for i in range(g):
        data = graded(task_id, gid, i, float(i % 2 == 0), version, g)
        if i >= g - quarantined:
            t = old_layout(Trajectory.from_bytes(data))  # the layout before the token block
            t.pb.behavior_logprobs.append(-1.0)
            data = t.to_bytes()
        await store.w.bus.publish(busmod.SUBJECT_TRAJ_GRADED, data, msg_id=f"{task_id}-{i}")
    await take(store, g)


async def _step(store: TrajectoryStore, version: int, batch_trajectories: int) -> list[Trajectory]:
    """The learner at `version`: a batch, reported trained, the gate at version + 1."""
    batch = await store.next_batch(version, batch_trajectories, timeout_s=10.0)
    assert batch, f"no batch at v{version}"
    await store.report(services_pb2.ReportRequest(learner_version=version,
                                                  trained_ids=[t.trajectory_id for t in batch]))
    await store._commit_final()
    await store.w.gate.set_version(version + 1)
    return batch


G, BATCH_GROUPS, KEPT = 3, 2, 2
STEPS = 6


def test_short_groups_leave_no_more_due_groups_than_a_batch(tmp_path: Path, nats_server: NatsServer,
                                                             redis_server: RedisServer, tiny_model_dir: str) -> None:
    eta = 1
    cfg = store_config(tmp_path, nats_server, redis_server, tiny_model_dir, **{
        "tasks.group_size": G, "learner.batch_groups": BATCH_GROUPS, "gate.eta": eta})
    b = cfg.batch_trajectories

    async def main() -> tuple[list[dict[str, int]], dict[str, int], int]:
        store = TrajectoryStore(cfg)
        await store.setup()
        steps: list[dict[str, int]] = []
        admitted_at: dict[str, int] = {}
        try:
            for v in range(STEPS):
                while await store.w.gate.capacity() >= G:  # the store's admission loop, members back at once
                    task_id, gid, at = await _admit(store, f"t{len(admitted_at)}", G)
                    admitted_at[gid] = at
                    await _send(store, task_id, gid, at, G, quarantined=G - KEPT)
                due = set(await store.w.repo.due_groups(v - eta))
                ready_due = due & {g.group_id for g in store.state.ready}
                batch = await _step(store, v, b)
                groups = {t.group_id for t in batch}
                steps.append({"v": v, "due": len(due), "ready_due": len(ready_due), "batch_groups": len(groups),
                              "max_lag": max(v - admitted_at[gid] for gid in groups)})
            c = await store.w.gate.counters()
            gate = {"accepted": c.accepted, "unfilled": c.unfilled, "running": c.running}
            return steps, gate, len(admitted_at)
        finally:
            await store.stop()

    steps, gate, n_groups = asyncio.run(main())
    # Never more due groups than a batch takes, so every batch is exactly a batch, none lagging.
    assert all(s["due"] <= BATCH_GROUPS for s in steps), steps
    assert [s["batch_groups"] for s in steps] == [BATCH_GROUPS] * STEPS, steps
    assert all(s["max_lag"] <= eta for s in steps), steps
    # The gate's bound in groups: admitting last at v = STEPS − 1, it opened (η + STEPS)·batch_groups
    # places, one per group.
    assert n_groups == (eta + STEPS) * BATCH_GROUPS, (n_groups, steps)
    # The gate still reconciles with the archive: `accepted` = the accepted rows (KEPT per group),
    # the short groups' other places in `unfilled`, nothing running.
    rows = read_archive(Path(cfg.run_dir) / "archive").to_pylist()
    accepted_rows = [r for r in rows if r["outcome"] == "accepted"]
    assert gate == {"accepted": len(accepted_rows), "unfilled": (G - KEPT) * n_groups, "running": 0}, gate
    assert len(accepted_rows) == KEPT * n_groups
    outcomes = [row["outcome"] for row in final_outcomes(read_archive(Path(cfg.run_dir) / "archive")).values()]
    assert outcomes.count("quarantined") == (G - KEPT) * n_groups
    assert outcomes.count("trained") == KEPT * STEPS * BATCH_GROUPS


def test_groups_ending_out_of_order_hand_out_every_due_group(tmp_path: Path, nats_server: NatsServer,
                                                            redis_server: RedisServer, tiny_model_dir: str) -> None:
    """η = 2, one group a batch, groups of 2. v0: the gate admits three groups, A, B, C; C is back
    first and trained at v0. v1: one more, D, back and trained (A and B still sampling, not due).
    v2: E admitted, A and B back: both due (admitted at v0 ≤ 2 − η), a batch holds one. Both are
    handed out at v2, lag 2 = η; the one left out would be trained at v3, stale."""
    eta, g = 2, 2
    cfg = store_config(tmp_path, nats_server, redis_server, tiny_model_dir, **{
        "tasks.group_size": g, "learner.batch_groups": 1, "gate.eta": eta})
    b = cfg.batch_trajectories

    async def main() -> tuple[list[str], set[str], list[str], int]:
        store = TrajectoryStore(cfg)
        await store.setup()
        try:
            a, bb, c = [await _admit(store, name, g) for name in ("a", "b", "c")]
            assert await store.w.gate.capacity() < g  # (η + 0 + 1)·B = 3 groups: full
            await _send(store, *c, g)
            assert [t.group_id for t in await _step(store, 0, b)] == [c[1]] * g
            d = await _admit(store, "d", g)
            await _send(store, *d, g)
            assert [t.group_id for t in await _step(store, 1, b)] == [d[1]] * g
            await _admit(store, "e", g)
            await _send(store, *a, g)
            await _send(store, *bb, g)
            due = set(await store.w.repo.due_groups(2 - eta))
            batch = await _step(store, 2, b)
            stale = [t.trajectory_id for t in batch if 2 - t.behavior_versions_T[t.loss_mask_T == 1].min() > eta]
            return [t.group_id for t in batch], due, stale, a[2]
        finally:
            await store.stop()

    batch_groups, due, stale, admitted_a = asyncio.run(main())
    assert admitted_a == 0 and len(due) == 2  # more due groups than the batch of one holds
    assert sorted(set(batch_groups)) == sorted(due) and len(batch_groups) == 2 * g, (batch_groups, due)
    assert stale == []
