"""`trajmesh inspect RUN_DIR`: what a run trained on and how it ended, from its files alone.

::

    RUN_DIR/manifest.json ─────────▶ manifest (survey §11.1), frozen at start
    RUN_DIR/stop_reason.json ──────▶ stop rule that ended the run, if any
    RUN_DIR/archive/*.parquet ─────▶ final outcome per trajectory: counts by outcome and reason;
                                     per learner version: trained / quarantined, reward, tokens, lag
    RUN_DIR/metrics.jsonl ─────────▶ per version: ESS fraction, entropy, KL, engine consistency;
                                     held-out evaluations per source (before RL, latest, best)

Needs no running service and no torch. `inspect_run` returns plain data (also printed by `--json`);
`format_report` renders it as text.
"""

from __future__ import annotations

import json
from collections import Counter, defaultdict
from pathlib import Path
from typing import Any

from trajmesh.run.train import read_metrics
from trajmesh.services.store.archive import final_outcomes, read_archive
from trajmesh.stoprules import read_stop_reason

STEP_COLUMNS = {
    "ess_ratio": "trajmesh_learner_effective_sample_size_ratio",
    "entropy_nats": "trajmesh_learner_entropy_nats",
    "kl_k3": "trajmesh_learner_kl_k3",
    "engine_max_abs_diff": "trajmesh_learner_engine_consistency_max_abs_logprob_diff",
}
"""Per-version columns taken from the learner's step record in metrics.jsonl."""


def _per_version(rows: list[dict[str, Any]], finals: dict[str, dict[str, Any]],
                 steps: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One summary per learner version that trained or quarantined something, plus step metrics."""
    intake = {r["trajectory_id"]: r for r in rows if r["outcome"] == "accepted" and r["trajectory_id"]}
    acc: dict[int, dict[str, Any]] = defaultdict(lambda: {"outcomes": Counter(), "rewards": [], "tokens": [],
                                                          "action_tokens": [], "lags": []})
    for tid, row in finals.items():
        v = row["learner_version"]
        if v is None or v < 0:
            continue
        a = acc[int(v)]
        a["outcomes"][row["outcome"]] += 1
        if row["outcome"] != "trained" or tid not in intake:
            continue
        src = intake[tid]
        a["rewards"].append(src["reward"])
        a["tokens"].append(src["num_tokens"])
        a["action_tokens"].append(src["num_action_tokens"])
        a["lags"] += [int(v) - int(u) for u, m in zip(src["behavior_versions"] or [], src["loss_mask"] or [],
                                                       strict=False) if m]
    by_step = {int(s["version"]) - 1: s for s in steps if "version" in s}  # trained at version − 1
    out = []
    for v in sorted(set(acc) | set(by_step)):
        a = acc[v]
        n = len(a["rewards"])
        entry: dict[str, Any] = {
            "version": v,
            "trained": a["outcomes"].get("trained", 0),
            "quarantined": a["outcomes"].get("quarantined", 0),
            "mean_reward": sum(a["rewards"]) / n if n else None,
            "mean_tokens": sum(a["tokens"]) / n if n else None,
            "mean_action_tokens": sum(a["action_tokens"]) / n if n else None,
            "mean_lag": sum(a["lags"]) / len(a["lags"]) if a["lags"] else None,
            "max_lag": max(a["lags"]) if a["lags"] else None,
        }
        step = by_step.get(v, {})
        for col, key in STEP_COLUMNS.items():
            entry[col] = step.get(key)
        out.append(entry)
    return out


HELDOUT_KEYS = ("greedy_accuracy", "sampled_accuracy", "sampled_pass_at_1", "sampled_pass_at_4")
"""Per-source held-out figures shown by `trajmesh inspect`."""


def _heldout(evals: list[dict[str, Any]]) -> dict[str, Any]:
    """Per source: the held-out figures before RL, at the latest evaluation and at the best one
    (the eval records `trajmesh train` writes to metrics.jsonl), and which version was best."""
    before = next((e for e in evals if e.get("phase") == "before"), None)
    latest = evals[-1] if evals else None
    best = max((e for e in evals if "score" in e), key=lambda e: e["score"], default=None)
    sources = list(dict.fromkeys(s for e in evals for s in e.get("heldout", {})))
    rows = {}
    for src in sources:
        rows[src] = {label: ({k: e["heldout"][src].get(k) for k in HELDOUT_KEYS} if e and src in e.get("heldout", {})
                             else None) for label, e in (("before", before), ("latest", latest), ("best", best))}
    return {"sources": rows, "latest_version": latest.get("version") if latest else None,
            "best_version": best.get("version") if best else None, "best_score": best.get("score") if best else None}


def inspect_run(run_dir: str | Path) -> dict[str, Any]:
    """Manifest, stop reason, outcome counts and per-version summaries of a run directory."""
    run = Path(run_dir)
    if not run.is_dir():
        raise FileNotFoundError(f"{run} is not a run directory")
    manifest_path = run / "manifest.json"
    manifest = json.loads(manifest_path.read_text()) if manifest_path.exists() else None
    table = read_archive(run / "archive") if (run / "archive").is_dir() else None
    rows = table.to_pylist() if table is not None else []
    finals = final_outcomes(table) if table is not None else {}
    outcomes = Counter(r["outcome"] for r in finals.values())
    reasons = Counter(f"{r['outcome']}:{r['reason'] or '-'}" for r in finals.values())
    unparseable = sum(1 for r in rows if not r["trajectory_id"])
    if unparseable:
        reasons["quarantined:not_a_trajectory (no id)"] += unparseable
    manifest_ids = sorted({r["manifest_id"] for r in rows if r.get("manifest_id")})
    records = read_metrics(run)
    steps = [r for r in records if r.get("kind") == "learner_step"]
    return {
        "run_dir": str(run),
        "manifest": manifest,
        "archive_manifest_ids": manifest_ids,
        "stop_reason": read_stop_reason(run),
        "trajectories": len(finals),
        "archive_rows": len(rows),
        "outcomes": dict(sorted(outcomes.items())),
        "by_reason": dict(sorted(reasons.items())),
        "learner_steps": len(steps),
        "per_version": _per_version(rows, finals, steps),
        "heldout": _heldout([r for r in records if r.get("kind") == "eval"]),
    }


def _fmt(v: Any, width: int) -> str:
    if v is None:
        s = "-"
    elif isinstance(v, float):
        s = f"{v:.4g}"
    else:
        s = str(v)
    return s.rjust(width)


def format_report(info: dict[str, Any]) -> str:
    lines = [f"run {info['run_dir']}", "", "manifest"]
    manifest = info["manifest"]
    if manifest is None:
        lines.append("  (no manifest.json)")
    else:
        for key, value in manifest.items():
            if key == "algorithm_json":
                continue
            if isinstance(value, dict):
                value = ", ".join(f"{k}={v}" for k, v in sorted(value.items()))
            lines.append(f"  {key}: {value}")
        if "algorithm_json" in manifest:
            algo = json.loads(manifest["algorithm_json"])
            lines.append("  algorithm: " + json.dumps(algo, sort_keys=True)[:400])
        ids = info["archive_manifest_ids"]
        if ids and ids != [manifest.get("manifest_id")]:
            lines.append(f"  WARNING: archive rows carry manifest ids {ids}")
    stop = info["stop_reason"]
    lines += ["", "stop"]
    lines.append(f"  stopped by a rule at step {stop['step']}: " + "; ".join(stop["messages"]) if stop
                 else "  no stop rule fired")
    lines += ["", f"trajectories: {info['trajectories']} (archive rows {info['archive_rows']}, "
                  f"learner steps {info['learner_steps']})", "counts by outcome"]
    lines += [f"  {k:<24} {v:>8}" for k, v in info["outcomes"].items()] or ["  (empty archive)"]
    lines += ["counts by outcome:reason"]
    lines += [f"  {k:<48} {v:>8}" for k, v in info["by_reason"].items()] or ["  (none)"]
    lines += _format_heldout(info.get("heldout") or {})
    cols = ["version", "trained", "quarantined", "mean_reward", "mean_tokens", "mean_action_tokens", "mean_lag",
            "max_lag", *STEP_COLUMNS]
    widths = [max(len(c), 8) for c in cols]
    lines += ["", "per learner version (trained at version v)",
              "  " + " ".join(c.rjust(w) for c, w in zip(cols, widths, strict=True))]
    for entry in info["per_version"]:
        lines.append("  " + " ".join(_fmt(entry[c], w) for c, w in zip(cols, widths, strict=True)))
    return "\n".join(lines)


def _format_heldout(h: dict[str, Any]) -> list[str]:
    """Per-source held-out table: before RL, latest and best evaluation."""
    lines = ["", f"held-out per source (latest: version {h.get('latest_version')}, best: version "
                 f"{h.get('best_version')} score {_fmt(h.get('best_score'), 0).strip()})"]
    if not h.get("sources"):
        return lines + ["  (no held-out evaluation recorded)"]
    head = ["source", "when", *HELDOUT_KEYS]
    widths = [max(len(c), 10) for c in head]
    lines.append("  " + " ".join(c.rjust(w) for c, w in zip(head, widths, strict=True)))
    for src, by_when in h["sources"].items():
        for when, figures in by_when.items():
            cells = [src, when, *((figures or {}).get(k) for k in HELDOUT_KEYS)]
            lines.append("  " + " ".join(_fmt(c, w) for c, w in zip(cells, widths, strict=True)))
    return lines
