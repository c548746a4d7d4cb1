"""Verifier audit: probe every source's grader on its own tasks before a run spends compute on it.

How a source is probed depends on what its grader scores, as its plug-in declares
(`trajmesh.plugins.SourcePlugin.reward_from`): a reference answer, or the environment's own reward.
Every probe is graded exactly as the grader service grades a sample (the task record the store
writes, `make_grader(grader_kind(task))`).

A **reference-answer** source (``reference``: reasoning-gym, math, search, workplace) has each task
graded five ways:

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
reported as a problem (``gold_rejected``: the grader cannot give a right answer full credit), not
refused.

An **environment-reward** source (``environment``: games, verifiers rubrics, gym-style environments)
has no gold answer to grade: its reward is what the environment gives the actions it is played
with, and a task's ``answer``, if any, need not be one of them. Each task is probed with two
one-turn episodes, an ``empty`` and a ``garbage`` action, and, where the environment class offers a
legal move (``scripted_action(observation) -> str``, e.g. a TextArena game's first bracketed
option), one whole play of it (``scripted_play``) driven as the environment service drives an
episode and graded with the state hashes the rollout would record. A source is **refused** when
the empty or garbage action is rewarded as success (a reward above 0; a game's win is 1, a draw 0,
a loss -1) or the grader raises on any of the three: such a grader must score whatever the policy
plays, and an episode it cannot score is lost to training (an infrastructure failure when the task
has no answer for `grade_sample` to fall back on). The probes
reach the grader, not a verifiers rubric: the rubric runs inside the harness's episode, so a
verifiers task's empty action is scored as an episode without a rubric outcome.

A **judged** source (named in ``judge.sources``: its reward is a judge model's verdict,
graders/judge.py) is probed through the judge itself, as the grader service asks it: ``empty``,
``garbage`` and ``prompt_echo`` answers, each of which must not score high (above
`JUDGE_HIGH`), and the gold answer where the task has one (a gold answer the judge scores low is
a problem, not a refusal; no gold answer is no refusal either: a judge is for sources without a
program verifier, such as open_ended, envs/open_ended.py). Pointwise, a probe's reward is its
score; pairwise, the probe is judged against the gold answer in both orders (`circular_pairs` of
two) and must not win both, and a task without a gold answer is not probed (reported as a
problem: ``unprobed``). A source is
**refused** when a probe scores high on any task. A probe the judge could not score (a timeout,
an unreadable verdict) is reported (``raises``), not refused: the grader service would end such a
trajectory INFRA_FAILURE, never reward it. Without ``judge.urls`` the audit starts a judge engine of
its own (trajmesh/run/judge_engine.py) and stops it after the probes.

`trajmesh envs --audit [CONFIG]` prints the table (every built-in reasoning-gym family without a
config); `trajmesh train` audits its sources first (`tasks.verifier_audit`), writes
RUN_DIR/verifier_audit.json and refuses to start on a refused source unless told to warn.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any

from trajmesh import plugins
from trajmesh.envs.base import make_environment
from trajmesh.graders import Sample, grader_kind, make_grader
from trajmesh.tasks import TaskSpec, load_split

GARBAGE = "zz-not-an-answer-zz"
PROBES = ("empty", "garbage", "format_only", "prompt_echo")
"""Answers that answer nothing: each should score 0."""
REFUSING_PROBES = ("empty", "garbage", "format_only")
"""Probes whose reward above 0 refuses a source (the answer holds nothing of the task)."""
ACTION_PROBES = ("empty", "garbage")
"""The probes of an environment-reward source: one-turn episodes whose action should earn nothing."""
MAX_PLAY_STEPS = 64
"""Actions of a scripted play at most (a play still going then is graded as it stands)."""
JUDGE_PROBES = ("empty", "garbage", "prompt_echo")
"""The probes of a judged source: answers that answer nothing, none of which may score high."""
JUDGE_HIGH = 0.5
"""A judged probe scoring above this (of 1) is scored high: the source is refused."""


@dataclass
class SourceAudit:
    source: str
    reward_from: str = "reference"
    """What its grader scores (`SourcePlugin.reward_from`): how the source was probed."""
    tasks: int = 0
    gold_missing: int = 0
    gold_rejected: int = 0
    played: int = 0
    """Environment-reward sources: tasks played with the environment's ``scripted_action`` and graded."""
    unprobed: int = 0
    """Judged pairwise: tasks without a gold answer to hold the probes against, so not probed."""
    accepted: dict[str, int] = field(default_factory=dict)
    """Probe → tasks on which it scored above 0."""
    raised: dict[str, str] = field(default_factory=dict)
    """Probe → the first exception the scorer raised on it."""
    error: str = ""
    """Why the source could not be probed: no task could be drawn (its generator failed with its
    defaults), or it has no program verifier and no judge was given."""

    @property
    def refused(self) -> list[str]:
        """Why a run refuses this source (empty: it may train)."""
        if self.error:
            return [self.error]
        refusing = JUDGE_PROBES if self.reward_from == "judge" else REFUSING_PROBES
        why = [f"accepts {probe} on {n}/{self.tasks}" for probe, n in self.accepted.items()
               if n and probe in refusing]
        if self.reward_from == "environment":
            why += [f"grader raises on {probe}: {exc}" for probe, exc in self.raised.items()]
        elif self.gold_missing and self.reward_from != "judge":
            why.append(f"no gold answer on {self.gold_missing}/{self.tasks}")
        return why

    @property
    def problems(self) -> list[str]:
        """What is wrong with a source that is not refused for it (reported by `trajmesh train` and the table)."""
        out = [f"gold answer scores below 1 on {self.gold_rejected}/{self.tasks}"] if self.gold_rejected else []
        if self.unprobed:
            out.append(f"pairwise judge: no gold answer to hold the probes against on {self.unprobed}/{self.tasks} "
                       "(not probed)")
        return out

    def as_dict(self) -> dict[str, Any]:
        return {"source": self.source, "reward_from": self.reward_from, "tasks": self.tasks,
                "gold_missing": self.gold_missing, "gold_rejected": self.gold_rejected, "played": self.played,
                "unprobed": self.unprobed, "accepted": dict(self.accepted), "raised": dict(self.raised), "error": self.error,
                "refused": self.refused, "problems": self.problems}


def _probe_text(probe: str, spec: TaskSpec) -> str:
    return {"gold": spec.answer, "empty": "", "garbage": GARBAGE, "format_only": "<answer></answer>",
            "prompt_echo": spec.prompt}[probe]


def _task(spec: TaskSpec) -> dict[str, Any]:
    """The task record as the store writes it (what the environment and the grader services read)."""
    return {"source": spec.source, "answer": spec.answer, "prompt": spec.prompt, "metadata": spec.metadata}


def _grade(spec: TaskSpec, text: str, graders: dict[str, Any] | None = None) -> float:
    """`text` graded as a one-turn sample (`_grade_sample`)."""
    return _grade_sample(spec, Sample(text, [text], ended_with_eos=True), graders)


def _grade_sample(spec: TaskSpec, sample: Sample, graders: dict[str, Any] | None = None) -> float:
    """`sample` graded as the grader service grades it; `graders` caches one grader per kind (the
    service keeps one each too)."""
    task = _task(spec)
    kind = grader_kind(task)
    cache = graders if graders is not None else {}
    grader = cache.get(kind) or cache.setdefault(kind, make_grader(kind))
    return float(grader.grade(sample, task).reward)


def _scripted_play(spec: TaskSpec, graders: dict[str, Any]) -> bool:
    """Plays the task with its environment's ``scripted_action`` until the episode ends (at most
    `MAX_PLAY_STEPS` actions), as the environment service steps a session, and grades the play with
    the state hashes the rollout would record (a replay that diverges raises). False: the
    environment offers no scripted action."""
    script = getattr(plugins.environment_class(spec.environment), "scripted_action", None)
    if script is None:
        return False
    env = make_environment(spec.environment)
    observation, first = env.reset(_task(spec), 0)
    turns: list[str] = []
    hashes = [first]
    for _ in range(MAX_PLAY_STEPS):
        turns.append(str(script(observation)))
        res = env.step(turns[-1])
        hashes.append(res.state_hash)
        observation = res.observation
        if res.done:
            break
    _grade_sample(spec, Sample("".join(turns), turns, True, hashes), graders)
    return True


def audit_source(src: Any, n_tasks: int = 8) -> SourceAudit:
    """Grade `n_tasks` of the source's held-out split: a reference-answer source with the gold
    answer and every probe, an environment-reward source with the action probes and a scripted play."""
    reward_from = plugins.source(src.type).reward_from
    if reward_from == "judge":  # open_ended: nothing but a judge can probe it (`audit_judged_source`)
        return SourceAudit(src.name, reward_from, error="no program verifier: only a judge scores it (judge.sources)")
    try:
        _, tasks = load_split(src, 1, n_tasks)
    except Exception as exc:  # noqa: BLE001 - a generator that cannot run is the finding
        return SourceAudit(src.name, reward_from, error=f"no tasks: {type(exc).__name__}: {exc}"[:200])
    probes = PROBES if reward_from == "reference" else ACTION_PROBES
    out = SourceAudit(src.name, reward_from, tasks=len(tasks), accepted=dict.fromkeys(probes, 0))
    graders: dict[str, Any] = {}
    for spec in tasks:
        if reward_from == "environment":
            try:
                out.played += int(_scripted_play(spec, graders))
            except Exception as exc:  # noqa: BLE001 - an environment or grader failing a legal play is the finding
                out.raised.setdefault("scripted_play", f"{type(exc).__name__}: {exc}"[:200])
        elif spec.answer.strip() in ("", "None"):
            out.gold_missing += 1
        else:
            try:
                out.gold_rejected += int(_grade(spec, spec.answer, graders) < 1.0)
            except Exception as exc:  # noqa: BLE001 - a scorer's failure is the finding
                out.gold_rejected += 1
                out.raised.setdefault("gold", f"{type(exc).__name__}: {exc}"[:200])
        for probe in probes:
            try:
                out.accepted[probe] += int(_grade(spec, _probe_text(probe, spec), graders) > 0.0)
            except Exception as exc:  # noqa: BLE001
                out.raised.setdefault(probe, f"{type(exc).__name__}: {exc}"[:200])
    return out


def audit_judged_source(src: Any, judge: Any, n_tasks: int = 8) -> SourceAudit:
    """Grade `n_tasks` of a judged source's held-out split through the judge (`judge`: the run's
    `trajmesh.config.JudgeConfig`): the gold answer where there is one and every `JUDGE_PROBES` probe."""
    try:
        _, tasks = load_split(src, 1, n_tasks)
    except Exception as exc:  # noqa: BLE001 - a generator that cannot run is the finding
        return SourceAudit(src.name, "judge", error=f"no tasks: {type(exc).__name__}: {exc}"[:200])
    return asyncio.run(_audit_judged(src.name, judge, tasks))


async def _audit_judged(name: str, judge: Any, tasks: list[TaskSpec]) -> SourceAudit:
    from trajmesh.graders.judge import JudgeError, JudgeGrader

    out = SourceAudit(name, "judge", tasks=len(tasks), accepted=dict.fromkeys(JUDGE_PROBES, 0))
    grader = JudgeGrader(judge)

    async def reward(spec: TaskSpec, text: str) -> float:
        task, sample = _task(spec), Sample(text, [text], ended_with_eos=True)
        if judge.mode == "pointwise":
            return (await grader.grade(sample, task)).reward
        gold = Sample(spec.answer, [spec.answer], ended_with_eos=True)
        return (await grader.grade_group([gold, sample], task))[1].reward  # the probe against gold, both orders

    try:
        for spec in tasks:
            has_gold = spec.answer.strip() not in ("", "None")
            out.gold_missing += int(not has_gold)
            if has_gold and judge.mode == "pointwise":
                try:
                    out.gold_rejected += int(await reward(spec, spec.answer) <= JUDGE_HIGH)
                except JudgeError as exc:
                    out.raised.setdefault("gold", str(exc)[:200])
            if judge.mode == "pairwise" and not has_gold:
                out.unprobed += 1  # nothing to hold the probes against: reported, not passed silently
                continue
            for probe in JUDGE_PROBES:
                try:
                    out.accepted[probe] += int(await reward(spec, _probe_text(probe, spec)) > JUDGE_HIGH)
                except JudgeError as exc:
                    out.raised.setdefault(probe, str(exc)[:200])
    finally:
        await grader.close()
    return out


def audit_sources(sources: list[Any], n_tasks: int = 8, judge: Any = None) -> list[SourceAudit]:
    """Every source audited: through the judge those `judge.sources` names, by their grader the rest."""
    judged = set(judge.sources) if judge is not None else set()
    return [audit_judged_source(src, judge, n_tasks) if src.name in judged else audit_source(src, n_tasks)
            for src in sources]


def audit_config(cfg: Any, n_tasks: int) -> list[SourceAudit]:
    """Every source of a run config audited, the judged ones through its judge: without
    ``judge.urls`` a judge engine of its own serves the probes (trajmesh/run/judge_engine.py, its
    log RUN_DIR/logs/judge-engine-audit.log) and is stopped after them."""
    from trajmesh.run.judge_engine import JudgeEngine, needs_judge_engine, with_judge_url

    if needs_judge_engine(cfg):
        with JudgeEngine.for_run(cfg, "judge-engine-audit.log").start() as engine:
            return audit_sources(list(cfg.tasks.sources), n_tasks, with_judge_url(cfg, engine.url).judge)
    return audit_sources(list(cfg.tasks.sources), n_tasks, cfg.judge)


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
    audits = audit_config(cfg, cfg.tasks.verifier_audit_tasks)
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


def _verdict(a: SourceAudit) -> str:
    """refused (why), problem (what), or ok; with how an environment-reward source was probed and a
    rewarded prompt echo in parentheses."""
    if a.refused:
        return "refused: " + "; ".join(a.refused)
    notes = []
    if a.reward_from == "judge":
        notes.append("judged: probed through the judge")
    if a.reward_from == "environment":
        notes.append(f"environment reward, scripted play on {a.played}/{a.tasks}" if a.played
                     else "environment reward, no scripted play")
    if echo := a.accepted.get("prompt_echo", 0):
        notes.append(f"prompt echo rewarded on {echo}/{a.tasks}")
    head = "problem: " + "; ".join(a.problems) if a.problems else "ok"
    return head + (f" ({'; '.join(notes)})" if notes else "")


def format_table(audits: list[SourceAudit]) -> str:
    """One line per source: tasks, gold missing / rejected, each probe's acceptances, raises, verdict
    ("-": not probed, e.g. the gold answer of an environment-reward source)."""
    head = f"{'source':32} {'tasks':>5} {'no gold':>7} {'gold<1':>6} " + " ".join(f"{p:>11}" for p in PROBES)
    lines = [head + "  raises  verdict"]
    for a in audits:
        gold = (a.gold_missing, a.gold_rejected) if a.reward_from in ("reference", "judge") else ("-", "-")
        lines.append(f"{a.source:32} {a.tasks:5d} {gold[0]:>7} {gold[1]:>6} "
                     + " ".join(f"{a.accepted.get(p, '-'):>11}" for p in PROBES)
                     + f"  {','.join(sorted(a.raised)) or '-':6}  {_verdict(a)}")
    refused = [a.source for a in audits if a.refused]
    problems = [a.source for a in audits if a.problems and not a.refused]
    lines.append(f"{len(audits)} sources, {len(refused)} refused" + (f": {', '.join(refused)}" if refused else "")
                 + (f"; {len(problems)} with problems: {', '.join(problems)}" if problems else ""))
    return "\n".join(lines)
