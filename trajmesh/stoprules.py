"""Stop rules (survey §11.4): predeclared bounds checked after every learner step.

::

    learner step metrics ─┐
    batch_health(trajs) ──┼──▶ check_stop_rules(metrics, cfg, step) ──▶ [RuleBreach, ...]
    consistency probe ────┘                                             │ any?
                                                  stop_reason.json + metrics.jsonl {"kind": "stop"}
                                                  final checkpoint, learner run() returns (exit 0)

"The stop condition is part of the scientific method": continuing after an entropy collapse or a
verifier exploit makes later curves harder to interpret. Each rule reads one named metric:

==========================================  ===========================================================  =====
rule (config key)                           metric                                                       kind
==========================================  ===========================================================  =====
entropy_min                                 trajmesh_learner_entropy_nats                                min
kl_max                                      trajmesh_learner_kl_k3                                       max
ess_ratio_min                               trajmesh_learner_effective_sample_size_ratio                 min
verifier_disagreement_max                   trajmesh_learner_verifier_disagreement_ratio                 max
truncation_ratio_max                        trajmesh_learner_truncated_ratio                             max
engine_consistency_max_abs_logprob_diff_max trajmesh_learner_engine_consistency_max_abs_logprob_diff     max
==========================================  ===========================================================  =====

A rule whose metric is absent from a step (e.g. no version-matched tokens for the consistency probe,
no graded trajectory carrying the verifier components) is not evaluated at that step.

Verifier disagreement, defined: a graded trajectory disagrees when ``reward > 0`` differs from "every
configured pass/fail component present on it is > 0" (default components ``correct`` and
``format_eos``). With the reasoning-gym grader (reward = correct) this flags a reward given to a
response that did not end with EOS — a reward the format verifier would have refused — and a zero
reward for a response both verifiers pass. Trajectories carrying none of the components are skipped.

Imports without torch (STYLE.md habit 6).
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Literal

from trajmesh.config import StopRulesConfig
from trajmesh.contract import Trajectory

TRUNCATED_RATIO = "trajmesh_learner_truncated_ratio"
VERIFIER_DISAGREEMENT_RATIO = "trajmesh_learner_verifier_disagreement_ratio"


@dataclass(frozen=True)
class StopRule:
    name: str
    """Config key of the bound in StopRulesConfig."""
    metric: str
    kind: Literal["min", "max"]


RULES: tuple[StopRule, ...] = (
    StopRule("entropy_min", "trajmesh_learner_entropy_nats", "min"),
    StopRule("kl_max", "trajmesh_learner_kl_k3", "max"),
    StopRule("ess_ratio_min", "trajmesh_learner_effective_sample_size_ratio", "min"),
    StopRule("verifier_disagreement_max", VERIFIER_DISAGREEMENT_RATIO, "max"),
    StopRule("truncation_ratio_max", TRUNCATED_RATIO, "max"),
    StopRule("engine_consistency_max_abs_logprob_diff_max",
             "trajmesh_learner_engine_consistency_max_abs_logprob_diff", "max"),
)


@dataclass(frozen=True)
class RuleBreach:
    rule: str
    metric: str
    value: float
    bound: float
    kind: Literal["min", "max"]

    @property
    def message(self) -> str:
        rel = "<" if self.kind == "min" else ">"
        return f"{self.rule}: {self.metric} = {self.value:.6g} {rel} bound {self.bound:.6g}"


def batch_health(trajs: Iterable[Trajectory], components: Iterable[str]) -> dict[str, float]:
    """Truncation rate and verifier disagreement of a batch (see the module docstring).

    Returns ``trajmesh_learner_truncated_ratio`` when the batch is non-empty and
    ``trajmesh_learner_verifier_disagreement_ratio`` when at least one graded trajectory carries one
    of `components`.
    """
    names = list(components)
    n = truncated = checked = disagree = 0
    for t in trajs:
        n += 1
        truncated += int(t.truncated)
        if not t.graded:
            continue
        present = [float(t.pb.raw_reward_components[c]) for c in names if c in t.pb.raw_reward_components]
        if not present:
            continue
        checked += 1
        disagree += int((t.reward > 0) != all(v > 0 for v in present))
    out: dict[str, float] = {}
    if n:
        out[TRUNCATED_RATIO] = truncated / n
    if checked:
        out[VERIFIER_DISAGREEMENT_RATIO] = disagree / checked
    return out


def check_stop_rules(metrics: Mapping[str, Any], cfg: StopRulesConfig, step: int) -> list[RuleBreach]:
    """Broken rules for one step's metrics; `step` is 1 for the first step. A non-finite value of
    a ruled metric is a breach (NaN entropy or KL is no reason to keep training)."""
    if step < cfg.start_after_steps:
        return []
    out: list[RuleBreach] = []
    for rule in RULES:
        bound = getattr(cfg, rule.name)
        value = metrics.get(rule.metric)
        if bound is None or not isinstance(value, (int, float)):
            continue
        v = float(value)
        bad = not math.isfinite(v) or (v < bound if rule.kind == "min" else v > bound)
        if bad:
            out.append(RuleBreach(rule.name, rule.metric, v, float(bound), rule.kind))
    return out


def stop_record(breaches: list[RuleBreach], *, step: int, version: int) -> dict[str, Any]:
    """The JSON written to stop_reason.json and (with kind "stop") to metrics.jsonl."""
    return {
        "reason": "stop_rule",
        "rules": [b.rule for b in breaches],
        "messages": [b.message for b in breaches],
        "breaches": [asdict(b) for b in breaches],
        "step": step,
        "version": version,
        "time": time.time(),
    }


def write_stop_reason(run_dir: str | Path, record: Mapping[str, Any]) -> Path:
    """Writes RUN_DIR/stop_reason.json (temp file + rename) and appends a stop record to metrics.jsonl."""
    run = Path(run_dir)
    path = run / "stop_reason.json"
    tmp = run / ".stop_reason.json.tmp"
    tmp.write_text(json.dumps(record, indent=1))
    tmp.replace(path)
    with open(run / "metrics.jsonl", "a") as fh:
        fh.write(json.dumps({"kind": "stop", **record}) + "\n")
    return path


def read_stop_reason(run_dir: str | Path) -> dict[str, Any] | None:
    """RUN_DIR/stop_reason.json, or None. A run written before the stop rules were named so has
    ``gates`` (and reason ``stop_gate``): read as ``rules`` (``stop_rule``)."""
    path = Path(run_dir) / "stop_reason.json"
    if not path.exists():
        return None
    data: dict[str, Any] = json.loads(path.read_text())
    if "gates" in data and "rules" not in data:
        data["rules"] = data.pop("gates")
    if data.get("reason") == "stop_gate":
        data["reason"] = "stop_rule"
    return data
