"""Infra failures refill the sample, not the group (issue 41 item 4), with real processes.

A short run (real NATS JetStream and Redis, every service a process) whose environment service
fails the Reset of a quarter of the sessions (`environment.inject_reset_failure_rate`, chosen by a
hash of the session id: a retry of the same session fails again, a new sample of the task may
not). Each such sample ends INFRA_FAILURE with cause INFRA_ENVIRONMENT; the store archives it
`failed_infra:infra_environment` and admits a refill of its task in its place (a new trajectory,
sample index G + k). Checks: a group with one infra-failed member trains on G samples, one of them
its refill; every group with no more failures than the cap trains on G; the refills are counted
(Redis, the accounting the summary reports) and each is one more admitted trajectory with its own
final outcome; the accounting is exact (`check_archive`, `check_gate_reconciles`). With the refill
off (`store.infra_refills_per_group: 0`) the same check fails: such groups train on G − 1.
"""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path

import pytest
from mesh_checks import train_to_end

from trajmesh.config import load_config
from trajmesh.services.store.archive import final_outcomes, read_archive

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(600)]

G = 4
CAP = 2


def _sample_index(trajectory_id: str) -> int:
    return int(trajectory_id.rpartition("-")[2])


def test_a_group_with_an_infra_failed_member_trains_on_g_samples(tmp_path: Path, tiny_model_dir: str) -> None:
    cfg = load_config(None, {
        "run_dir": str(tmp_path / "run"), "model.path": tiny_model_dir, "gate.eta": 1,
        "tasks.group_size": G, "tasks.heldout_size": 20, "tasks.train_size": 300,
        "tasks.sampling.max_new_tokens": 6, "store.drop_zero_variance_groups": False,
        "environment.inject_reset_failure_rate": 0.25, "rollout.environment_wait_s": 0.0,
        "store.infra_refills_per_group": CAP, "eval.in_mesh": False,
        "rollout.replicas": 2, "rollout.concurrent_tasks": 2, "grader.replicas": 1,
        "learner.engine.type": "torch", "learner.batch_groups": 2, "learner.max_steps": 4,
    })
    cfg, acct, rows = train_to_end(cfg, timeout_s=420.0)

    group_of = {r["trajectory_id"]: r["group_id"] for r in rows if r["trajectory_id"] and r["group_id"]}
    final = final_outcomes(read_archive(Path(cfg.run_dir) / "archive"))
    by_group: dict[str, dict[str, list[str]]] = defaultdict(lambda: defaultdict(list))
    for tid, r in final.items():  # (a learner's report row names no group: its intake row does)
        by_group[group_of[tid]][r["outcome"]].append(tid)
    failed_reasons = {r["reason"] for r in final.values() if r["outcome"] == "failed_infra"}
    assert failed_reasons == {"infra_environment"}, acct["by_reason"]

    trained_groups = {gid: o for gid, o in by_group.items() if o.get("trained")}
    one_failed = [gid for gid, o in trained_groups.items() if len(o.get("failed_infra", [])) == 1]
    assert one_failed, f"no trained group had exactly one infra-failed member: {dict(by_group)}"
    for gid, o in trained_groups.items():
        failed = len(o.get("failed_infra", []))
        if failed <= CAP:  # every failure refilled: the group trained on G samples
            assert len(o["trained"]) == G, (gid, dict(o))
    assert any(_sample_index(t) >= G for gid in one_failed for t in trained_groups[gid]["trained"]), \
        "no refill was trained"
    refills = sorted(tid for tid in final if _sample_index(tid) >= G)  # each with its own final outcome
    assert acct["infra_refills"] == len(refills), (acct, refills)
