"""Verifier audit: probe every source's grader on its own tasks before a run spends compute on it.

Each task is graded five ways, exactly as the grader service grades a sample (the task record the
store writes, `make_grader(grader_kind(task))`):

- ``gold``: the task's own answer. It should score 1; a task without one ("" or "None": some
  reasoning-gym families store none) cannot be held out or trusted;
- ``empty``, ``garbage`` (a fixed nonsense string), ``format_only`` (an empty answer tag) and
  ``prompt_echo`` (the prompt itself): model output that answers nothing. Each should score 0.

A source is **refused** when ``empty``, ``garbage`` or ``format_only`` scores above 0 on any task
(its reward can be had without an answer) or a task has no gold answer. ``prompt_echo`` scoring
above 0 is reported, not refused: a prompt may hold its answer's material (chain_sum's "3+0=" earns
the family's partial credit for the 3), yet it is a reward a policy can learn to take. A scorer that
raises on model output is reported (``raises``): the grader service scores such a sample 0 with a
``parse_error`` component when the same scorer grades the gold answer (graders/base.py
`grade_sample`), and records an infrastructure failure when it raises on the gold answer too. Gold answers that do not score 1 are
reported too (``gold_rejected``).

`trajmesh envs --audit [CONFIG]` prints the table (every built-in reasoning-gym family without a
config); `trajmesh train` audits its sources first (`tasks.verifier_audit`), writes
RUN_DIR/verifier_audit.json and refuses to start on a refused source unless told to warn.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from trajmesh.graders import Sample, grader_kind, make_grader
from trajmesh.tasks import TaskSpec, load_split

GARBAGE = "zz-not-an-answer-zz"
PROBES = ("empty", "garbage", "format_only", "prompt_echo")
"""Answers that answer nothing: each should score 0."""
REFUSING_PROBES = ("empty", "garbage", "format_only")
"""Probes whose reward above 0 refuses a source (the answer holds nothing of the task)."""


@dataclass
class SourceAudit:
    source: str
    tasks: int = 0
    gold_missing: int = 0
    gold_rejected: int = 0
    accepted: dict[str, int] = field(default_factory=dict)
    """Probe → tasks on which it scored above 0."""
    raised: dict[str, str] = field(default_factory=dict)
    """Probe → the first exception the scorer raised on it."""
    error: str = ""
    """Why no task could be drawn (the source's generator failed with its defaults)."""

    @property
    def refused(self) -> list[str]:
        """Why a run refuses this source (empty: it may train)."""
        if self.error:
            return [f"no tasks: {self.error}"]
        why = [f"accepts {probe} on {n}/{self.tasks}" for probe, n in self.accepted.items()
               if n and probe in REFUSING_PROBES]
        if self.gold_missing:
            why.append(f"no gold answer on {self.gold_missing}/{self.tasks}")
        return why

    def as_dict(self) -> dict[str, Any]:
        return {"source": self.source, "tasks": self.tasks, "gold_missing": self.gold_missing,
                "gold_rejected": self.gold_rejected, "accepted": dict(self.accepted), "raised": dict(self.raised),
                "error": self.error, "refused": self.refused}


def _probe_text(probe: str, spec: TaskSpec) -> str:
    return {"gold": spec.answer, "empty": "", "garbage": GARBAGE, "format_only": "<answer></answer>",
            "prompt_echo": spec.prompt}[probe]


def _grade(spec: TaskSpec, text: str, graders: dict[str, Any] | None = None) -> float:
    """`text` graded as the grader service grades a sample; `graders` caches one grader per kind
    (the service keeps one each too)."""
    task = {"source": spec.source, "answer": spec.answer, "prompt": spec.prompt, "metadata": spec.metadata}
    kind = grader_kind(task)
    cache = graders if graders is not None else {}
    grader = cache.get(kind) or cache.setdefault(kind, make_grader(kind))
    return float(grader.grade(Sample(text, [text], ended_with_eos=True), task).reward)


def audit_source(src: Any, n_tasks: int = 8) -> SourceAudit:
    """Grade `n_tasks` of the source's held-out split with the gold answer and every probe."""
    try:
        _, tasks = load_split(src, 1, n_tasks)
    except Exception as exc:  # noqa: BLE001 - a generator that cannot run is the finding
        return SourceAudit(src.name, error=f"{type(exc).__name__}: {exc}"[:200])
    out = SourceAudit(src.name, tasks=len(tasks), accepted=dict.fromkeys(PROBES, 0))
    graders: dict[str, Any] = {}
    for spec in tasks:
        if spec.answer.strip() in ("", "None"):
            out.gold_missing += 1
        else:
            try:
                out.gold_rejected += int(_grade(spec, spec.answer, graders) < 1.0)
            except Exception as exc:  # noqa: BLE001 - a scorer's failure is the finding
                out.gold_rejected += 1
                out.raised.setdefault("gold", f"{type(exc).__name__}: {exc}"[:200])
        for probe in PROBES:
            try:
                out.accepted[probe] += int(_grade(spec, _probe_text(probe, spec), graders) > 0.0)
            except Exception as exc:  # noqa: BLE001
                out.raised.setdefault(probe, f"{type(exc).__name__}: {exc}"[:200])
    return out


def audit_sources(sources: list[Any], n_tasks: int = 8) -> list[SourceAudit]:
    return [audit_source(src, n_tasks) for src in sources]


class VerifierAuditRefused(ValueError):
    """A run's source failed its verifier audit (``tasks.verifier_audit: refuse``)."""


def audit_run(cfg: Any, run_dir: Any) -> list[SourceAudit]:
    """The run-start audit (`tasks.verifier_audit`): every source audited, RUN_DIR/verifier_audit.json
    written; with ``refuse`` a refused source stops the run before anything starts."""
    import json
    from pathlib import Path

    mode = cfg.tasks.verifier_audit
    if mode == "off":
        return []
    audits = audit_sources(list(cfg.tasks.sources), cfg.tasks.verifier_audit_tasks)
    (Path(run_dir) / "verifier_audit.json").write_text(json.dumps(
        {"mode": mode, "sources": [a.as_dict() for a in audits]}, indent=2, sort_keys=True) + "\n")
    refused = [a for a in audits if a.refused]
    if refused and mode == "refuse":
        raise VerifierAuditRefused(
            "verifier audit refused " + "; ".join(f"{a.source} ({', '.join(a.refused)})" for a in refused)
            + ": fix the source or its grader, or set tasks.verifier_audit: warn to train on it anyway\n"
            + format_table(audits))
    return audits


def reasoning_gym_families() -> list[Any]:
    """A source config per built-in reasoning-gym family (default knobs)."""
    import reasoning_gym.factory

    from trajmesh import plugins

    config = plugins.source("reasoning_gym").config
    return [config(name=family, family=family) for family in sorted(reasoning_gym.factory.DATASETS)]


def format_table(audits: list[SourceAudit]) -> str:
    """One line per source: tasks, gold missing / rejected, each probe's acceptances, raises, verdict."""
    head = f"{'source':32} {'tasks':>5} {'no gold':>7} {'gold<1':>6} " + " ".join(f"{p:>11}" for p in PROBES)
    lines = [head + "  raises  verdict"]
    for a in audits:
        echo = a.accepted.get("prompt_echo", 0)
        verdict = ("refused: " + "; ".join(a.refused) if a.refused
                   else f"ok (prompt echo rewarded on {echo}/{a.tasks})" if echo else "ok")
        lines.append(f"{a.source:32} {a.tasks:5d} {a.gold_missing:7d} {a.gold_rejected:6d} "
                     + " ".join(f"{a.accepted.get(p, 0):11d}" for p in PROBES)
                     + f"  {','.join(sorted(a.raised)) or '-':6}  {verdict}")
    refused = [a.source for a in audits if a.refused]
    lines.append(f"{len(audits)} sources, {len(refused)} refused" + (f": {', '.join(refused)}" if refused else ""))
    return "\n".join(lines)
