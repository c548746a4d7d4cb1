"""Grader of the ``verifiers`` source (envs/verifiers_env.py): the taskset's own rubric (no torch).

verifiers scores each episode itself, at its end, with the task's ``@vf.reward`` functions and
judges (rollout/agents/verifiers_episodes.py); what it recorded is the trajectory's final answer (JSON:
each reward's score and weight, the errors). The reward is verifiers' own: the weighted sum of the
scores (``Trace.reward``); each reward function's score is a raw component under its name. A
rubric or harness error (an exception in a reward function, a failed harness run) is reward 0 with
the error as the verifier output, never an infrastructure failure: the policy's run happened, the
rubric could not credit it. A run that did not end EOS (WALL_TIMEOUT: the budget ran out) scores 0.

Held-out evaluation plays the task as training does, by its harness and tools: the evaluator
service through the environment service (`eval.in_mesh`, the default; the launcher's in-process
evaluation refuses the source), and scores what the rubric recorded there the same way.
"""

from __future__ import annotations

import json
from typing import Any

from trajmesh.graders.base import Grade, Sample


class VerifiersGrader:
    revision = "verifiers-rubric-v2"
    components = ("rubric_error",)
    """Fixed components; one per reward function (its name) comes with them."""

    def grade(self, sample: Sample, task: dict[str, Any]) -> Grade:
        if sample.terminal_reason != "EOS":
            return Grade(0.0, {"rubric_error": 0.0},
                         f"not scored: the verifiers episode ended {sample.terminal_reason}", self.revision)
        if not sample.final_answer:  # an episode that ended EOS always carries the rubric's outcome
            return Grade(0.0, {"rubric_error": 1.0}, "rubric error, reward 0: no rubric outcome was recorded",
                         self.revision)
        return self._score(json.loads(sample.final_answer))

    def _score(self, out: dict[str, Any]) -> Grade:
        scores = {name: r for name, r in (out.get("rewards") or {}).items()}
        errors = list(out.get("errors") or [])
        missing = sorted(name for name, r in scores.items() if r is None)
        if errors or missing:
            why = "; ".join(errors) or f"reward functions without a score: {', '.join(missing)}"
            return Grade(0.0, {"rubric_error": 1.0, **{n: 0.0 for n in scores}},
                         f"rubric error, reward 0: {why[:1000]}", self.revision)
        reward = sum(float(r["score"]) * float(r["weight"]) for r in scores.values())
        components = {"rubric_error": 0.0, **{n: float(r["score"]) for n, r in scores.items()}}
        return Grade(reward, components, f"rubric {json.dumps(scores, sort_keys=True)} reply={out.get('reply', '')[:200]!r}",
                     self.revision)
