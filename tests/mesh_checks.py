"""Assertions shared by the end-to-end mesh tests (imported by them; not a test module)."""

from __future__ import annotations

import asyncio
import inspect
import json
import os
import re
import signal
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest

from trajmesh import security
from trajmesh.config import RunConfig
from trajmesh.gate import StalenessGate
from trajmesh.services.store.archive import read_archive
from trajmesh.services.store.keys import RedisKeys

if TYPE_CHECKING:
    from trajmesh.run.launcher import Mesh

FINAL_OUTCOMES = ("trained", "filtered", "quarantined", "failed_infra", "in_flight_at_stop")
"""Every admitted trajectory ends as exactly one of these."""


def learner_steps(cfg: RunConfig) -> list[dict[str, Any]]:
    """The run's learner-step metric records so far, in order."""
    from trajmesh.run.train import read_metrics

    return [m for m in read_metrics(Path(cfg.run_dir)) if m.get("kind") == "learner_step"]


def last_step(cfg: RunConfig) -> int:
    """The learner step the run has reached (0 before the first)."""
    steps = learner_steps(cfg)
    return int(steps[-1]["step"]) if steps else 0


def supervise_until(mesh: Mesh, cond: Callable[[], bool], timeout_s: float = 180.0, what: str = "") -> float:
    """Restart dead services (as the launcher's supervisor does) until `cond()` holds; returns the
    moment it held (time.monotonic). Fails after `timeout_s` naming `what`, the learner's step,
    the restarts so far and the services dead now."""
    deadline = time.monotonic() + timeout_s
    while not cond():
        mesh.restart_dead()
        assert time.monotonic() < deadline, (
            f"{what or 'waiting'}: learner at step {last_step(mesh.cfg)} after {timeout_s:.0f} s; "
            f"restarts {mesh.restarts}; dead {[p.label for p in mesh.dead()]}")
        time.sleep(0.2)
    return time.monotonic()


def write_manifest(cfg: RunConfig) -> None:
    """The run manifest the launcher stamps on tasks, written the way `trajmesh train` writes it."""
    from trajmesh.run import train

    if len(inspect.signature(train._write_manifest).parameters) > 1:  # takes the held-out tasks
        train._write_manifest(cfg, train.heldout_tasks(cfg))  # type: ignore[call-arg]
    else:
        train._write_manifest(cfg)  # type: ignore[call-arg]


def check_archive(cfg: RunConfig, acct: dict[str, Any], eta: int) -> list[dict[str, Any]]:
    """No trajectory trained twice; every trained token's lag in [0, η]; every admitted trajectory
    ends as exactly one final outcome (none left "accepted"). Returns the archive rows."""
    rows = read_archive(Path(cfg.run_dir) / "archive").to_pylist()
    trained = Counter(r["trajectory_id"] for r in rows if r["outcome"] == "trained")
    assert trained and max(trained.values()) == 1, "a trajectory was trained twice"
    intake = {r["trajectory_id"]: r for r in rows if r["outcome"] == "accepted"}
    for r in rows:
        if r["outcome"] == "trained":
            acc = intake[r["trajectory_id"]]
            lags = [r["learner_version"] - v for v, m in zip(acc["behavior_versions"], acc["loss_mask"], strict=True) if m]
            assert lags and 0 <= min(lags) and max(lags) <= eta, (r["trajectory_id"], lags)
    outcomes = acct["outcomes"]
    assert outcomes.get("accepted", 0) == 0, json.dumps(acct)
    total = sum(outcomes.get(k, 0) for k in FINAL_OUTCOMES)
    assert acct["admitted"] > 0 and total == acct["admitted"], json.dumps(acct)
    return rows


def train_to_end(cfg: RunConfig, timeout_s: float = 300.0, *, during: Callable[[Any], None] | None = None,
                 before_end: Callable[[Any], None] | None = None,
                 ) -> tuple[RunConfig, dict[str, Any], list[dict[str, Any]]]:
    """A whole short run: the manifest, the mesh, `during(mesh)` while it runs, the learner to its
    budget (exit 0), `before_end(mesh)`, the end of the run; then the checks every healthy run passes
    (`check_archive` with the run's η, `check_gate_reconciles`, `check_no_stale`). With the evaluator
    service (`eval.in_mesh`), waits for its record of the last version before the end, as `trajmesh
    train` does. Stops every process. Returns the mesh's config, the accounting and the archive rows."""
    from trajmesh.run.launcher import accounting, start_mesh
    from trajmesh.run.run_end import end_run
    from trajmesh.run.train import wait_final_eval

    Path(cfg.run_dir).mkdir(parents=True)
    write_manifest(cfg)
    mesh = start_mesh(cfg)
    try:
        cfg = mesh.cfg
        if during is not None:
            during(mesh)
        learner = next(p for p in mesh.procs if p.name == "learner")
        assert learner.popen.wait(timeout=timeout_s) == 0, learner.log_path.read_text()[-3000:]
        if any(p.name == "evaluator" for p in mesh.procs):
            assert wait_final_eval(mesh, timeout_s) is not None, "no evaluator record of the last version"
        if before_end is not None:
            before_end(mesh)
        assert end_run(mesh) == 0
        acct = accounting(cfg)
        rows = check_archive(cfg, acct, cfg.effective_eta)
        check_gate_reconciles(cfg, rows)
    finally:
        mesh.stop_services()
        mesh.stop_infra()
    check_no_stale(acct, cfg.run_dir)
    return cfg, acct, rows


def store_draws(rows: list[dict[str, Any]]) -> dict[str, str]:
    """The tasks the store drew, from archive rows: store-made task id (the sampler's id plus
    ``-c<cursor>``, one per draw; `trajmesh.services.store.repo.task_id_at`) -> its source."""
    return {r["task_id"]: r["task_source"] for r in rows if r["task_id"]}


def train_and_evaluate(cfg: RunConfig, steps: int, timeout_s: float, *,
                       before_end: Callable[[Any], None] | None = None) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """`train_to_end`, the learner's versions 1..`steps`, then the held-out evaluation of the final
    weights, each source through its own environment and grader (what `trajmesh train` writes to
    summary.json): every source evaluated its held-out tasks. With `eval.in_mesh` the evaluation is
    the evaluator service's record of the last version; else one sample a task in this process.
    `before_end(mesh)` as `train_to_end` runs it. Returns the archive rows and the evaluation."""
    from trajmesh.learner.evaluate import heldout_tasks
    from trajmesh.run.train import evaluate_dir, latest_weights_dir, read_metrics

    _, _, rows = train_to_end(cfg, timeout_s=timeout_s, before_end=before_end)
    records = read_metrics(Path(cfg.run_dir))
    versions = [m["version"] for m in records if m.get("kind") == "learner_step"]
    assert versions == list(range(1, steps + 1))
    if cfg.eval.in_mesh:
        result = next(r for r in reversed(records) if r.get("kind") == "eval" and r.get("phase") == "after")
        assert result["version"] == steps and result["source"] == "evaluator", result
    else:
        result = evaluate_dir(str(latest_weights_dir(Path(cfg.run_dir))), heldout_tasks(cfg), cfg, samples=1)
    for src in cfg.tasks.sources:
        per = result["heldout"][src.name]
        assert per["n_tasks"] == cfg.tasks.heldout_size and per["terminal_reasons"], result
    return rows, result


EngineAnswers = dict[tuple[int, ...], list[tuple[list[int], list[float]]]]
"""Every answer the run's torch engines gave: prompt ids -> [(output ids, log-probs)]."""


def engine_answers(log_dir: str | Path) -> EngineAnswers:
    """The answers the engines wrote under `log_dir` (``TRAJMESH_ENGINE_ANSWER_LOG``,
    rollout/engines/engine_server.py `ANSWER_LOG_ENV`), by prompt."""
    out: EngineAnswers = {}
    for path in sorted(Path(log_dir).glob("engine-*.jsonl")):
        for line in path.read_text().splitlines():
            if line.strip():
                a = json.loads(line)
                out.setdefault(tuple(a["input_ids"]), []).append((list(a["output_ids"]), list(a["logprobs"])))
    return out


def check_engine_tokens(row: dict[str, Any], answers: EngineAnswers) -> tuple[list[int], list[int]]:
    """An archived row's tokens are the engine's: the prompt masked out, sampled tokens in, each with
    a version and a log-prob, the rest with version -1; and each sampled span is what the engine
    answered for the context before it (one answer, or several when an abort cut it and the rollout
    asked again from where it stopped), token for token, with the engine's log-probs. Returns the
    row's token ids and loss mask."""
    ids, mask, versions, logps = (list(row["token_ids"]), list(row["loss_mask"]), list(row["behavior_versions"]),
                                  list(row["behavior_logprobs"]))
    assert mask[0] == 0 and 1 in mask
    assert all(v >= 0 and lp <= 0.0 for v, lp, m in zip(versions, logps, mask, strict=True) if m)
    assert all(v == -1 for v, m in zip(versions, mask, strict=True) if not m)
    for lo, hi in sampled_spans(mask):
        at = lo
        while at < hi:
            given = [(out, lps) for out, lps in answers.get(tuple(ids[:at]), []) if out and out == ids[at:at + len(out)]]
            assert given, f"{row['trajectory_id']}: tokens {lo}..{hi} are not what the engine answered at {at}"
            out, lps = max(given, key=lambda a: len(a[0]))
            assert logps[at:at + len(out)] == pytest.approx(lps, abs=1e-6), row["trajectory_id"]
            at += len(out)
        assert at == hi, (row["trajectory_id"], lo, hi, at)
    return ids, mask


def sampled_spans(mask: list[int]) -> list[tuple[int, int]]:
    """[start, end) of every maximal run of loss_mask 1 (a sampled turn, or the part of one an abort
    left)."""
    spans, start = [], None
    for i, m in enumerate([*mask, 0]):
        if m and start is None:
            start = i
        elif not m and start is not None:
            spans.append((start, i))
            start = None
    return spans


def tid_of(archived: str, tasks: dict[str, Any]) -> str:
    """The task id of an archived row (``<task id>`` or ``<task id>-c<k>``)."""
    return archived if archived in tasks else archived.rsplit("-", 1)[0]


def sampled_turns(ids: list[int], mask: list[int], tok: Any) -> list[str]:
    """Each sampled span of an archived row decoded (one span per turn)."""
    return [tok.tokenizer.decode(ids[lo:hi]) for lo, hi in sampled_spans(mask)]


def check_no_stale(acct: dict[str, Any], run_dir: str | Path | None = None) -> None:
    """The gate kept the learner's consume-time check quiet: nothing quarantined as stale, and
    nothing cut by the store for arriving too stale to train (`filtered:stale_on_arrival`). With
    `run_dir`, a failure quotes the store's lines on the learner's holds, give-ups and stale cuts
    (the run's directory is gone when CI reports it)."""
    stale = {k: v for k, v in acct["by_reason"].items()
             if k.startswith(("quarantined:", "filtered:")) and "stale" in k}
    if stale and run_dir is not None:
        said = [line.rstrip() for log in sorted((Path(run_dir) / "logs").glob("store-*.log"))
                for line in log.open(errors="replace")
                if re.search(r"held for due|gave up|on arrival|stale|recovering", line)]
        pytest.fail(f"stale quarantines in a healthy run: {stale} ({json.dumps(acct)}); the store said:\n"
                    + "\n".join(said[-60:]))
    assert not stale, f"stale quarantines in a healthy run: {stale} ({json.dumps(acct)})"


def check_gate_reconciles(cfg: RunConfig, rows: list[dict[str, Any]]) -> None:
    """The gate's counters after the run agree with the archive: nothing still running, `accepted`
    = the trajectories of kept groups (an "accepted" row each), `unfilled` = the places their
    missing members left (G − k for a kept group of k), the version = the last step's."""
    r = security.redis_sync_client(cfg)
    try:
        c = StalenessGate(r, key_prefix=RedisKeys(cfg.infra.namespace).gate_prefix, eta=cfg.effective_eta,
                          batch_size=cfg.batch_trajectories).counters()
    finally:
        r.close()
    kept = {row["trajectory_id"] for row in rows if row["outcome"] == "accepted"}
    kept_groups = {row["group_id"] for row in rows if row["outcome"] == "accepted"}
    trained_at = [row["learner_version"] for row in rows if row["outcome"] == "trained"]
    assert c.running == 0, f"gate still counts {c.running} running after the run finalized"
    assert c.accepted == len(kept), (c, len(kept))
    assert c.unfilled == cfg.tasks.group_size * len(kept_groups) - len(kept), (c, len(kept_groups), len(kept))
    assert c.version == max(trained_at) + 1, (c, max(trained_at))


def processes_marked(mark: str) -> list[str]:
    """Live processes started with TRAJMESH_TEST_MARK=`mark` in their environment (this process
    aside), read from /proc: an orphan re-parented to init still carries its starter's
    environment, so this sees what the launcher's pid list cannot."""
    needle = f"TRAJMESH_TEST_MARK={mark}".encode()
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == os.getpid():
            continue
        try:
            with open(f"/proc/{entry}/environ", "rb") as fh:
                if needle not in fh.read().split(b"\0"):
                    continue
            with open(f"/proc/{entry}/cmdline", "rb") as fh:
                cmdline = fh.read().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue  # gone meanwhile, or not ours to read
        found.append(f"{entry}: {cmdline}")
    return found


def kill_group(pid: int) -> None:
    """SIGKILL a service and its children (its own session); a process already gone is fine."""
    try:
        os.killpg(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def setup_then_stop(service: Any) -> Any:
    """Run a service's ``setup()`` (what start-up checks it makes), then ``stop()`` whatever happened."""
    async def body() -> None:
        try:
            await service.setup()
        finally:
            await service.stop()

    asyncio.run(body())
    return service


def signal_pending(pid: int, sig: int) -> bool:
    """Whether `sig` waits, undelivered, for process `pid` (its SigPnd/ShdPnd masks in
    /proc/<pid>/status): a stopped process keeps a signal pending until it is continued, so this is
    the event "the signal reached it" for a process the test holds with SIGSTOP."""
    bit = 1 << (sig - 1)
    with open(f"/proc/{pid}/status") as fh:
        for line in fh:
            key, _, value = line.partition(":")
            if key in ("SigPnd", "ShdPnd") and int(value.strip(), 16) & bit:
                return True
    return False


def wait_stopped(pid: int, timeout_s: float = 60.0) -> None:
    """Until every thread of `pid` is stopped (State T in /proc/<pid>/task/*/status), after a
    SIGSTOP. The group stop takes each thread as it next enters the kernel, and a thread in a long
    system call (a checkpoint's write) stops late. A signal that arrives before then is taken by
    the process's handler and stops with it, and is never pending; a test that waits for it to be
    pending must wait for the stop first."""
    deadline = time.monotonic() + timeout_s
    while True:
        states = []
        for tid in os.listdir(f"/proc/{pid}/task"):
            try:
                with open(f"/proc/{pid}/task/{tid}/status") as fh:
                    states += [line.split()[1] for line in fh if line.startswith("State:")]
            except FileNotFoundError:
                continue  # a thread that exited meanwhile
        if states and all(s in ("T", "t") for s in states):
            return
        assert time.monotonic() < deadline, f"pid {pid} not stopped after {timeout_s}s: {states}"
        time.sleep(0.01)  # no event for "the kernel finished a group stop"


def pids_of(*needles: str) -> list[int]:
    """Live processes whose command line contains every needle (this process aside), from /proc."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == os.getpid():
            continue
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as fh:
                cmdline = fh.read().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if all(n in cmdline for n in needles):
            found.append(int(entry))
    return found
