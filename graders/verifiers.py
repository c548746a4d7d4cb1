"""Grader of the ``verifiers`` source (envs/verifiers_env.py): the taskset's own rubric (no torch).

verifiers scores each episode itself, at its end, with the task's ``@vf.reward`` functions and
judges (rollout/verifiers_episodes.py); what it recorded is the trajectory's final answer (JSON:
each reward's score and weight, the errors). The reward is verifiers' own: the weighted sum of the
scores (``Trace.reward``); each reward function's score is a raw component under its name. A
rubric or harness error (an exception in a reward function, a failed harness run) is reward 0 with
the error as the verifier output, never an infrastructure failure: the policy's run happened, the
rubric could not credit it. A run that did not end EOS (WALL_TIMEOUT: the budget ran out) scores 0.

Held-out evaluation (learner/evaluate.py) plays the task in-process without the harness: the
policy answers the prompt in one turn, and the rubric scores a trace holding only that reply
(``Trace.root_reply``): exact for single-turn tasksets whose rewards read the reply, not for
rewards that read the harness's messages or runtime (those score as on an empty run).
"""

from __future__ import annotations

import json
from typing import Any

from trajmesh.graders.base import Grade, Sample


class VerifiersGrader:
    revision = "verifiers-rubric-v1"
    components = ("rubric_error",)
    """Fixed components; one per reward function (its name) comes with them."""

    def grade(self, sample: Sample, task: dict[str, Any]) -> Grade:
        if sample.final_answer is None:  # held-out evaluation: the policy's one reply, scored offline
            reply = sample.turns[-1] if sample.turns else sample.text
            return self._score(json.loads(offline_outcome(task["metadata"], reply)))
        if sample.terminal_reason != "EOS":
            return Grade(0.0, {"rubric_error": 0.0},
                         f"not scored: the verifiers episode ended {sample.terminal_reason}", self.revision)
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


def offline_outcome(meta: dict[str, Any], reply: str) -> str:
    """The task's rubric on a trace holding only `reply` (held-out evaluation), as the rollout's
    outcome JSON (rollout/verifiers_episodes.py `outcome_json`)."""
    import asyncio
    import concurrent.futures

    import verifiers.v1 as vf

    from trajmesh.envs.verifiers_env import tasks_of

    vtask = tasks_of(meta)[int(meta["idx"])]
    trace = vf.Trace(task=vf.TraceTask(type=type(vtask).__name__, data=vtask.data, key=vtask.key, hash=vtask.hash),
                     agent=vf.AgentInfo(config=vf.AgentConfig()))
    trace.root_reply = reply
    errors: list[str] = []

    async def score() -> None:
        try:
            await vtask.score(trace)
        except Exception as exc:  # a rubric exception: reward 0 with its reason
            errors.append(f"{type(exc).__name__}: {exc}"[:500])

    with concurrent.futures.ThreadPoolExecutor(1) as pool:  # its own loop, whether or not one runs here
        pool.submit(asyncio.run, score()).result()
    return json.dumps({"rewards": {k: (None if r is None else {"score": float(r.score), "weight": float(r.weight)})
                                   for k, r in trace.rewards.items()},
                       "errors": errors, "reply": reply[:500]}, sort_keys=True)
