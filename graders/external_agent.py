"""Grader for external agents' runs (rollout/agents/agent_runner.py): the agent's returned answer (no torch).

What an agent returns — ``function(task, base_url, api_key)``'s return value, or an HTTP agent's
``{"answer": ...}`` — is recorded on the trajectory (``Trajectory.final_answer``) and is what gets
scored, by the grader of the source the task came from (``metadata.answer_grader``; the
reasoning-gym families of the ``external_agent`` source: ``reasoning_gym``). The model's own turns
are not scored: an agent that post-processes the model's text (extracts a number, runs a tool last)
is graded on what it answered. A run that did not end EOS (WALL_TIMEOUT: budget exceeded;
INFRA_FAILURE: the agent crashed or returned nothing, which never reaches a grader) scores 0
whatever its text says. Every EOS trajectory of an agent run carries its answer; a sample without
one is held-out evaluation (learner/evaluate.py: the policy answers the prompt itself, no agent),
scored on its final sampled turn.

Workplace tasks (``answer_grader: workplace``) are graded by the environment's final state: the
runner hosts the task's environment for the session, the agent acts on it through the endpoint, and
the trajectory's last state hash (``state_hashes``, recorded by the runner, not the agent) must be
the state the reference solution reaches. Held-out evaluation replays the policy's own turns on a
fresh environment (graders/workplace.py).
"""

from __future__ import annotations

from typing import Any

from trajmesh.graders.base import Grade, Sample

ANSWER_GRADERS = ("reasoning_gym", "math")
"""Source graders that score a text answer (the answer takes the place of the sampled text)."""
STATE_GRADERS = ("workplace",)
"""Source graders that check the hosted environment's final state."""


class ExternalAgentGrader:
    """The source's grader on the agent's returned answer; 0 for a run that did not finish."""

    revision = "external_agent-final_answer-v2"
    components = ("correct", "finished")

    def grade(self, sample: Sample, task: dict[str, Any]) -> Grade:
        if sample.terminal_reason != "EOS":
            return Grade(0.0, {"correct": 0.0, "finished": 0.0},
                         f"not scored: the agent run ended {sample.terminal_reason}", self.revision)
        kind = str(task.get("metadata", {}).get("answer_grader") or "reasoning_gym")
        if kind not in ANSWER_GRADERS + STATE_GRADERS:
            raise ValueError(f"external_agent: answer grader {kind!r} is none of {ANSWER_GRADERS + STATE_GRADERS}")
        from trajmesh.graders import make_grader  # the registry imports this module

        if kind in STATE_GRADERS:
            return self._final_state(sample, task, make_grader(kind))

        answer = sample.final_answer
        if answer is None:  # held-out evaluation: no agent, the model's final turn is the answer
            answer = sample.turns[-1] if sample.turns else sample.text
        inner = make_grader(kind).grade(Sample(answer, [answer], True, list(sample.state_hashes), "EOS"), task)
        correct = inner.components.get("correct", inner.reward)
        return Grade(inner.reward, {"correct": float(correct), "finished": 1.0},
                     f"{'agent' if sample.final_answer is not None else 'final turn'} answer={answer[:200]!r} "
                     f"{inner.verifier_output}", self.revision, inner.audit)

    def _final_state(self, sample: Sample, task: dict[str, Any], replay: Any) -> Grade:
        from trajmesh.envs.workplace import expected_state_hash

        if sample.final_answer is None:  # held-out evaluation: the policy's own turns, replayed
            inner = replay.grade(Sample(sample.text, sample.turns, sample.ended_with_eos, [], "EOS"), task)
            correct = inner.components["state_match"]
            return Grade(correct, {"correct": correct, "finished": 1.0}, inner.verifier_output, self.revision)
        expected = expected_state_hash(task["metadata"])
        final = sample.state_hashes[-1] if sample.state_hashes else ""
        correct = float(final == expected)
        return Grade(correct, {"correct": correct, "finished": 1.0},
                     f"final state={final or 'none recorded'} expected={expected} after "
                     f"{max(len(sample.state_hashes) - 1, 0)} steps; agent answer={sample.final_answer[:200]!r}",
                     self.revision)
