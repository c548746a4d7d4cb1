"""PNG of a run from its metrics.jsonl: reward, held-out accuracy (pooled and per source), policy lag and ESS over RL time."""

from __future__ import annotations

import json
from pathlib import Path


def plot_run(run_dir: str | Path, out: str | Path | None = None) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    run = Path(run_dir)
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if line.strip()]
    steps = [r for r in records if r.get("kind") == "learner_step"]
    evals = [r for r in records if r.get("kind") == "eval"]
    t = [s["rl_seconds"] for s in steps]
    fig, axes = plt.subplots(2, 2, figsize=(11, 7), sharex=True)
    ax = axes[0][0]
    ax.plot(t, [s.get("reward_mean", float("nan")) for s in steps], lw=0.8)
    ax.set_title("batch reward (mean)")
    ax = axes[0][1]
    et = [e["rl_seconds"] for e in evals]
    ax.plot(et, [e.get("sampled_accuracy") for e in evals], "o-", label="sampled T=1")
    ax.plot(et, [e.get("greedy_accuracy") for e in evals], "s-", label="greedy")
    sources = list(dict.fromkeys(src for e in evals for src in e.get("heldout", {})))
    if len(sources) > 1:  # one dashed sampled-accuracy line per source (the two above are pooled)
        for src in sources:
            pts = [(e["rl_seconds"], e["heldout"][src]["sampled_accuracy"]) for e in evals if src in e.get("heldout", {})]
            ax.plot([t for t, _ in pts], [a for _, a in pts], "--", lw=0.8, label=f"{src} T=1")
    ax.set_title("held-out accuracy")
    ax.legend()
    ax = axes[1][0]
    ax.plot(t, [s.get("max_token_lag", 0) for s in steps], lw=0.8)
    ax.set_title("max per-token policy lag (versions)")
    ax.set_xlabel("RL seconds")
    ax = axes[1][1]
    ax.plot(t, [s.get("trajmesh_learner_effective_sample_size_ratio", float("nan")) for s in steps], lw=0.8)
    ax.set_ylim(0, 1.05)
    ax.set_title("ESS fraction of the behavior weight")
    ax.set_xlabel("RL seconds")
    fig.suptitle(f"trajmesh run {run.name}")
    fig.tight_layout()
    path = Path(out) if out else run / "metrics.png"
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path
