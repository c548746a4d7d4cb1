"""One of two store replicas SIGSTOPped for a minute, with real processes (issue 41, item 7).

The learner gathers each batch from both replicas (services/store/client.py). While replica 0 is
stopped it waits for it as long as a live replica holds it for a due straggler (`straggler_wait_s`,
here 30 s: the grader's ack wait, with `store.straggler_slack_s` 0), then trains on from replica 1
alone. The test observes the learner's version advance while replica 0 is still stopped (an event
read from metrics.jsonl, then the stop checked in /proc), continues it after 60 s, lets the run
end by its time budget, and checks: every admitted trajectory has exactly one final outcome, none
in flight at stop, no trained token more than η behind, nothing trained twice, the gate's counters
agree with the archive, and the learner trained groups of replica 0 after it came back.
"""

from __future__ import annotations

import os
import re
import signal
import time
import urllib.request
import uuid
from pathlib import Path

import pytest
from mesh_checks import (
    check_archive,
    check_gate_reconciles,
    last_step,
    learner_steps,
    processes_marked,
    supervise_until,
    wait_stopped,
    write_manifest,
)

from trajmesh.bus import partition_of
from trajmesh.config import load_config
from trajmesh.run.launcher import accounting, start_mesh
from trajmesh.run.run_end import end_run
from trajmesh.services.store.service import straggler_wait_s

pytestmark = [pytest.mark.e2e, pytest.mark.slow, pytest.mark.timeout(900)]

ETA = 1
STOP_S = 60.0
"""How long replica 0 stays stopped (the fault's duration)."""
BUDGET_S = 170.0
"""The learner's time budget: a few steps before the stop, the minute stopped, and time after it
for replica 0 to come back (its straggler hold included) and be trained from again."""


def _replica_0(port: int, name: str) -> float:
    """The learner's metric `name` for store replica 0."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
        text = r.read().decode()
    found = re.search(rf'^{name}\{{replica="0"\}} (\S+)$', text, re.M)
    assert found, f"the learner exports no {name} for replica 0"
    return float(found.group(1))


def _stopped(pid: int) -> bool:
    with open(f"/proc/{pid}/status") as fh:
        return any(line.split()[1] in ("T", "t") for line in fh if line.startswith("State:"))


def test_learner_trains_on_while_one_of_two_store_replicas_is_stopped(
        tmp_path: Path, tiny_model_dir: str, monkeypatch: pytest.MonkeyPatch) -> None:
    mark = uuid.uuid4().hex
    monkeypatch.setenv("TRAJMESH_TEST_MARK", mark)
    cfg = load_config(None, {
        "run_dir": str(tmp_path / "run"), "model.path": tiny_model_dir, "gate.eta": ETA,
        "tasks.group_size": 4, "tasks.heldout_size": 20, "tasks.train_size": 300,
        "tasks.sampling.max_new_tokens": 6, "store.drop_zero_variance_groups": False,
        "store.replicas": 2, "store.intake_ack_wait_s": 4.0, "rollout.task_ack_wait_s": 4.0,
        "store.straggler_slack_s": 0.0, "rollout.replicas": 1, "rollout.concurrent_tasks": 2,
        "grader.replicas": 1, "learner.engine.type": "torch", "learner.batch_groups": 2,
        "learner.max_steps": 100_000, "learner.max_seconds": BUDGET_S, "learner.checkpoint_every": 20,
    })
    skip_s = straggler_wait_s(cfg)
    assert skip_s <= STOP_S / 2, skip_s  # time left in the stop to see the learner step without replica 0
    Path(cfg.run_dir).mkdir(parents=True)
    write_manifest(cfg)
    mesh = start_mesh(cfg)
    try:
        cfg = mesh.cfg
        supervise_until(mesh, lambda: last_step(cfg) >= 3, timeout_s=300, what="three steps before the stop")
        victim = next(p for p in mesh.procs if p.name == "store" and p.replica == 0)
        os.killpg(victim.popen.pid, signal.SIGSTOP)
        try:
            wait_stopped(victim.popen.pid)
            stopped_at, before = time.monotonic(), last_step(cfg)
            # The event: two more versions while replica 0 is stopped (it is still stopped after).
            supervise_until(mesh, lambda: last_step(cfg) >= before + 2, timeout_s=STOP_S - 2,
                            what=f"learner steps with store replica 0 stopped since step {before}")
            assert _stopped(victim.popen.pid)
            during = last_step(cfg)
            learner = next(p for p in mesh.procs if p.name == "learner")
            # the step before may have been taken before the stop
            assert _replica_0(learner.metrics_port, "trajmesh_learner_store_replica_skipped_steps_total") >= 1
            assert _replica_0(learner.metrics_port, "trajmesh_learner_store_replica_unreachable_seconds") >= skip_s
            time.sleep(max(0.0, STOP_S - (time.monotonic() - stopped_at)))  # the fault's duration
        finally:
            os.killpg(victim.popen.pid, signal.SIGCONT)
        resumed_version = learner_steps(cfg)[-1]["version"]
        supervise_until(mesh, lambda: learner.popen.poll() is not None, timeout_s=BUDGET_S + 120,
                        what="the learner's budget")
        assert learner.popen.returncode == 0, learner.log_path.read_text()[-3000:]
        assert end_run(mesh) == 0
        acct = accounting(cfg)
        rows = check_archive(cfg, acct, ETA)
        check_gate_reconciles(cfg, rows)
    finally:
        mesh.stop_services()
        mesh.stop_infra()
    assert not any(k.startswith("in_flight_at_stop") for k in acct["by_reason"]), acct["by_reason"]
    group_of = {r["trajectory_id"]: r["group_id"] for r in rows if r["outcome"] == "accepted"}
    trained_after = {partition_of(group_of[r["trajectory_id"]], 2) for r in rows
                     if r["outcome"] == "trained" and r["learner_version"] > resumed_version}
    assert 0 in trained_after, (resumed_version, acct["by_reason"])  # replica 0 rejoined the gather
    assert during >= before + 2
    assert not processes_marked(mark), processes_marked(mark)
