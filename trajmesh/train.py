"""`trajmesh train`: prepare, evaluate, run the mesh, evaluate again, summarize."""

from __future__ import annotations

import json
import logging
import shutil
import statistics
import time
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.live import Live
from rich.table import Table

from trajmesh.config import RunConfig, dump_config
from trajmesh.launcher import Mesh, accounting, drain, preflight, prepare_model, start_mesh

log = logging.getLogger("trajmesh.train")
console = Console()


class RunDirExists(RuntimeError):
    pass


def heldout_tasks(cfg: RunConfig) -> list[dict[str, Any]]:
    from trajmesh.tasks import load_split

    tasks: list[dict[str, Any]] = []
    for src in cfg.tasks.sources:
        _, held = load_split(src, 8, cfg.tasks.heldout_size)
        tasks += [{"prompt": t.prompt, "answer": t.answer, "task_id": t.task_id, "metadata": t.metadata}
                  for t in held]
    return tasks


def evaluate_dir(model_dir: str, tasks: list[dict[str, Any]], cfg: RunConfig, samples: int = 4,
                 noise_seeds: int = 0) -> dict[str, float]:
    """Held-out accuracy of a model dir: greedy, and sampled at T=1 (`samples` per problem).

    With `noise_seeds` = k > 0, the sampled accuracy is also measured with k sampling seeds (one
    sample per problem each): `sampled_accuracy_seed_std` is the evaluation noise of one such
    measurement."""
    import torch

    from trajmesh.learner.evaluate import evaluate
    from trajmesh.learner.models import load_model

    torch.manual_seed(cfg.seed)
    model, tok = load_model(model_dir)
    mnt = cfg.tasks.sampling.max_new_tokens
    greedy = evaluate(model, tok, tasks, temperature=0.0, max_new_tokens=mnt, seed=cfg.seed)
    sampled = evaluate(model, tok, tasks, temperature=1.0, samples=samples, max_new_tokens=mnt, seed=cfg.seed + 1)
    out = {"greedy_accuracy": float(greedy["accuracy"]), "sampled_accuracy": float(sampled["accuracy"])}
    for k, v in sampled["pass_at_k"].items():
        out[f"sampled_pass_at_{k}"] = float(v)
    if noise_seeds:
        accs = [float(evaluate(model, tok, tasks, temperature=1.0, samples=1, max_new_tokens=mnt,
                               seed=cfg.seed + 100 + i)["accuracy"]) for i in range(noise_seeds)]
        out["sampled_accuracy_seeds"] = accs  # type: ignore[assignment]
        out["sampled_accuracy_seed_std"] = statistics.stdev(accs) if len(accs) > 1 else 0.0
    return out


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
    for col in ("step", "version", "reward", "held-out greedy", "held-out T=1", "max lag", "ESS frac",
                "traj/s", "elapsed"):
        t.add_column(col)
    last = steps[-1] if steps else {}
    ev = evals[-1] if evals else {}
    trained = sum(s.get("trajectories_trained", 0) for s in steps)
    elapsed = time.monotonic() - started
    t.add_row(
        str(last.get("step", "-")), str(last.get("version", "-")), f"{last.get('reward_mean', float('nan')):.3f}",
        f"{ev.get('greedy_accuracy', float('nan')):.3f}", f"{ev.get('sampled_accuracy', float('nan')):.3f}",
        str(last.get("max_token_lag", "-")),
        f"{last.get('trajmesh_learner_effective_sample_size_ratio', float('nan')):.3f}",
        f"{trained / max(elapsed, 1e-9):.1f}", f"{elapsed:.0f}s",
    )
    return t


def latest_weights_dir(run_dir: Path) -> Path | None:
    dirs = sorted((run_dir / "weights").glob("v*"))
    return dirs[-1] if dirs else None


def train(cfg: RunConfig, *, resume: bool = False, fresh: bool = False, eval_every_s: float = 60.0,
          eval_samples: int = 1) -> dict[str, Any]:
    preflight(cfg)
    run_dir = Path(cfg.run_dir)
    if fresh and run_dir.exists():
        shutil.rmtree(run_dir)
    if run_dir.exists() and any(run_dir.iterdir()) and not resume:
        raise RunDirExists(f"run dir {run_dir} exists: pass --resume to continue it, or --fresh to start over")
    if resume and not (run_dir / "checkpoints" / "latest").exists():
        raise RunDirExists(f"--resume: no checkpoint in {run_dir}/checkpoints/latest")
    run_dir.mkdir(parents=True, exist_ok=True)
    cfg = prepare_model(cfg)
    dump_config(cfg, run_dir / "config.yaml")
    _write_manifest(cfg)
    held = heldout_tasks(cfg)
    if not resume:
        console.print(f"held-out evaluation before RL ({len(held)} problems)…")
        before = evaluate_dir(cfg.model.path or "", held, cfg, noise_seeds=3)
        write_metric(run_dir, {"kind": "eval", "phase": "before", "version": 0, "rl_seconds": 0.0, **before})
        console.print(f"before RL: {before}")
    mesh = start_mesh(cfg)
    try:
        _watch(mesh, held, eval_every_s, eval_samples)
        drain(mesh.cfg)
        mesh.stop_services()
        acct = accounting(mesh.cfg)
    finally:
        mesh.stop_services()
        mesh.stop_infra()
    return _summarize(mesh.cfg, held, acct)


def _watch(mesh: Mesh, held: list[dict[str, Any]], eval_every_s: float, eval_samples: int = 1) -> None:
    """Shows progress until the learner exits; raises if any other service dies first."""
    cfg = mesh.cfg
    run_dir = Path(cfg.run_dir)
    learner = next(p for p in mesh.procs if p.name == "learner")
    started = time.monotonic()
    last_eval = time.monotonic()
    last_eval_version = -1
    with Live(console=console, refresh_per_second=1, transient=False) as live:
        while True:
            # A dead service is restarted (as Kubernetes would); a failed learner resumes from its
            # checkpoint and replays the batches since. Learner exit 0 means the run is done.
            for p in mesh.restart_dead():
                if p.name == "learner":
                    learner = p
            if learner.popen.poll() == 0:
                break
            records = read_metrics(run_dir)
            steps = [r for r in records if r.get("kind") == "learner_step"]
            evals = [r for r in records if r.get("kind") == "eval"]
            if eval_every_s > 0 and time.monotonic() - last_eval > eval_every_s and steps:
                w = latest_weights_dir(run_dir)
                version = steps[-1]["version"]
                if w is not None and version != last_eval_version:
                    res = evaluate_dir(str(w), held, cfg, samples=eval_samples)
                    write_metric(run_dir, {"kind": "eval", "phase": "during", "version": version,
                                           "rl_seconds": steps[-1]["rl_seconds"], **res})
                    last_eval_version = version
                last_eval = time.monotonic()
            live.update(_progress(cfg, steps, evals, started))
            time.sleep(1.0)


def _write_manifest(cfg: RunConfig) -> None:
    from google.protobuf.json_format import MessageToDict

    from trajmesh.graders.reasoning_gym import ReasoningGymGrader
    from trajmesh.manifest import build_manifest, code_commit

    model_dir = Path(cfg.model.path or "")
    tok_cfg = model_dir / "tokenizer_config.json"
    manifest = build_manifest(
        code_commit=code_commit(),
        config=cfg.model_dump(mode="json"),
        model_revision=_dir_hash(model_dir, "model.safetensors"),
        tokenizer_revision=_dir_hash(model_dir, "tokenizer.json"),
        chat_template=json.loads(tok_cfg.read_text()).get("chat_template", "") or "" if tok_cfg.exists() else "",
        environment_revisions={s.name: s.revision for s in cfg.tasks.sources},
        grader_revisions={"reasoning_gym": ReasoningGymGrader.revision},
        algorithm={"eta": cfg.effective_eta, "mode": cfg.mode, "learner": cfg.learner.model_dump(mode="json"),
                   "group_size": cfg.tasks.group_size, "sampling": cfg.tasks.sampling.model_dump(mode="json")},
    )
    (Path(cfg.run_dir) / "manifest.json").write_text(
        json.dumps(MessageToDict(manifest, preserving_proto_field_name=True), indent=1))


def _dir_hash(model_dir: Path, name: str) -> str:
    import hashlib

    p = model_dir / name
    return hashlib.sha256(p.read_bytes()).hexdigest()[:16] if p.exists() else "unknown"


def _summarize(cfg: RunConfig, held: list[dict[str, Any]], acct: dict[str, Any]) -> dict[str, Any]:
    run_dir = Path(cfg.run_dir)
    records = read_metrics(run_dir)
    steps = [r for r in records if r.get("kind") == "learner_step"]
    before = next((r for r in records if r.get("kind") == "eval" and r.get("phase") == "before"), {})
    w = latest_weights_dir(run_dir)
    after = evaluate_dir(str(w), held, cfg, noise_seeds=3) if w is not None else {}
    write_metric(run_dir, {"kind": "eval", "phase": "after", "version": steps[-1]["version"] if steps else 0,
                           "rl_seconds": steps[-1]["rl_seconds"] if steps else 0.0, **after})
    outcomes = acct["outcomes"]
    summary = {
        "heldout_accuracy_before_rl": before.get("sampled_accuracy"),
        "heldout_accuracy_after_rl": after.get("sampled_accuracy"),
        "heldout_greedy_accuracy_before_rl": before.get("greedy_accuracy"),
        "heldout_greedy_accuracy_after_rl": after.get("greedy_accuracy"),
        "heldout_size": len(held),
        "heldout_sampled_accuracy_seed_std_before_rl": before.get("sampled_accuracy_seed_std"),
        "heldout_sampled_accuracy_seed_std_after_rl": after.get("sampled_accuracy_seed_std"),
        "heldout_sampled_pass_at_4_before_rl": before.get("sampled_pass_at_4"),
        "heldout_sampled_pass_at_4_after_rl": after.get("sampled_pass_at_4"),
        "rl_steps": steps[-1]["step"] if steps else 0,
        "rl_seconds": steps[-1]["rl_seconds"] if steps else 0.0,
        "eta": cfg.effective_eta,
        "mode": cfg.mode,
        "max_token_lag": max((s.get("max_token_lag", 0) for s in steps), default=0),
        "trajectories_admitted": acct["admitted"],
        "trajectories_trained": outcomes.get("trained", 0),
        "trajectories_filtered": outcomes.get("filtered", 0),
        "trajectories_quarantined": outcomes.get("quarantined", 0),
        "trajectories_failed_infra": outcomes.get("failed_infra", 0),
        "trajectories_in_flight_at_stop": outcomes.get("accepted", 0),
        "trajectories_by_outcome_reason": acct["by_reason"],
        "unparseable_messages_quarantined": acct["unparseable_quarantined"],
        "final_version": steps[-1]["version"] if steps else 0,
    }
    stop_reason = run_dir / "stop_reason.json"
    summary["stop_reason"] = json.loads(stop_reason.read_text()) if stop_reason.exists() else None
    (run_dir / "summary.json").write_text(json.dumps(summary, indent=1))
    try:
        from trajmesh.plot import plot_run

        plot_run(run_dir)
    except Exception as exc:  # the plot is a convenience; the summary is the record
        log.warning("plot failed: %s", exc)
    return summary
