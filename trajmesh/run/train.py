"""`trajmesh train`: prepare, evaluate, run the mesh, evaluate again, summarize.

::

    held-out tasks per source ── evaluate_dir(base model) ── metrics.jsonl {"kind": "eval", "phase": "before"}
    start_mesh ── _watch: every eval_every_s, evaluate the newest weights ── HeldoutTracker
                     │ new best: copy the weights to RUN_DIR/best        │ regression confirmed:
                     │                                                   ▼ stop_reason.json, SIGTERM learner
    learner exits 0 ── drain ── evaluate_dir(final weights) ── summary.json (per source, best checkpoint)

By default (`eval.in_mesh` unset or true) the launcher evaluates nothing itself: the evaluator
service (started with the mesh, as on a cluster) writes every eval record, the learner keeps
RUN_DIR/best and stops on a regression, and summary.json's before/after figures are the
evaluator's records of version 0 and the last version (`wait_final_eval` waits for the latter
before the mesh stops). `eval.in_mesh: false` evaluates in this process instead, as drawn above.
"""

from __future__ import annotations

import json
import logging
import math
import os
import shutil
import signal
import statistics
import time
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.live import Live
from rich.table import Table

from trajmesh.config import RunConfig, dump_config
from trajmesh.learner.evaluate import (
    HeldoutTracker,
    eval_budgets,
    evaluate_source,
    heldout_result,
    heldout_tasks,
    keep_best,
)
from trajmesh.rollout.engines import HttpEngineConfig
from trajmesh.run.audit import audit_run
from trajmesh.run.launcher import Mesh, accounting, preflight, prepare_model, start_mesh
from trajmesh.run.run_end import end_run
from trajmesh.tokenizer import chat_template_text
from trajmesh.weights.delta import WeightSyncError, is_delta_dir, reconstruct
from trajmesh.weights.layout import latest_version_dir, weights_root

log = logging.getLogger("trajmesh.run.train")
console = Console()


class RunDirExists(RuntimeError):
    pass


def evaluation_protocol(cfg: RunConfig, held: dict[str, list[dict[str, Any]]]) -> dict[str, Any]:
    """What an evaluation figure means (recorded in the manifest): samples, sampling, budgets, and
    per source the environments and graders its tasks run, with their revisions: the task's own, and
    those it delegates to (an external agent's run is scored by ``metadata.answer_grader`` and may act
    on ``metadata.agent_environment``)."""
    from trajmesh import plugins
    from trajmesh.graders import grader_kind
    from trajmesh.tasks import HELDOUT_SEED

    max_new_tokens, max_turns = eval_budgets(cfg)
    sources = {}
    for name, tasks in held.items():
        envs = sorted({str(t["environment"] or "single_answer") for t in tasks}
                      | {str(e) for t in tasks if (e := t["metadata"].get("agent_environment"))})
        graders = sorted({grader_kind(t) for t in tasks}
                         | {str(g) for t in tasks if (g := t["metadata"].get("answer_grader"))})
        sources[name] = {"problems": len(tasks),
                         "environments": {e: plugins.environment_class(e).revision for e in envs},
                         "graders": {g: plugins.grader_class(g).revision for g in graders}}
    return {"greedy": {"temperature": 0.0, "samples_per_problem": 1},
            "sampled": {"temperature": cfg.eval.temperature, "top_p": cfg.eval.top_p,
                        "samples_per_problem": cfg.eval.samples, "samples_per_problem_during_rl": cfg.eval.samples_during},
            "max_new_tokens_per_turn": max_new_tokens, "max_turns": max_turns, "noise_seeds": cfg.eval.noise_seeds,
            "correct": "grader reward >= 1", "heldout_seed": HELDOUT_SEED, "selection_metric": cfg.eval.selection_metric,
            "sources": sources}


class InProcessEvaluationRefused(ValueError):
    """A held-out split this process may not play (`in_process_refusals`)."""


def in_process_refusals(held: dict[str, list[dict[str, Any]]]) -> list[str]:
    """Why each source's held-out split cannot be evaluated in this process ([] when all can).

    This process plays only what the rollout itself plays in its own process: a stateless
    environment (`rollout.stateless_environments_in_process`: one turn, reset and step pure, the
    environment service's own code), graded by a grader that runs no sandboxed code. Any other
    episode (tools, sandboxed code, games, agents and harnesses, hosted environments) is played by
    the environment service, where the sandbox is, and graded by the grader service: the evaluator
    service does that (`eval.in_mesh`, the default)."""
    from trajmesh import plugins
    from trajmesh.graders import grader_kind
    from trajmesh.services.environment import stateless

    out = []
    for name, tasks in held.items():
        envs = sorted({str(t.get("environment") or "single_answer") for t in tasks})
        if stateful := [e for e in envs if not stateless(e)]:
            out.append(f"{name}: environment {', '.join(stateful)} keeps state (the environment service plays it)")
        graders = sorted({grader_kind(t) for t in tasks}
                         | {str(g) for t in tasks if (g := (t.get("metadata") or {}).get("answer_grader"))})
        if sandboxed := [g for g in graders if getattr(plugins.grader_class(g), "uses_sandbox", False)]:
            out.append(f"{name}: grader {', '.join(sandboxed)} runs code in the sandbox (the grader service grades it)")
    return out


def check_in_process(held: dict[str, list[dict[str, Any]]]) -> None:
    """Raises `InProcessEvaluationRefused` naming every source this process may not evaluate."""
    if refusals := in_process_refusals(held):
        raise InProcessEvaluationRefused(
            "eval.in_mesh: false evaluates held-out episodes in the launcher's process, which plays only "
            "stateless environments graded without the sandbox; " + "; ".join(refusals)
            + ". Leave eval.in_mesh unset or true: the evaluator service plays every episode through the "
            "environment service and grades it through the grader service, as training does")


def evaluate_dir(model_dir: str, held: dict[str, list[dict[str, Any]]], cfg: RunConfig, samples: int = 4,
                 noise_seeds: int = 0) -> dict[str, Any]:
    """Held-out figures of a model dir per source (`heldout.<source>`), greedy and sampled, each
    source through its own environment and grader; pooled headline keys kept for old readers.
    Played in this process, so only sources `check_in_process` admits (otherwise it raises).

    With `noise_seeds` = k > 0, the sampled accuracy is also measured with k sampling seeds (one
    sample per problem each): `sampled_accuracy_seed_std` is the evaluation noise of one such
    measurement (pooled over sources)."""
    check_in_process(held)
    import torch

    from trajmesh.learner.models import load_model
    from trajmesh.rollout.agents.episode import EpisodeFormat, ModelPolicy

    torch.manual_seed(cfg.seed)
    model, _ = load_model(model_dir)
    if torch.cuda.is_available():  # a GPU run evaluates on the GPU, in bf16 like the rollout engine
        model = model.to("cuda", dtype=torch.bfloat16)
    # The rollout's episode layout, from the run's model dir as the rollout loads it (a weights
    # dir holds the tokenizer but not always the chat template or generation config).
    fmt = EpisodeFormat.load(cfg.model.path or model_dir)
    tok = fmt.tokenizer

    def policy(seed: int) -> ModelPolicy:
        return ModelPolicy(model, pad_id=tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id,
                           eos_id=tok.eos_token_id, seed=seed)

    per = {name: evaluate_source(policy, fmt, tasks, cfg, samples, noise_seeds) for name, tasks in held.items()}
    return heldout_result(per, cfg.eval.selection_metric, noise_seeds)


def write_metric(run_dir: Path, record: dict[str, Any]) -> None:
    with open(run_dir / "metrics.jsonl", "a") as fh:
        fh.write(json.dumps(record) + "\n")


def read_metrics(run_dir: Path) -> list[dict[str, Any]]:
    path = run_dir / "metrics.jsonl"
    if not path.exists():
        return []
    out = []
    for line in path.read_text().splitlines():
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            continue  # a line being written right now
    return out


def _progress(cfg: RunConfig, steps: list[dict[str, Any]], evals: list[dict[str, Any]], started: float) -> Table:
    t = Table(title=f"trajmesh train — {cfg.run_dir} (η={cfg.effective_eta}, mode={cfg.mode})")
    for col in ("step", "version", "reward", "held-out greedy", "held-out T=1", "by source (greedy/T=1)", "max lag",
                "ESS frac", "traj/s", "elapsed"):
        t.add_column(col)
    last = steps[-1] if steps else {}
    ev = evals[-1] if evals else {}
    by_source = " ".join(f"{name} {_figure(r['greedy_accuracy'], 2)}/{_figure(r['sampled_accuracy'], 2)}"
                         for name, r in ev.get("heldout", {}).items())
    trained = sum(s.get("trajectories_trained", 0) for s in steps)
    elapsed = time.monotonic() - started
    t.add_row(
        str(last.get("step", "-")), str(last.get("version", "-")), f"{last.get('reward_mean', float('nan')):.3f}",
        _figure(ev.get('greedy_accuracy'), 3), _figure(ev.get('sampled_accuracy'), 3),
        by_source or "-", str(last.get("max_token_lag", "-")),
        f"{last.get('trajmesh_learner_effective_sample_size_ratio', float('nan')):.3f}",
        f"{trained / max(elapsed, 1e-9):.1f}", f"{elapsed:.0f}s",
    )
    return t


PROGRESS_EVERY_S = 30.0
"""Seconds between plain progress lines when stdout is not a terminal (``TRAJMESH_PROGRESS_EVERY_S``
overrides it); a terminal gets the live table instead."""


def progress_every_s() -> float:
    return float(os.environ.get("TRAJMESH_PROGRESS_EVERY_S", PROGRESS_EVERY_S))


def progress_line(steps: list[dict[str, Any]], evals: list[dict[str, Any]], started: float) -> str:
    """One plain line of the live table's figures, for a log (CI, ``make demo > log``, a pod):
    ``progress step=12 version=12 reward=0.412 heldout=chain_sum:0.40/0.33 lag=1 ess=0.950 traj/s=3.2
    elapsed=120s`` (held-out per source greedy/sampled, ``-`` until known)."""
    last = steps[-1] if steps else {}
    ev = evals[-1] if evals else {}
    heldout = ",".join(f"{name}:{_figure(r['greedy_accuracy'], 2)}/{_figure(r['sampled_accuracy'], 2)}"
                       for name, r in ev.get("heldout", {}).items())
    elapsed = time.monotonic() - started
    trained = sum(s.get("trajectories_trained", 0) for s in steps)
    ess = last.get("trajmesh_learner_effective_sample_size_ratio")
    reward = last.get("reward_mean")
    return (f"progress step={last.get('step', '-')} version={last.get('version', '-')} "
            f"reward={'-' if reward is None else f'{reward:.3f}'} heldout={heldout or '-'} "
            f"lag={last.get('max_token_lag', '-')} ess={'-' if ess is None else f'{ess:.3f}'} "
            f"traj/s={trained / max(elapsed, 1e-9):.1f} elapsed={elapsed:.0f}s")


class _Progress:
    """The live table on a terminal; otherwise one `progress_line` every `every_s` seconds on stdout
    (a rich Live on a pipe would print nothing until the run ends)."""

    def __init__(self, cfg: RunConfig, started: float, every_s: float) -> None:
        self.cfg, self.started, self.every_s = cfg, started, every_s
        self.live = Live(console=console, refresh_per_second=1, transient=False) if console.is_terminal else None
        self.last_line = -math.inf

    def __enter__(self) -> _Progress:
        if self.live is not None:
            self.live.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        if self.live is not None:
            self.live.__exit__(*exc)

    def update(self, steps: list[dict[str, Any]], evals: list[dict[str, Any]], *, final: bool = False) -> None:
        if self.live is not None:
            self.live.update(_progress(self.cfg, steps, evals, self.started))
        elif final or time.monotonic() - self.last_line >= self.every_s:
            print(progress_line(steps, evals, self.started), flush=True)
            self.last_line = time.monotonic()


def latest_weights_dir(run_dir: Path) -> Path | None:
    """The newest published checkpoint as a directory an engine loads: a delta version
    (``weights.sync: delta``) rebuilt in full as RUN_DIR/.eval-weights; None when there is none
    (or its anchor chain was pruned meanwhile)."""
    latest = latest_version_dir(weights_root(run_dir))
    if latest is None:
        return None
    if not is_delta_dir(latest):
        return latest
    try:
        reconstruct(latest, run_dir / ".eval-weights")
    except WeightSyncError as exc:
        log.warning("latest weights %s not rebuilt: %s", latest.name, exc)
        return None
    return run_dir / ".eval-weights"


def _figure(value: float | None, digits: int) -> str:
    """A held-out accuracy for the live table and progress line ("-": none, every episode of the
    pass an infra failure)."""
    return "-" if value is None else f"{value:.{digits}f}"


def _record_eval(run_dir: Path, tracker: HeldoutTracker, record: dict[str, Any], weights: Path | None) -> bool:
    """Appends an eval record, keeps the weights if they are the new best; True when the held-out
    regression stop is confirmed."""
    if "score" not in record:  # every held-out episode an infra failure: nothing to compare
        write_metric(run_dir, record)
        return False
    improved, stop = tracker.observe(int(record["version"]), float(record["score"]))
    if improved and tracker.best is not None:
        path = keep_best(run_dir, weights) if weights is not None and record["version"] > 0 else weights
        tracker.best.update(path=str(path) if path else None, phase=record["phase"], rl_seconds=record["rl_seconds"])
        record = {**record, "best": True}
    write_metric(run_dir, record)
    return stop


def _replay_evals(run_dir: Path, tracker: HeldoutTracker, base_model: str) -> None:
    """On --resume: the tracker sees the evaluations already recorded (the best copy is on disk)."""
    for r in read_metrics(run_dir):
        if r.get("kind") == "eval" and r.get("phase") in ("before", "during") and "score" in r:
            improved, _ = tracker.observe(int(r["version"]), float(r["score"]))
            if improved and tracker.best is not None:
                path = base_model if r["version"] == 0 else str(run_dir / "best")
                tracker.best.update(path=path, phase=r["phase"], rl_seconds=r["rl_seconds"])


def train(cfg: RunConfig, *, resume: bool = False, fresh: bool = False, eval_every_s: float = 60.0,
          eval_samples: int | None = None) -> dict[str, Any]:
    """`eval_samples` (None: `eval.samples_during`) is the samples per problem during RL."""
    preflight(cfg)
    if cfg.eval.in_mesh is False:  # before anything starts: what this process may not play
        check_in_process(heldout_tasks(cfg))
    run_dir = Path(cfg.run_dir)
    if fresh and run_dir.exists():
        shutil.rmtree(run_dir)
    if run_dir.exists() and any(run_dir.iterdir()) and not resume:
        raise RunDirExists(f"run dir {run_dir} exists: pass --resume to continue it, or --fresh to start over")
    if resume and not (run_dir / "checkpoints" / "latest").exists():
        raise RunDirExists(f"--resume: no checkpoint in {run_dir}/checkpoints/latest")
    run_dir.mkdir(parents=True, exist_ok=True)
    if cfg.eval.in_mesh is None:  # `trajmesh train` measures as a cluster does: the evaluator service
        cfg = cfg.model_copy(update={"eval": cfg.eval.model_copy(update={"in_mesh": True})})
    if not resume:  # before the model is built or anything starts
        for a in audit_run(cfg, run_dir):
            if a.refused or a.problems or a.raised or a.accepted.get("prompt_echo"):
                console.print(f"verifier audit, {a.source}: {a.as_dict()}")
    cfg = prepare_model(cfg)
    dump_config(cfg, run_dir / "config.yaml")
    held = heldout_tasks(cfg)
    _write_manifest(cfg, held)
    tracker = HeldoutTracker(cfg.eval.stop_regression_margin, cfg.eval.stop_confirmations)
    if resume:
        _replay_evals(run_dir, tracker, cfg.model.path or "")
    elif not cfg.eval.in_mesh:  # in the mesh the evaluator service evaluates version 0
        n = sum(len(t) for t in held.values())
        console.print(f"held-out evaluation before RL ({n} problems, {len(held)} sources)…")
        before = evaluate_dir(cfg.model.path or "", held, cfg, samples=cfg.eval.samples, noise_seeds=cfg.eval.noise_seeds)
        _record_eval(run_dir, tracker, {"kind": "eval", "phase": "before", "version": 0, "rl_seconds": 0.0, **before},
                     Path(cfg.model.path or ""))
        console.print(f"before RL: { {k: v for k, v in before.items() if k != 'heldout'} }")
    mesh = start_mesh(cfg)
    try:
        _watch(mesh, held, tracker, 0.0 if cfg.eval.in_mesh else eval_every_s,
               eval_samples or cfg.eval.samples_during)
        if cfg.eval.in_mesh:
            wait_final_eval(mesh)
        end_run(mesh)  # drain, stop, and a store that died while stopping finalizes again
        acct = accounting(mesh.cfg)
    finally:
        mesh.stop_services()
        mesh.stop_infra()
    return _summarize(mesh.cfg, held, acct, tracker)


def _watch(mesh: Mesh, held: dict[str, list[dict[str, Any]]], tracker: HeldoutTracker, eval_every_s: float,
           eval_samples: int = 1) -> None:
    """Shows progress until the learner exits; raises if any other service dies first. Evaluates
    the newest weights every `eval_every_s`; a confirmed held-out regression stops the learner."""
    cfg = mesh.cfg
    run_dir = Path(cfg.run_dir)
    learner = next(p for p in mesh.procs if p.name == "learner")
    started = time.monotonic()
    last_eval = time.monotonic()
    last_eval_version = -1
    stopping = False
    steps: list[dict[str, Any]] = []
    evals: list[dict[str, Any]] = []
    with _Progress(cfg, started, progress_every_s()) as progress:
        while True:
            # A dead service is restarted (as Kubernetes would); a failed learner resumes from its
            # checkpoint and replays the batches since. Learner exit 0 means the run is done.
            for p in mesh.restart_dead():
                if p.name == "learner":
                    learner = p
            if learner.popen.poll() == 0:
                progress.update(steps, evals, final=True)
                break
            records = read_metrics(run_dir)
            steps = [r for r in records if r.get("kind") == "learner_step"]
            evals = [r for r in records if r.get("kind") == "eval"]
            if eval_every_s > 0 and time.monotonic() - last_eval > eval_every_s and steps and not stopping:
                w = latest_weights_dir(run_dir)
                version = steps[-1]["version"]
                if w is not None and version != last_eval_version:
                    res = evaluate_dir(str(w), held, cfg, samples=eval_samples)
                    record = {"kind": "eval", "phase": "during", "version": version,
                              "rl_seconds": steps[-1]["rl_seconds"], **res}
                    if _record_eval(run_dir, tracker, record, w):
                        _stop_on_regression(mesh, tracker, record, steps[-1]["step"])
                        learner.popen.send_signal(signal.SIGTERM)  # checkpoints and exits 0
                        stopping = True
                    last_eval_version = version
                last_eval = time.monotonic()
            progress.update(steps, evals)
            time.sleep(1.0)


FINAL_EVAL_WAIT_S = 900.0
"""How long `trajmesh train` waits for the evaluator's record of the last version after the learner
exits (one full evaluation: every source, greedy, `eval.samples` and the noise seeds)."""


def wait_final_eval(mesh: Mesh, timeout_s: float = FINAL_EVAL_WAIT_S) -> dict[str, Any] | None:
    """After the learner exited: the evaluator's "after" record of the last version (the newest
    announced one: the learner's last, or a newer one announced by someone else), waiting for it
    (restarting dead services meanwhile) up to `timeout_s`; None if it did not come."""
    run_dir = Path(mesh.cfg.run_dir)
    deadline = time.monotonic() + timeout_s
    while True:
        records = read_metrics(run_dir)
        steps = [r for r in records if r.get("kind") == "learner_step"]
        final = steps[-1]["version"] if steps else 0
        after = [r for r in records if r.get("kind") == "eval" and r.get("phase") == "after"
                 and int(r.get("version", -1)) >= final]
        if after:
            return after[-1]
        if time.monotonic() > deadline:
            log.warning("no evaluator record of the last version v%d after %.0fs", final, timeout_s)
            return None
        mesh.restart_dead()
        time.sleep(1.0)


def _mesh_tracker(cfg: RunConfig, records: list[dict[str, Any]]) -> HeldoutTracker:
    """The tracker the learner ran over the evaluator's records (the first record per version),
    with the best version's path: the base model for version 0, else RUN_DIR/best."""
    tracker = HeldoutTracker(cfg.eval.stop_regression_margin, cfg.eval.stop_confirmations)
    seen: set[int] = set()
    for r in records:
        if r.get("kind") != "eval" or "score" not in r or int(r["version"]) in seen:
            continue
        seen.add(int(r["version"]))
        improved, _ = tracker.observe(int(r["version"]), float(r["score"]))
        if improved and tracker.best is not None:
            path = cfg.model.path if r["version"] == 0 else str(Path(cfg.run_dir) / "best")
            tracker.best.update(path=path, phase=r["phase"], rl_seconds=r["rl_seconds"])
    return tracker


def _stop_on_regression(mesh: Mesh, tracker: HeldoutTracker, record: dict[str, Any], step: int) -> None:
    """stop_reason.json (+ a stop record in metrics.jsonl) and the run marked finished in Redis, as
    a learner stop rule does; the caller then stops the learner."""
    from trajmesh import security
    from trajmesh.services.store.record import SyncRunRecord
    from trajmesh.stoprules import write_stop_reason

    best = tracker.best or {}
    msg = (f"held-out {mesh.cfg.eval.selection_metric} score {record['score']:.4f} more than "
           f"{tracker.margin} below the best {best.get('score', float('nan')):.4f} (version {best.get('version')}) "
           f"on {tracker.below} consecutive evaluations")
    write_stop_reason(mesh.cfg.run_dir, {"reason": "heldout_regression", "rules": ["heldout_regression"],
                                         "messages": [msg], "step": step, "version": record["version"],
                                         "best": best, "time": time.time()})
    r = security.redis_sync_client(mesh.cfg)
    SyncRunRecord(r, mesh.cfg.infra.namespace).mark_finished("heldout_regression")
    r.close()
    console.print(f"[bold red]stop: {msg}")


def _write_manifest(cfg: RunConfig, held: dict[str, list[dict[str, Any]]] | None = None) -> None:
    """RUN_DIR/manifest.json; `held` (default: drawn here) gives the evaluation protocol's sources."""
    from google.protobuf.json_format import MessageToDict

    from trajmesh.run.manifest import (
        build_manifest,
        code_commit,
        tree_is_dirty,
        truncation_policy,
    )

    model_dir = Path(cfg.model.path or "")
    protocol = evaluation_protocol(cfg, held if held is not None else heldout_tasks(cfg))
    manifest = build_manifest(
        code_commit=code_commit(),
        config=cfg.model_dump(mode="json"),
        model_revision=_dir_hash(model_dir, "model.safetensors"),
        tokenizer_revision=_dir_hash(model_dir, "tokenizer.json"),
        chat_template=chat_template_text(model_dir) or "",
        environment_revisions={e: r for s in protocol["sources"].values() for e, r in s["environments"].items()},
        grader_revisions={g: r for s in protocol["sources"].values() for g, r in s["graders"].items()},
        algorithm={"eta": cfg.effective_eta, "mode": cfg.mode, "learner": cfg.learner.model_dump(mode="json"),
                   "group_size": cfg.tasks.group_size, "sampling": cfg.tasks.sampling.model_dump(mode="json"),
                   "resample_on_correct": cfg.store.resample_on_correct.model_dump(mode="json"),
                   "distill": _distill_record(cfg), "judge": _judge_record(cfg)},
        framework_versions=_framework_versions(cfg),
        dirty_tree=tree_is_dirty(),
        truncation_policy=truncation_policy(cfg),
        evaluation_protocol=protocol,
    )
    (Path(cfg.run_dir) / "manifest.json").write_text(
        json.dumps(MessageToDict(manifest, preserving_proto_field_name=True,
                                 always_print_fields_with_no_presence=True), indent=1))  # dirty_tree: false shown


def _distill_record(cfg: RunConfig) -> dict[str, Any]:
    """The manifest's distillation entry: its config, each teacher with its ``name@revision``
    identity (the one every trajectory it scores carries)."""
    from trajmesh.rollout.engines.teacher import teacher_identity

    record = cfg.distill.model_dump(mode="json")
    for entry, t in zip(record["teachers"], cfg.distill.teachers, strict=True):
        entry["identity"] = teacher_identity(t)
    return record


def _judge_record(cfg: RunConfig) -> dict[str, Any]:
    """The manifest's judge entry: its config (model path, engine URLs, rubric...) and the
    ``name@revision`` pin of the judge model (the one every trajectory it scores carries in
    ``grader_revision``); empty without a judge."""
    from trajmesh.graders.judge import judge_identity

    if not cfg.judge.sources:
        return {}
    return {**cfg.judge.model_dump(mode="json"), "identity": judge_identity(cfg.judge)}


def _framework_versions(cfg: RunConfig) -> dict[str, str]:
    """Installed framework versions, plus the external engine server's release when the engine type
    has one (`trajmesh.plugins.ENGINES`: sglang's, recorded as sglang_server)."""
    from trajmesh import plugins
    from trajmesh.run.manifest import framework_versions

    versions = framework_versions()
    ec = cfg.rollout.engine
    eng = plugins.engine(ec.type)
    if eng.server_version is not None and isinstance(ec, HttpEngineConfig) and ec.url:
        versions[f"{eng.type}_server"] = plugins.load(eng.server_version)(ec.url)
    return versions


def _dir_hash(model_dir: Path, name: str) -> str:
    import hashlib

    p = model_dir / name
    return hashlib.sha256(p.read_bytes()).hexdigest()[:16] if p.exists() else "unknown"


def _per_source_summary(before: dict[str, Any], after: dict[str, Any]) -> dict[str, Any]:
    """`heldout.<source>.before/after`: greedy and sampled accuracy, pass@k, seed noise."""
    def figures(r: dict[str, Any] | None) -> dict[str, Any] | None:
        if not r:
            return None
        out = {k: v for k, v in r.items() if k.endswith("accuracy") or "pass_at" in k or k in ("n_tasks", "samples")}
        seeds = r.get("sampled_accuracy_seeds") or []
        if len(seeds) > 1:
            out["sampled_accuracy_seed_std"] = statistics.stdev(seeds)
        return out

    names = list(dict.fromkeys([*before.get("heldout", {}), *after.get("heldout", {})]))
    return {n: {"before": figures(before.get("heldout", {}).get(n)), "after": figures(after.get("heldout", {}).get(n))}
            for n in names}


def _summarize(cfg: RunConfig, held: dict[str, list[dict[str, Any]]], acct: dict[str, Any],
               tracker: HeldoutTracker) -> dict[str, Any]:
    run_dir = Path(cfg.run_dir)
    records = read_metrics(run_dir)
    steps = [r for r in records if r.get("kind") == "learner_step"]
    before = next((r for r in records if r.get("kind") == "eval" and r.get("phase") == "before"), {})
    w = latest_weights_dir(run_dir)
    if cfg.eval.in_mesh:  # the evaluator's records: version 0 and the last version
        after: dict[str, Any] = next((r for r in reversed(records) if r.get("kind") == "eval" and r.get("phase") == "after"), {})
        tracker = _mesh_tracker(cfg, records)
    else:
        after = evaluate_dir(str(w), held, cfg, samples=cfg.eval.samples, noise_seeds=cfg.eval.noise_seeds) \
            if w is not None else {}
    if after and not cfg.eval.in_mesh:
        _record_eval(run_dir, tracker, {"kind": "eval", "phase": "after", "version": steps[-1]["version"] if steps else 0,
                                        "rl_seconds": steps[-1]["rl_seconds"] if steps else 0.0, **after}, w)
    outcomes = acct["outcomes"]
    summary = {
        "heldout": _per_source_summary(before, after),
        "best_checkpoint": {**(tracker.best or {}), "metric": cfg.eval.selection_metric} if tracker.best else None,
        "heldout_accuracy_before_rl": before.get("sampled_accuracy"),
        "heldout_accuracy_after_rl": after.get("sampled_accuracy"),
        "heldout_greedy_accuracy_before_rl": before.get("greedy_accuracy"),
        "heldout_greedy_accuracy_after_rl": after.get("greedy_accuracy"),
        "heldout_size": sum(len(t) for t in held.values()),
        "heldout_sampled_accuracy_seed_std_before_rl": before.get("sampled_accuracy_seed_std"),
        "heldout_sampled_accuracy_seed_std_after_rl": after.get("sampled_accuracy_seed_std"),
        "heldout_sampled_pass_at_4_before_rl": before.get("sampled_pass_at_4"),
        "heldout_sampled_pass_at_4_after_rl": after.get("sampled_pass_at_4"),
        "rl_steps": steps[-1]["step"] if steps else 0,
        "rl_seconds": steps[-1]["rl_seconds"] if steps else 0.0,
        "trained_tokens": int(sum(s.get("trajmesh_learner_tokens", 0) for s in steps)),
        "eta": cfg.effective_eta,
        "mode": cfg.mode,
        "max_token_lag": max((s.get("max_token_lag", 0) for s in steps), default=0),
        "trajectories_admitted": acct["admitted"],
        "trajectories_trained": outcomes.get("trained", 0),
        "trajectories_filtered": outcomes.get("filtered", 0),
        "trajectories_quarantined": outcomes.get("quarantined", 0),
        "trajectories_failed_infra": outcomes.get("failed_infra", 0),
        "trajectories_refilled_after_infra_failure": acct.get("infra_refills", 0),
        "trajectories_in_flight_at_stop": outcomes.get("in_flight_at_stop", 0),
        "trajectories_without_outcome": outcomes.get("accepted", 0),
        "trajectories_by_outcome_reason": acct["by_reason"],
        "unparseable_messages_quarantined": acct["unparseable_quarantined"],
        "final_version": steps[-1]["version"] if steps else 0,
    }
    stop_reason = run_dir / "stop_reason.json"
    summary["stop_reason"] = json.loads(stop_reason.read_text()) if stop_reason.exists() else None
    (run_dir / "summary.json").write_text(json.dumps(summary, indent=1))
    try:
        from trajmesh.run.plot import plot_run

        plot_run(run_dir)
    except Exception as exc:  # the plot is a convenience; the summary is the record
        log.warning("plot failed: %s", exc)
    return summary
