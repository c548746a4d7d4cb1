"""Final-state verification for the workplace environment: replay the action log (no torch).

The grader rebuilds the episode on a fresh `WorkplaceEnv` from the sampled turns, checks every
replayed state hash against the hashes rollout recorded (a mismatch means the environment was not
deterministic: an infrastructure error, never policy reward), and compares the final state hash
with the reference solution's.
"""

from __future__ import annotations

from typing import Any

from trajmesh.envs.workplace import WorkplaceEnv, expected_state_hash
from trajmesh.graders.base import Grade, Sample


class ReplayMismatch(RuntimeError):
    """Replaying the action log did not reproduce the recorded state hashes."""


class WorkplaceGrader:
    revision = "workplace-final-state-v1"
    components = ("state_match", "format_done", "invalid_actions")

    def grade(self, sample: Sample, task: dict[str, Any]) -> Grade:
        env = WorkplaceEnv()
        _, h = env.reset(task, 0)
        hashes = [h]
        invalid = 0
        # Only the turns the environment saw (a turn cut by max tokens never reached it).
        turns = sample.turns[: len(sample.state_hashes) - 1] if sample.state_hashes else sample.turns
        for turn in turns:
            res = env.step(turn)
            hashes.append(res.state_hash)
            info = res.info or {}
            invalid += bool(info.get("invalid_action") or info.get("parser_error"))
            if res.done:
                break
        recorded = list(sample.state_hashes)
        if recorded and recorded != hashes[: len(recorded)]:
            raise ReplayMismatch(f"replayed {hashes} but rollout recorded {recorded}")
        expected = expected_state_hash(task["metadata"])
        match = hashes[-1] == expected
        components = {"state_match": float(match), "format_done": float("<done/>" in sample.text),
                      "invalid_actions": float(invalid)}
        return Grade(float(match), components, f"final={hashes[-1]} expected={expected}", self.revision)
