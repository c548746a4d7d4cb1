"""The store's record as the rest of the mesh reads and writes it: the few run-level facts other
services need, behind named calls, so the key names stay in the store (keys.py).

::

    learner     mark_finished(reason) at its budget, a stop rule or a regression; reopen() when a
                resumed run may admit again; the data cursor (checkpointed, restored at least to it)
    grader      task(task_id), tasks(ids): the admitted tasks' records (reference answer, group size)
    evaluator   finished(): the learner has ended the run
    run/        the manifest id, the admitted count (the accounting's left side), mark_finished
                (through `SyncRunRecord`: the launcher's and `trajmesh train`'s synchronous clients)
"""

from __future__ import annotations

import json
from typing import Any

from trajmesh.services.store.keys import RedisKeys


class RunRecord:
    """Over an asyncio Redis client (a service's)."""

    def __init__(self, redis: Any, namespace: str) -> None:
        self.redis = redis
        self.keys = RedisKeys(namespace)

    async def mark_finished(self, reason: str) -> None:
        """The run is over (`reason`: budget, stop_rule, heldout_regression): the store admits no more."""
        await self.redis.set(self.keys.run_finished, reason)

    async def reopen(self) -> None:
        """A resumed run with a larger budget admits again."""
        await self.redis.delete(self.keys.run_finished)

    async def finished(self) -> bool:
        return bool(await self.redis.exists(self.keys.run_finished))

    async def sampler_cursor(self) -> int:
        """Tasks drawn from the sampler so far (the data cursor)."""
        return int(await self.redis.get(self.keys.sampler_cursor) or 0)

    async def restore_sampler_cursor(self, at_least: int) -> None:
        """After a learner restart from a checkpoint: a wiped Redis must not replay drawn tasks."""
        await self.redis.set(self.keys.sampler_cursor, max(await self.sampler_cursor(), at_least))

    async def tasks(self, task_ids: list[str]) -> list[dict[str, Any] | None]:
        """Each admitted task's record (reference answer, group size...), in one round trip; None for
        an id settled or unknown."""
        if not task_ids:
            return []
        return [None if raw is None else json.loads(raw) for raw in await self.redis.hmget(self.keys.tasks, task_ids)]


class SyncRunRecord:
    """Over a synchronous Redis client (the local launcher and `trajmesh train`)."""

    def __init__(self, redis: Any, namespace: str) -> None:
        self.redis = redis
        self.keys = RedisKeys(namespace)

    def set_manifest_id(self, manifest_id: str) -> None:
        self.redis.set(self.keys.manifest_id, manifest_id)

    def admitted_trajectories(self) -> int:
        """Trajectories admitted (tasks × G): the left side of the accounting."""
        return int(self.redis.get(self.keys.admitted_trajectories) or 0)

    def refills_admitted(self) -> int:
        """Refills admitted (new samples in the place of infra-failed members; in the admitted count)."""
        return int(self.redis.get(self.keys.refills_admitted) or 0)

    def mark_finished(self, reason: str) -> None:
        self.redis.set(self.keys.run_finished, reason)
