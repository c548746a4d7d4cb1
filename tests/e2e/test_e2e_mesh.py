"""The mesh end to end: every service a real process, real NATS JetStream and Redis, gRPC between.

A short asynchronous run (a few learner steps, two rollout and two grader processes) with bad
messages injected onto TRAJ_GRADED mid-run. Checks: versions advance and rollout reloads weights
mid-run; every trained token's lag ≤ η; no trajectory trained twice; every admitted trajectory ends
as exactly one archived outcome; each bad message is quarantined with its reason; nothing is
quarantined as stale (the gate, not the learner's check, keeps the bound) and the gate's counters
agree with the archive. The run has auth on (the launcher's default), and no generated secret
appears anywhere it could leak: every file under the run dir (service and server logs,
metrics.jsonl, manifest.json, the config files, the archive's Parquet bytes, checkpoints, weights,
the servers' data and config files), the /metrics text of every service while it runs, and every
service's command line; the one exception is RUN_DIR/infra/credentials.json (mode 0600), the file
that holds them.
"""

from __future__ import annotations

import asyncio
import json
import math
import re
import stat
import time
import urllib.request
from collections import Counter
from pathlib import Path

import pytest
from contract_layouts import old_layout
from mesh_checks import FINAL_OUTCOMES, check_gate_reconciles, check_no_stale, write_manifest

from trajmesh import bus as busmod
from trajmesh import security
from trajmesh.config import RunConfig, load_config
from trajmesh.contract import Trajectory
from trajmesh.graders.reasoning_gym import ReasoningGymGrader
from trajmesh.run.launcher import Proc, accounting, start_mesh
from trajmesh.run.run_end import end_run
from trajmesh.run.train import read_metrics
from trajmesh.services.store.archive import read_archive
from trajmesh.services.store.keys import RedisKeys
from trajmesh.tasks import read_profile
from trajmesh.v1 import trajectory_pb2

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(420)]

ETA = 1
STEPS = 6


def _build_config(run_dir: Path, model_dir: str, **over: object):  # type: ignore[no-untyped-def]
    overrides = {
        "run_dir": str(run_dir), "model.path": model_dir, "gate.eta": ETA,
        "tasks.group_size": 4, "tasks.heldout_size": 20, "tasks.train_size": 300,
        "tasks.sampling.max_new_tokens": 6,
        "rollout.replicas": 2, "rollout.concurrent_tasks": 2, "grader.replicas": 2,
        "learner.engine.type": "torch", "learner.batch_groups": 3, "learner.max_steps": STEPS,
        "learner.checkpoint_every": 3, **over,
    }
    return load_config(None, overrides)


def _bad_messages(task_id: str, future_version: int) -> dict[str, bytes]:
    """Each malformed input and the quarantine reason the store must give it."""
    def base(tid: str) -> Trajectory:
        t = Trajectory.new(trajectory_id=tid)
        t.pb.task_id, t.pb.group_id = task_id, "injected-group"
        t.append_prompt([1, 5, 6])
        t.append_sampled([7, 2], [-0.5, -0.1], 0)
        t.finish(trajectory_pb2.EOS)
        t.set_reward(1.0)
        return t

    mismatched = old_layout(base("bad-lengths"))  # a record in the layout before the token block
    mismatched.pb.behavior_logprobs.append(-1.0)
    truncated = base("bad-block")
    truncated.pb.token_block = truncated.token_block[:-1]
    nan = base("bad-nan")
    nan.replace_token_arrays(behavior_logprobs=[0.0, 0.0, 0.0, math.nan, -0.1])
    future = base("bad-future")
    future.replace_token_arrays(behavior_versions=[-1, -1, -1, future_version, 0])
    unknown = base("bad-unknown-task")
    unknown.pb.task_id = "no-such-task"
    return {
        "length_mismatch": mismatched.to_bytes(),
        "token_block_length": truncated.to_bytes(),
        "logprob_not_finite": nan.to_bytes(),
        "version_from_future": future.to_bytes(),
        "unknown_task_id": unknown.to_bytes(),
        "not_a_trajectory": b"\xff\x00 definitely not a protobuf trajectory \x07",
    }


async def _inject(cfg: RunConfig, messages: dict[str, bytes]) -> None:
    bus = await security.connect_bus(cfg, "admin", name="test-injector")  # the run's admin credentials
    try:
        for data in messages.values():
            await bus.publish(busmod.SUBJECT_TRAJ_GRADED, data)
    finally:
        await bus.close()


def _scrape_when_ready(proc: Proc, deadline_s: float = 60.0) -> str | None:
    """The /metrics text of a running service once its endpoint answers (a busy machine may not
    have it listening yet, or a restarted service may be starting); None if the process exited."""
    deadline = time.monotonic() + deadline_s
    while proc.popen.poll() is None:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{proc.metrics_port}/metrics", timeout=5) as resp:
                return str(resp.read().decode(errors="replace"))
        except OSError as err:  # URLError(ConnectionRefusedError), reset while it starts or stops
            assert time.monotonic() < deadline, f"{proc.label}: /metrics did not answer in {deadline_s}s: {err}"
            time.sleep(0.2)  # no event for "a socket started listening in another process"
    return None


def _check_no_secret_leaked(run_dir: Path, scraped: dict[str, str], cmdlines: dict[str, bytes]) -> None:
    """No NATS or Redis password of the run in any file under `run_dir` but the credentials file
    (0600), in any /metrics text or command line; no log mentions a permissions violation."""
    creds_path = security.LocalCredentials.path(run_dir)
    assert stat.S_IMODE(creds_path.stat().st_mode) == 0o600
    creds = security.LocalCredentials.load(run_dir)
    assert creds is not None
    secrets = {f"nats:{role}": pw for role, pw in creds.nats_passwords.items()}
    secrets["redis"] = creds.redis_password
    assert len(scraped) >= 4, sorted(scraped)
    files = [f for f in run_dir.rglob("*") if f.is_file() and f != creds_path]
    kinds = {f.name for f in files}
    assert {"manifest.json", "metrics.jsonl", "config.resolved.yaml", "nats.conf", "nats.log"} <= kinds, kinds
    assert any(f.suffix == ".parquet" for f in files) and any(f.suffix == ".log" for f in files)
    assert any("checkpoints" in f.parts for f in files) and any("weights" in f.parts for f in files)
    leaks = []
    for f in files:
        data = f.read_bytes()
        leaks += [f"{name} in {f.relative_to(run_dir)}" for name, s in secrets.items() if s.encode() in data]
    for label, text in scraped.items():
        leaks += [f"{name} in /metrics of {label}" for name, s in secrets.items() if s in text]
    for label, argv in cmdlines.items():
        leaks += [f"{name} in the command line of {label}" for name, s in secrets.items() if s.encode() in argv]
    assert not leaks, leaks
    # The mesh ran under its per-service permissions without a single refusal.
    violations = [f.name for f in files if f.suffix == ".log" and "violation" in f.read_text(errors="replace").lower()]
    assert not violations, violations


def test_mesh_trains_asynchronously_and_accounts_for_everything(tmp_path: Path, tiny_model_dir: str) -> None:
    # The curriculum's re-profile from the run's own outcomes runs too (no curriculum acts on it), and
    # the learner zeroes the reward of truncated trajectories (learner.truncation.policy zero_reward).
    cfg = _build_config(tmp_path / "run", tiny_model_dir, **{"tasks.reprofile_every_versions": 2,
                                                            "tasks.reprofile_min_samples": 1,
                                                            "learner.truncation.policy": "zero_reward"})
    assert cfg.infra.security.nats_auth and cfg.infra.security.redis_auth  # the launcher's default
    Path(cfg.run_dir).mkdir(parents=True)
    write_manifest(cfg)
    mesh = start_mesh(cfg)
    scraped: dict[str, str] = {}
    cmdlines: dict[str, bytes] = {}
    try:
        for p in mesh.procs:
            args = p.popen.args
            cmdlines[p.label] = " ".join(map(str, args if isinstance(args, list) else [args])).encode()  # ps
        cfg = mesh.cfg
        r = security.redis_sync_client(cfg)
        keys = RedisKeys(cfg.infra.namespace)
        deadline = time.monotonic() + 60
        while not r.hlen(keys.tasks) and time.monotonic() < deadline:
            time.sleep(0.2)
        task_id = r.hkeys(keys.tasks)[0].decode()
        r.close()
        bad = _bad_messages(task_id, future_version=10_000)
        asyncio.run(_inject(cfg, bad))
        learner = next(p for p in mesh.procs if p.name == "learner")
        for p in mesh.procs:  # while the run goes on (a finished learner's endpoint is gone)
            text = _scrape_when_ready(p)
            if text is not None:
                scraped[p.label] = text
        assert learner.popen.wait(timeout=300) == 0, learner.log_path.read_text()[-3000:]
        assert not [p.label for p in mesh.dead() if p is not learner and p.popen.returncode != 0]
        assert end_run(mesh) == 0
        acct = accounting(cfg)
        check_gate_reconciles(cfg, [r for r in read_archive(Path(cfg.run_dir) / "archive").to_pylist()
                                    if not (r["trajectory_id"] or "").startswith("bad-")])
    finally:
        mesh.stop_services()
        mesh.stop_infra()

    run_dir = Path(cfg.run_dir)
    assert {"store", "rollout", "grader", "learner"} <= {p.name for p in mesh.procs}
    _check_no_secret_leaked(run_dir, scraped, cmdlines)
    steps = [m for m in read_metrics(run_dir) if m.get("kind") == "learner_step"]
    assert [m["version"] for m in steps] == list(range(1, STEPS + 1))  # +1 per step

    rows = read_archive(run_dir / "archive").to_pylist()
    # Bad input: each quarantined with its reason; the run went on.
    by_id = {r["trajectory_id"]: r for r in rows if (r["trajectory_id"] or "").startswith("bad-")}
    assert by_id["bad-lengths"]["reason"] == "length_mismatch"
    assert by_id["bad-block"]["reason"] == "token_block_length"
    assert "logprob_not_finite" in by_id["bad-nan"]["reason"]
    assert "version_from_future" in by_id["bad-future"]["reason"]
    assert by_id["bad-unknown-task"]["reason"] == "unknown_task_id"
    assert all(r["outcome"] == "quarantined" for r in by_id.values())
    assert [r["reason"] for r in rows if not r["trajectory_id"]] == ["not_a_trajectory"]

    # No trajectory trained twice; every trained token's lag ≤ η; weights reloaded mid-run.
    trained = Counter(r["trajectory_id"] for r in rows if r["outcome"] == "trained")
    assert trained and max(trained.values()) == 1
    intake = {r["trajectory_id"]: r for r in rows if r["outcome"] == "accepted"}
    max_lag, versions_seen = 0, set()
    for r in rows:
        if r["outcome"] != "trained":
            continue
        acc = intake[r["trajectory_id"]]
        for v, m in zip(acc["behavior_versions"], acc["loss_mask"], strict=True):
            if m:
                versions_seen.add(v)
                max_lag = max(max_lag, r["learner_version"] - v)
    assert max_lag <= ETA
    assert max(versions_seen) >= 2, "rollout never sampled with reloaded weights"

    # Each graded trajectory is archived with its grader's raw components and revision: reasoning-gym's
    # correctness (the reward) and whether the response ended with EOS.
    for a in intake.values():
        assert dict(a["reward_components"]) == {"correct": a["reward"],
                                                "format_eos": float(a["terminal_reason"] == "EOS")}, a
        assert a["grader_revision"] == ReasoningGymGrader.revision, a["grader_revision"]

    # Accounting: admitted = trained + filtered + quarantined + failed_infra (injected ones aside).
    outcomes = acct["outcomes"]
    injected = {"bad-lengths", "bad-block", "bad-nan", "bad-future", "bad-unknown-task"}
    injected_quarantined = sum(1 for t in injected if t in by_id)
    assert outcomes.get("accepted", 0) == 0, "an accepted trajectory has no final outcome"
    total = sum(outcomes.get(k, 0) for k in FINAL_OUTCOMES)
    assert acct["admitted"] > 0
    assert total - injected_quarantined == acct["admitted"], json.dumps(acct)
    # Under the gate the learner's consume-time check stays quiet: nothing quarantined as stale.
    # (The lag bound above holds by construction; this is what the gate itself must achieve.)
    check_no_stale(acct, cfg.run_dir)

    # zero_reward: each step's reward mean is its trained trajectories' graded rewards from the
    # archive, with 0 for each one that hit the token budget (MAX_TOKENS).
    zeroed = 0
    for m in steps:
        batch = [intake[r["trajectory_id"]] for r in rows
                 if r["outcome"] == "trained" and r["learner_version"] == m["version"] - 1]
        assert len(batch) == m["trajectories_trained"]
        want = [0.0 if a["terminal_reason"] == "MAX_TOKENS" else a["reward"] for a in batch]
        assert m["reward_mean"] == pytest.approx(sum(want) / len(want), abs=1e-6), (m["version"], want)
        zeroed += sum(a["terminal_reason"] == "MAX_TOKENS" and a["reward"] > 0 for a in batch)
    assert zeroed, "no truncated trained response had a reward to zero: zero_reward never acted"

    # Re-profiled from the archive's own graded groups: a task with one group there has its G
    # samples and exactly the passes (reward >= 1) the archive shows; none has more than the archive.
    profile = json.loads((run_dir / "task_profile.json").read_text())
    assert profile["version"] >= 2 and profile["source"] == "run outcomes"
    graded: dict[str, list[float]] = {}
    groups: dict[str, set[str]] = {}
    for r in rows:
        if r["outcome"] == "accepted" or (r["outcome"] == "filtered" and r["reason"] in ("zero_variance",
                                                                                          "group_too_small")):
            key = f"{r['task_source']}/{r['task_id'].rsplit('-c', 1)[0]}"
            graded.setdefault(key, []).append(r["reward"])
            groups.setdefault(key, set()).add(r["group_id"])
    counts = read_profile(run_dir / "task_profile.json")
    assert counts and set(counts) <= set(graded)
    for key, (n, m) in counts.items():
        assert m <= len(graded[key]) and n <= sum(x >= 1.0 for x in graded[key]), (key, n, m)
        if len(groups[key]) == 1:
            assert (n, m) == (sum(x >= 1.0 for x in graded[key]), cfg.tasks.group_size), (key, graded[key])


def test_sync_mode_trains_on_the_current_version_only(tmp_path: Path, tiny_model_dir: str) -> None:
    """mode: sync forces η = 0: every trained token was sampled by the version it trains. The run
    also shapes rewards with `learner.truncation.policy: dapo_soft` (L_max 3, L_cache 2: a response
    of n ≥ 2 tokens loses (n − 1) / 2, one past 3 loses 1): each step's reward mean is the mean of
    its trajectories' graded rewards from the archive, each with that penalty on its length.
    Weights go as deltas (`weights.sync: delta`, an anchor every 2 versions): the rollouts load
    each version from their own rebuilds, and since every trained token was sampled by the version
    it trains, the engine-consistency probe covers every version: the engines' log-probs equal the
    learner's (weights bitwise equal; a wrong rebuild differs by far more). The lr decays linearly
    (`learner.lr_schedule: linear`) and each update reports the lr it stepped with."""
    cfg = _build_config(tmp_path / "run", tiny_model_dir, **{"mode": "sync", "learner.max_steps": 3,
                                                           "store.drop_zero_variance_groups": False,
                                                           "learner.truncation.policy": "dapo_soft",
                                                           "learner.truncation.max_length": 3,
                                                           "learner.truncation.cache_length": 2,
                                                           "weights.sync": "delta", "weights.anchor_every": 2,
                                                           "weights.local_dir": str(tmp_path / "local"),
                                                           "learner.lr": 1e-4, "learner.warmup_steps": 0,
                                                           "learner.lr_schedule": "linear",
                                                           "learner.min_lr_ratio": 0.25})
    Path(cfg.run_dir).mkdir(parents=True)
    write_manifest(cfg)
    mesh = start_mesh(cfg)
    try:
        learner = next(p for p in mesh.procs if p.name == "learner")
        assert learner.popen.wait(timeout=300) == 0, learner.log_path.read_text()[-3000:]
        assert end_run(mesh) == 0
        acct = accounting(mesh.cfg)
    finally:
        mesh.stop_services()
        mesh.stop_infra()
    steps = [m for m in read_metrics(Path(cfg.run_dir)) if m.get("kind") == "learner_step"]
    assert [m["version"] for m in steps] == [1, 2, 3]
    assert all(m["max_token_lag"] == 0 for m in steps)
    # lr decays linearly over max_steps x 1 update from 1e-4 to 0.25 x 1e-4: 1e-4, 0.75e-4, 0.5e-4
    assert [u["lr"] for m in steps for u in m["ppo_updates"]] == pytest.approx([1e-4, 7.5e-5, 5e-5], abs=1e-12)
    assert all(m["trajmesh_learner_engine_consistency_tokens"] > 0 for m in steps)
    assert all(m["trajmesh_learner_engine_consistency_max_abs_logprob_diff"] < 1e-5 for m in steps), steps
    # Versions 1 and 2 sampled the last two steps' batches, so a rollout loaded each (v3 may come
    # after the run's end), and every load was from that rollout's own rebuild. Not every rollout
    # loads every version: one whose engine became ready after the learner's last step (a busy
    # machine) loads only the newest.
    loaded: set[int] = set()
    for log_path in (Path(cfg.run_dir) / "logs").glob("rollout-*.log"):
        loads = re.findall(r"loaded weights v(\d+) from (\S+)", log_path.read_text())
        assert all(Path(p).parent.parent == tmp_path / "local" for _, p in loads), loads
        assert len({Path(p).parent for _, p in loads}) <= 1, loads  # one rollout, one rebuild dir
        loaded |= {int(v) for v, _ in loads}
    assert loaded >= {1, 2}, loaded
    assert not (sorted((Path(cfg.run_dir) / "weights").glob("v000002-*"))[-1] / "model.safetensors").exists()
    assert all(m["trajectories_trained"] > 0 for m in steps)
    check_no_stale(acct, cfg.run_dir)
    rows = read_archive(Path(cfg.run_dir) / "archive").to_pylist()
    graded = {r["trajectory_id"]: r for r in rows if r["outcome"] == "accepted"}

    def shaped(row: dict) -> float:  # DAPO's soft overlong penalty by hand, L_max 3, L_cache 2
        n = sum(row["loss_mask"])
        return row["reward"] + (0.0 if n <= 1 else -(n - 1) / 2 if n <= 3 else -1.0)

    penalized = 0
    for m in steps:
        trained = [graded[r["trajectory_id"]] for r in rows
                   if r["outcome"] == "trained" and r["learner_version"] == m["version"] - 1]
        assert len(trained) == m["trajectories_trained"]
        assert m["reward_mean"] == pytest.approx(sum(map(shaped, trained)) / len(trained), abs=1e-6)
        penalized += sum(sum(r["loss_mask"]) > 1 for r in trained)
    assert penalized, "no trained response was longer than 1 token: the penalty was never exercised"
