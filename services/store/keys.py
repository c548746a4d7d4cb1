"""The store's record in Redis: the key names of one run (namespace-prefixed), in one place.

Only the store (this folder) names these keys. Other services read or write the few facts they
need through `services/store/record.py`; the staleness gate names its own counters
(`trajmesh.gate.gate_prefix`), and the store's transactions that change both are the store's
(`services/store/admission.py`)."""

from __future__ import annotations

from dataclasses import dataclass

from trajmesh.gate import gate_prefix, run_key


@dataclass(frozen=True)
class RedisKeys:
    namespace: str = ""

    def _k(self, name: str) -> str:
        return run_key(self.namespace, name)

    @property
    def gate_prefix(self) -> str:
        """Prefix of the staleness gate's counters (version, accepted, running)."""
        return gate_prefix(self.namespace)

    @property
    def tasks(self) -> str:
        """Hash task_id → JSON task record (reference answer for the grader, group size); an entry
        goes once its group is settled (`settled_tasks` remembers it)."""
        return self._k("tasks")

    @property
    def final_trajectories(self) -> str:
        """Set of trajectory ids with a final outcome (dedupe: a redelivery of one is a duplicate);
        a settled group's ids leave it (`settled_tasks` remembers them)."""
        return self._k("final")

    @property
    def settled_tasks(self) -> str:
        """Bitmap, one bit per sampler position: set once that task's group is settled (every member
        final) and its task record and final marks are trimmed — 125 kB per million tasks."""
        return self._k("settled_tasks")

    def group_received(self, group_id: str) -> str:
        """Set of member trajectory ids of a group the store has taken in (survives a store restart)."""
        return self._k(f"group:{group_id}:received")

    def group_valid(self, group_id: str) -> str:
        """Set of member ids that passed intake and wait, unacked, for the group to complete."""
        return self._k(f"group:{group_id}:valid")

    def group_refills(self, group_id: str) -> str:
        """Hash infra-failed member id → the sample index of the refill admitted in its place
        (G + k for the group's k-th; the refill's trajectory id is task id + "-" + index). Its size
        is the group's refills: the group completes at G + that many members. Goes when the group
        is settled."""
        return self._k(f"group:{group_id}:refills")

    @property
    def refills_admitted(self) -> str:
        """Integer: refills admitted over the run (each also counted in `admitted_trajectories`)."""
        return self._k("refills_admitted")

    @property
    def open_groups(self) -> str:
        """Set of group ids whose membership sets (`received`, `valid`) still exist: a restarted
        store reads from them which trajectories its predecessor held."""
        return self._k("open_groups")

    @property
    def pending_groups(self) -> str:
        """Sorted set group id → learner version it was admitted at: groups admitted and not yet
        handed to the learner (nor dropped). The store never lets the learner advance past one of
        them while it can still be trained within η."""
        return self._k("pending_groups")

    @property
    def groups_done(self) -> str:
        """Set of group ids whose gate accounting is done (finish() runs once per group). A group
        leaves it once settled (complete, every member final): the set holds only groups in flight."""
        return self._k("groups_done")

    @property
    def groups_accepted(self) -> str:
        """Hash group id → members the gate counted as accepted when the group finished (kept groups
        only): after a store crash lost a group's unflushed ``accepted`` archive rows, the end of
        the run writes them from here, so the archive agrees with the gate's counter. Trimmed with
        `groups_done` when a group is settled."""
        return self._k("groups_accepted")

    @property
    def unpublished_tasks(self) -> str:
        """Hash task_id → Task bytes: admitted and recorded but maybe not yet on TASKS (republished
        by a restarted store; the msg id makes that idempotent)."""
        return self._k("unpublished")

    @property
    def sampler_cursor(self) -> str:
        """Integer: tasks drawn from the sampler so far (the data cursor)."""
        return self._k("cursor")

    @property
    def admitted_trajectories(self) -> str:
        """Integer: trajectories admitted (tasks × G) — the left side of the accounting."""
        return self._k("admitted")

    @property
    def run_finished(self) -> str:
        """Set by the learner when it ends its budget: the store admits no more tasks."""
        return self._k("run_finished")

    @property
    def manifest_id(self) -> str:
        """The run manifest's id, stamped on every task and trajectory."""
        return self._k("manifest_id")
