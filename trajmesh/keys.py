"""Redis key names of one run (namespace-prefixed), in one place."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class RedisKeys:
    namespace: str = ""

    def _k(self, name: str) -> str:
        return f"{self.namespace}:trajmesh:{name}" if self.namespace else f"trajmesh:{name}"

    @property
    def gate_prefix(self) -> str:
        """Prefix of the staleness gate's counters (version, accepted, running)."""
        return self._k("gate")

    @property
    def tasks(self) -> str:
        """Hash task_id → JSON task record (reference answer for the grader, group size)."""
        return self._k("tasks")

    @property
    def seen_trajectories(self) -> str:
        """Set of trajectory ids the store has taken in (dedupe)."""
        return self._k("seen")

    @property
    def sampler_cursor(self) -> str:
        """Integer: tasks drawn from the sampler so far (the data cursor)."""
        return self._k("cursor")

    @property
    def admitted_trajectories(self) -> str:
        """Integer: trajectories admitted (tasks × G) — the left side of the accounting."""
        return self._k("admitted")

    @property
    def manifest_id(self) -> str:
        """The run manifest's id, stamped on every task and trajectory."""
        return self._k("manifest_id")
