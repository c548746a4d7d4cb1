"""Difficulty profiling: each training task's pass rate under the starting policy.

`trajmesh profile CONFIG` plays k samples of the first N tasks of each source's training split (the
split the store's `TaskSampler` draws from) and grades them. The path is the one the
held-out evaluation takes without a mesh (learner/evaluate.py): the rollout's own episode layout
(`play_episodes`, `EpisodeFormat` from the model dir), the torch sampler in process (`ModelPolicy`,
the torch engine's `sample_batch`), the run's training sampling settings (`tasks.sampling`), and
each task's own grader as the grader service calls it (`grade_sample`: a scorer raising on the
answer is a 0). A sample passes when its reward is at least `tasks.profile_pass_reward`.

The profile goes to `tasks.profile` (default RUN_DIR.task_profile.json, beside the run dir), which
the store reads for each source's `curriculum` (trajmesh/tasks.py); its re-profiles go to
RUN_DIR/task_profile.json.
"""

from __future__ import annotations

import time
from collections import Counter
from pathlib import Path
from typing import Any

from trajmesh.config import RunConfig
from trajmesh.tasks import BUCKETS, bucket, load_split, profile_key, profile_path, write_profile


def profile_tasks(cfg: RunConfig, *, samples: int, tasks_per_source: int,
                  out: Path | None = None) -> dict[str, Any]:
    """Profiles `tasks_per_source` training tasks of every source with `samples` samples each;
    writes the profile and returns a summary: per source, tasks, mean pass rate and the count per
    bucket (against the source's `curriculum.target_band`)."""
    import torch

    from trajmesh.graders import Sample, grade_sample, grader_kind, make_grader
    from trajmesh.learner.models import load_model
    from trajmesh.rollout.agents.episode import EpisodeFormat, ModelPolicy, play_episodes
    from trajmesh.run.launcher import prepare_model

    started = time.monotonic()
    cfg = prepare_model(cfg)
    assert cfg.model.path is not None
    torch.manual_seed(cfg.seed)
    model, _ = load_model(cfg.model.path)
    if torch.cuda.is_available():  # as the evaluator: on the GPU in bf16, like the rollout engine
        model = model.to("cuda", dtype=torch.bfloat16)
    fmt = EpisodeFormat.load(cfg.model.path)
    tok = fmt.tokenizer
    policy = ModelPolicy(model, pad_id=tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id,
                         eos_id=tok.eos_token_id, seed=cfg.seed)
    sp = cfg.tasks.sampling
    params = fmt.sampling(sp.temperature, sp.top_p, sp.max_new_tokens)
    graders: dict[str, Any] = {}
    counts: dict[str, tuple[int, int]] = {}
    summary: dict[str, Any] = {}
    for src in cfg.tasks.sources:
        train, _ = load_split(src, cfg.tasks.train_size, cfg.tasks.heldout_size)
        chosen = train[:tasks_per_source]
        tasks = [{"prompt": t.prompt, "answer": t.answer, "task_id": t.task_id, "source": t.source,
                  "environment": t.environment, "metadata": t.metadata} for t in chosen]
        episodes = play_episodes(policy, fmt, tasks, params, max_turns=sp.max_turns, samples=samples, seed=cfg.seed)
        passes: Counter[str] = Counter()
        for ep in episodes:
            turns = [ids for ids in ep.turn_ids if ids]
            flat = [t for ids in turns for t in ids]
            kind = grader_kind(ep.task)
            grader = graders.get(kind) or graders.setdefault(kind, make_grader(kind))
            sample = Sample(tok.decode(flat), [tok.decode(ids) for ids in turns],
                            bool(flat) and flat[-1] == tok.eos_token_id, list(ep.state_hashes), ep.terminal_reason)
            passes[ep.task["task_id"]] += int(grade_sample(grader, sample, ep.task).reward >= cfg.tasks.profile_pass_reward)
        rates = []
        for t in chosen:
            counts[profile_key(src.name, t.task_id)] = (passes[t.task_id], samples)
            rates.append(passes[t.task_id] / samples)
        buckets = Counter(bucket(r, src.curriculum.target_band) for r in rates)
        summary[src.name] = {"tasks": len(chosen), "mean_pass_rate": sum(rates) / max(1, len(rates)),
                             "buckets": {b: buckets.get(b, 0) for b in BUCKETS}}
    path = out or profile_path(cfg.tasks, cfg.run_dir)
    write_profile(path, counts, samples=samples, model=cfg.model.path, policy_version=0,
                  profiled_by="trajmesh profile", summary=summary)
    return {"path": str(path), "samples": samples, "seconds": round(time.monotonic() - started, 1),
            "sources": summary}


def format_summary(result: dict[str, Any]) -> str:
    head = f"{'source':24} {'tasks':>5} {'mean pass':>9} " + " ".join(f"{b:>10}" for b in BUCKETS)
    lines = [head]
    for name, s in result["sources"].items():
        lines.append(f"{name:24} {s['tasks']:5d} {s['mean_pass_rate']:9.3f} "
                     + " ".join(f"{s['buckets'][b]:10d}" for b in BUCKETS))
    lines.append(f"{result['samples']} samples per task, {result['seconds']} s: {result['path']}")
    return "\n".join(lines)
