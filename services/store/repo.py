"""The trajectory store's Redis bookkeeping behind one small repository (no torch).

It owns every key the store writes (see `trajmesh.services.store.keys`) and the index arithmetic over pipeline and
MULTI replies, so the store's wiring never counts reply positions:

- admission with its task record, the admitted count and the unpublished mark, and a group's
  release, each one atomic script over the gate and the record (`admission.py`); before each
  admission one round trip reads the finished flag and the gate, draws the sampler position and
  clears the last task's unpublished mark (`admission_round`);
- per message: its task record and whether its id is final (one round trip for a batch);
- per group member: membership in `received` / `valid` and both counts after it (one MULTI);
- or both, and the finish of the groups they complete, in one script (`intake_round`);
- ids marked final, membership cleanup (with a settled group's gate records, task record and
  final ids: a run's Redis holds only what is in flight, plus one bit per settled task);
- recovery: which ids a previous store held (`owed_ids`), which open groups a killed store
  left settled (`settled_open_groups`), and which admitted ids have no final outcome at the end of
  a finished run (`unfinished_members`).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import redis.asyncio

from trajmesh.gate import AsyncStalenessGate, GateCounters
from trajmesh.services.store.admission import Admission
from trajmesh.services.store.keys import RedisKeys
from trajmesh.services.store.state import member_ids, member_task_id


def task_id_at(base_task_id: str, cursor: int) -> str:
    """The id the store gives the task it draws at sampler position `cursor`."""
    return f"{base_task_id}-c{cursor}"


def base_task_id(task_id: str) -> str:
    """The sampler's own task id inside a store-made one (`task_id_at` inverted); any other id as is."""
    head, sep, tail = task_id.rpartition("-c")
    return head if sep and head and tail.isdigit() else task_id


def task_cursor(task_id: str) -> int | None:
    """The sampler position in a store-made task id (`task_id_at`); None for any other id."""
    head, sep, tail = task_id.rpartition("-c")
    return int(tail) if sep and head and tail.isdigit() else None


def _final(marked: object, cursor: int | None, settled_bit: object) -> bool:
    """An id is final when marked so, or when its task (at sampler position `cursor`) was settled
    and trimmed (`settled_tasks` bit set)."""
    return bool(marked) or (cursor is not None and bool(settled_bit))


def _text(raw: bytes | str | None) -> str:
    """A Redis reply as text (the client returns bytes)."""
    if raw is None:
        return ""
    return raw.decode() if isinstance(raw, bytes) else raw


@dataclass(frozen=True)
class Lookup:
    """What Redis knows about one incoming trajectory."""
    task: dict[str, Any] | None
    """Its task's record (None: unknown task id)."""
    already_final: bool
    """Whether its id has a final outcome (a redelivery of it is a duplicate); also when it is one of
    its task's G sample ids and that task's group was settled and trimmed (task record gone,
    `settled_tasks` bit set)."""
    group_pending: bool = True
    """Whether its group is still pending (never handed to the learner). False: a learner may
    have trained it already and not yet reported it (a store restarted in between)."""
    refills: int = 0
    """Refills admitted for its group so far (the group completes at G + that many members)."""


@dataclass(frozen=True)
class IntakeItem:
    """One graded trajectory for `StoreRepo.intake_round`, with what the store knows before Redis."""
    task_id: str
    trajectory_id: str
    group_id: str
    """The group it claims."""
    valid_member: bool
    """`intake.Prejudged.valid_member`."""
    newest_version: int
    oldest_sampled_version: int
    held_after: int
    """Valid members its group holds after it if every valid-member item of the group so far in
    the run is recorded valid (`StoreState.take_member`'s count)."""
    refills_known: int
    """The group's refills the store knows of (`Group.refills`)."""
    kept_if_complete: int
    """Members the group keeps if it completes at this run's end (the gate's `accepted` of its
    finish); -1: the round must not finish it (the store selects members first: GRPO-RoC)."""
    last_of_group: bool
    """Whether it is the run's last item of its group (the round finishes a group only there)."""


@dataclass(frozen=True)
class IntakeFacts:
    """What `StoreRepo.intake_round` found and did for one item."""
    lookup: Lookup
    recorded: bool
    """Its membership was recorded (it is a member of its task's group and not final)."""
    valid: bool
    """Recorded as a valid member."""
    counts: tuple[int, int]
    """Its group's (received, valid) counts right after it (0, 0 unless recorded)."""
    finish: int
    """Its group's finish: -2 not complete, -1 left to the store, 0 finished already, 1 finished."""


NOT_COMPLETE, FINISH_LEFT = -2, -1
"""`IntakeFacts.finish` codes besides a finish's own result (0 or 1)."""


@dataclass(frozen=True)
class AdmissionRound:
    """One read before an admission (`StoreRepo.admission_round`)."""
    finished: bool
    """The run is finished (admit nothing more)."""
    counters: GateCounters
    capacity: int
    """The gate's capacity from `counters` (`GateSpec.effective_capacity`)."""
    cursor: int | None
    """The sampler position drawn (None: none asked for)."""


@dataclass(frozen=True)
class Membership:
    group_id: str
    trajectory_id: str
    valid: bool


@dataclass(frozen=True)
class OpenMember:
    """An admitted trajectory id without a final outcome, with its task's group."""
    trajectory_id: str
    task_id: str
    group_id: str
    source: str


def _every_group(group_id: str) -> bool:
    return True


class _OneByOne:
    """A pipeline's interface over a client that sends each command on its own round trip (the
    benchmark's base: `store.pipelined_admission` false)."""

    def __init__(self, client: redis.asyncio.Redis) -> None:
        self.r = client
        self.calls: list[Any] = []

    def __getattr__(self, name: str) -> Callable[..., None]:
        method = getattr(self.r, name)
        return lambda *args: self.calls.append((method, args))

    async def execute(self) -> list[Any]:
        return [await method(*args) for method, args in self.calls]


class StoreRepo:
    """Redis bookkeeping of one run's store (`keys` scopes it; `version_key` is the gate's).

    The keys are the run's, shared by every store replica. `owns` (group id → bool) is this
    replica's partition: what it waits for, recovers and finalizes is its own groups alone; the
    admission, the gate and every per-id record are global."""

    def __init__(self, client: redis.asyncio.Redis, keys: RedisKeys, gate: AsyncStalenessGate,
                 owns: Callable[[str], bool] = _every_group) -> None:
        self.r = client
        self.keys = keys
        self.gate = gate
        self.admission = Admission(client, keys, gate)
        self.version_key = gate.version_key
        self.owns = owns

    # ------------------------------------------------------------------ admission
    async def next_cursor(self) -> int:
        """Draw the next sampler position (0-based)."""
        return int(await self.r.incr(self.keys.sampler_cursor)) - 1

    async def try_admit(self, task_id: str, record: dict[str, Any], data: bytes, group_size: int) -> bool:
        """If the gate has capacity for the group: admit it, record the task, count its G as
        admitted, mark it unpublished and its group pending — one atomic step (a store that dies
        before the publish republishes on start; one that dies before this step admitted nothing).
        `record` carries group_id and admitted_at_version."""
        return await self.admission.admit(
            group_size, task_id=task_id, record=json.dumps(record, default=str), data=data,
            group_id=str(record["group_id"]), version=int(record["admitted_at_version"]))

    async def admission_round(self, *, draw: bool, published: Sequence[str] = (),
                              pipelined: bool = True) -> AdmissionRound:
        """What the admission loop needs before a task, in one round trip: the unpublished marks of
        `published` cleared (tasks on TASKS since the last round), whether the run is finished,
        the gate's counters and, with `draw`, the next sampler position (`next_cursor`).
        `pipelined` false: the same commands, one round trip each (`store.pipelined_admission`)."""
        pipe = self.r.pipeline(transaction=False) if pipelined else _OneByOne(self.r)
        if published:
            pipe.hdel(self.keys.unpublished_tasks, *published)
        pipe.exists(self.keys.run_finished)
        pipe.mget(self.gate.spec.keys)
        if draw:
            pipe.incr(self.keys.sampler_cursor)
        replies = await pipe.execute()
        if published:
            replies = replies[1:]
        finished, raw, *cursor = replies
        counters = self.gate.spec.snapshot(raw)
        return AdmissionRound(bool(finished), counters, self.gate.spec.effective_capacity(counters),
                              int(cursor[0]) - 1 if cursor else None)

    async def due_groups(self, max_version: int) -> set[str]:
        """This partition's pending groups admitted at a learner version ≤ `max_version`."""
        found = await self.r.zrangebyscore(self.keys.pending_groups, "-inf", max_version)
        return {gid for gid in (_text(g) for g in found if isinstance(g, (bytes, str))) if self.owns(gid)}

    async def not_pending(self, group_ids: list[str]) -> None:
        """Groups handed to the learner or dropped: nothing to wait for any more."""
        if group_ids:
            await self.r.zrem(self.keys.pending_groups, *group_ids)

    async def pending_again(self, groups: dict[str, int]) -> None:
        """Groups back in the queue (a dead learner never trained them), with their admission versions."""
        if groups:
            await self.r.zadd(self.keys.pending_groups, {gid: v for gid, v in groups.items()})

    async def published(self, task_id: str) -> None:
        await self.r.hdel(self.keys.unpublished_tasks, task_id)

    async def unpublished(self) -> dict[str, bytes]:
        raw = await self.r.hgetall(self.keys.unpublished_tasks)
        return {_text(k): v if isinstance(v, bytes) else v.encode() for k, v in raw.items()}

    async def run_finished(self) -> bool:
        return bool(await self.r.exists(self.keys.run_finished))

    async def manifest_id(self) -> str:
        return _text(await self.r.get(self.keys.manifest_id))

    # ------------------------------------------------------------------ intake
    async def lookup(self, items: list[tuple[str, str]], group_ids: list[str] | None = None
                     ) -> tuple[int, list[Lookup]]:
        """The learner version, and for each (task id, trajectory id) its `Lookup` — one round trip.
        With `group_ids` (one per item) also whether each group is still pending."""
        pipe = self.r.pipeline(transaction=False)
        pipe.get(self.version_key)
        for k, (task_id, tid) in enumerate(items):
            pipe.hget(self.keys.tasks, task_id)
            pipe.sismember(self.keys.final_trajectories, tid)
            pipe.zscore(self.keys.pending_groups, group_ids[k] if group_ids is not None else "")
            pipe.getbit(self.keys.settled_tasks, task_cursor(task_id) or 0)
            pipe.hlen(self.keys.group_refills(group_ids[k] if group_ids is not None else ""))
        version_raw, *found = await pipe.execute()
        out = []
        for k, (task_id, tid) in enumerate(items):
            raw, final, pending, bit, refills = found[5 * k: 5 * k + 5]
            # A settled task makes its own G sample ids final; any other id claiming it never was.
            cursor = task_cursor(task_id) if member_task_id(tid) == task_id else None
            out.append(Lookup(json.loads(raw) if raw is not None else None, _final(final, cursor, bit),
                              group_pending=group_ids is None or pending is not None, refills=int(refills or 0)))
        return int(version_raw or 0), out

    async def intake_round(self, items: list[IntakeItem], *, eta: int, place: int) -> tuple[int, list[IntakeFacts]]:
        """The learner version and, for each item, `lookup`'s facts, its membership recorded as
        `record_members` would (valid when it is a valid member with no version past the learner's
        and not stale on arrival: its group pending and its oldest sampled version more than `eta`
        behind) and the finish of a group it completes (`kept_if_complete` accepted, `place` a kept
        group's batch place) — one atomic script, one round trip (`Admission.intake`)."""
        if not items:
            return int(await self.r.get(self.version_key) or 0), []
        args = []
        for it in items:
            cursor = task_cursor(it.task_id) if member_task_id(it.trajectory_id) == it.task_id else None
            args.append((it.task_id, it.trajectory_id, it.group_id, -1 if cursor is None else cursor,
                         int(it.valid_member), it.newest_version, it.oldest_sampled_version, it.held_after,
                         it.refills_known, it.kept_if_complete, int(it.last_of_group)))
        version, *replies = await self.admission.intake(self.version_key, args, eta=eta, place=place)
        out = []
        for recorded, valid, received, nvalid, raw, final, pending, refills, finish in replies:
            task = json.loads(raw) if raw is not None else None
            out.append(IntakeFacts(Lookup(task, bool(final), bool(pending), int(refills)), bool(recorded),
                                   bool(valid), (int(received), int(nvalid)), int(finish)))
        return int(version), out

    async def record_members(self, members: list[Membership]) -> list[tuple[int, int]]:
        """Each member's group membership, then the group's (received, valid) counts as they stand
        right after it — one MULTI (commands run in order, so counts are per member). Both sets
        are written together: a store killed between two separate writes once left a valid member
        counted as received but not valid, and its group completed without it. An invalid member
        leaves `valid` (a poison message whose trajectory an earlier store recorded valid)."""
        pipe = self.r.pipeline(transaction=True)
        for m in members:
            pipe.sadd(self.keys.open_groups, m.group_id)
            pipe.sadd(self.keys.group_received(m.group_id), m.trajectory_id)
            if m.valid:
                pipe.sadd(self.keys.group_valid(m.group_id), m.trajectory_id)
            else:  # e.g. poison: a member an earlier store recorded valid counts valid no more
                pipe.srem(self.keys.group_valid(m.group_id), m.trajectory_id)
            pipe.scard(self.keys.group_received(m.group_id))
            pipe.scard(self.keys.group_valid(m.group_id))
        results = await pipe.execute()
        out, k = [], 0
        for _ in members:
            k += 3
            out.append((int(results[k]), int(results[k + 1])))
            k += 2
        return out

    async def refill(self, group_id: str, failed_id: str, index: int, msg_id: str, data: bytes,
                     cap: int) -> tuple[int, int]:
        """Admit a refill of `group_id` in the place of its infra-failed member `failed_id`, as one
        atomic step (`Admission.refill`): (status, the group's refills after)."""
        return await self.admission.refill(group_id, failed_id=failed_id, index=index, msg_id=msg_id, data=data,
                                           cap=cap)

    async def leave_group(self, group_id: str, trajectory_ids: list[str]) -> None:
        """Members a selection dropped (GRPO-RoC) count valid no more: a group rebuilt after a
        store restart completes without them (their outcomes are final, they never come back)."""
        if trajectory_ids:
            await self.r.srem(self.keys.group_valid(group_id), *trajectory_ids)

    async def finish_group(self, group_id: str, *, accepted: int, rejected: int, place: int = 0) -> bool:
        """The gate's accounting for a complete (or abandoned) group, once per group id; True the
        first time (a group rebuilt after a store restart was counted already). `place`: the
        trajectories a kept group holds in the gate until trained (`Admission.finish_group`)."""
        return await self.admission.finish_group(group_id, accepted=accepted, rejected=rejected, place=place)

    async def accepted_members(self, group_ids: list[str]) -> set[str]:
        """Of these groups, the member ids the gate counted as accepted: the valid members of each
        group it finished as kept (`groups_accepted`)."""
        groups = list(dict.fromkeys(group_ids))
        if not groups:
            return set()
        kept = await self.r.hmget(self.keys.groups_accepted, groups)
        kept_groups = [gid for gid, n in zip(groups, kept, strict=True) if n is not None and int(n) > 0]
        return await self._valid_members(kept_groups)

    async def _valid_members(self, groups: list[str]) -> set[str]:
        """The union of these groups' `valid` membership sets."""
        if not groups:
            return set()
        pipe = self.r.pipeline(transaction=False)
        for gid in groups:
            pipe.smembers(self.keys.group_valid(gid))
        return {_text(t) for members in await pipe.execute() for t in members}

    async def finals(self, tids: list[str]) -> list[bool]:
        """Whether each id has a final outcome: marked final, or a member of a task whose group was
        settled and trimmed (`settled_tasks`; a learner replaying after its restart reports such
        ids again, and they must not be recorded twice)."""
        if not tids:
            return []
        pipe = self.r.pipeline(transaction=False)
        pipe.smismember(self.keys.final_trajectories, tids)
        cursors = [task_cursor(member_task_id(tid)) for tid in tids]
        for cursor in cursors:
            pipe.getbit(self.keys.settled_tasks, cursor or 0)
        marked, *bits = await pipe.execute()
        return [_final(m, c, b) for m, c, b in zip(marked, cursors, bits, strict=True)]

    async def mark_final(self, final_ids: list[str]) -> None:
        """Mark ids final (after their archive rows are on disk, before their messages are acked)."""
        if final_ids:
            await self.r.sadd(self.keys.final_trajectories, *final_ids)

    async def cleanup(self, groups: list[str], settled: Sequence[str] = ()) -> None:
        """Drop the membership sets of groups whose members are final (after the acks), and for
        the `settled` ones — complete, every member final — their gate records (`groups_done`,
        `groups_accepted`), their task's record and their members' final marks, in the same
        MULTI, so a run's Redis holds only what is in flight. What stays of a settled task is one
        bit at its sampler position (`settled_tasks`): a late redelivery of a member (an ack lost,
        a rollout resumed long after its task went elsewhere) is still known as a duplicate. Safe
        for recovery: a settled group's members are all final, so none can rebuild it, and the end
        of a run looks a task up only for members without a final outcome. A task id the store
        did not make (no sampler position) keeps its record and final marks."""
        if not groups and not settled:
            return
        trimmed = await self._settled_members(list(settled))
        pipe = self.r.pipeline(transaction=True)
        for gid in groups:
            pipe.delete(self.keys.group_received(gid), self.keys.group_valid(gid))
        if groups:
            pipe.srem(self.keys.open_groups, *groups)
        if settled:
            pipe.srem(self.keys.groups_done, *settled)
            pipe.hdel(self.keys.groups_accepted, *settled)
            # Only a settled group's refills go: the end of a run reads an unsettled one's
            # (`unfinished_members`) after its membership sets are cleaned up.
            pipe.delete(*(self.keys.group_refills(gid) for gid in settled))
        for task_id, (cursor, members) in trimmed.items():
            pipe.setbit(self.keys.settled_tasks, cursor, 1)
            pipe.hdel(self.keys.tasks, task_id)
            pipe.srem(self.keys.final_trajectories, *members)
        await pipe.execute()

    async def _settled_members(self, groups: list[str]) -> dict[str, tuple[int, list[str]]]:
        """Task id → (sampler position, member ids received) of these settled groups, for the
        tasks the store made (`task_cursor`); read before the cleanup's MULTI deletes the sets."""
        if not groups:
            return {}
        pipe = self.r.pipeline(transaction=False)
        for gid in groups:
            pipe.smembers(self.keys.group_received(gid))
        out: dict[str, tuple[int, list[str]]] = {}
        for members in await pipe.execute():
            for tid in sorted(_text(t) for t in members):
                task_id = member_task_id(tid)
                cursor = task_cursor(task_id)
                if cursor is not None:
                    out.setdefault(task_id, (cursor, []))[1].append(tid)
        return out

    # ------------------------------------------------------------------ recovery
    async def owed_ids(self) -> set[str]:
        """Ids a previous store held: valid members of groups still open, without a final outcome
        (their messages are unacked and will be redelivered). This partition's groups only."""
        groups = await self._open_groups()
        ids = sorted(await self._valid_members(groups))
        return {tid for tid, final in zip(ids, await self.finals(ids), strict=True) if not final}

    async def settled_open_groups(self, group_size: int) -> list[str]:
        """Open groups that are settled all the same: gate accounting done (`groups_done`) and at
        least `group_size` members received, every one final. A store killed after marking their
        ids final and before its cleanup left their records; a restarted store drops them."""
        groups = await self._open_groups()
        if not groups:
            return []
        done = await self.r.smismember(self.keys.groups_done, groups)
        candidates = [gid for gid, d in zip(groups, done, strict=True) if d]
        if not candidates:
            return []
        pipe = self.r.pipeline(transaction=False)
        for gid in candidates:
            pipe.smembers(self.keys.group_received(gid))
        received = [[_text(t) for t in members] for members in await pipe.execute()]
        ids = [tid for members in received for tid in members]
        final = dict(zip(ids, await self.finals(ids), strict=True))
        return [gid for gid, members in zip(candidates, received, strict=True)
                if len(members) >= group_size and all(final[t] for t in members)]

    async def _open_groups(self) -> list[str]:
        return [gid for gid in (_text(g) for g in await self.r.smembers(self.keys.open_groups)) if self.owns(gid)]

    async def unfinished_members(self) -> list[OpenMember]:
        """Every admitted trajectory id (task id + index: G per task, and each refill's
        `group_refills` index) of this partition's groups without a final outcome."""
        tasks = await self.r.hgetall(self.keys.tasks)
        owned = [(task_id, rec) for task_id, rec in ((_text(k), json.loads(raw)) for k, raw in tasks.items())
                 if self.owns(str(rec["group_id"]))]
        pipe = self.r.pipeline(transaction=False)
        for _, rec in owned:
            pipe.hvals(self.keys.group_refills(str(rec["group_id"])))
        candidates: list[OpenMember] = []
        for (task_id, rec), refills in zip(owned, await pipe.execute() if owned else [], strict=True):
            tids = member_ids(task_id, int(rec["group_size"])) + [f"{task_id}-{int(i)}" for i in refills]
            for tid in tids:
                candidates.append(OpenMember(tid, task_id, str(rec["group_id"]), str(rec.get("source", ""))))
        finals = await self.finals([c.trajectory_id for c in candidates])
        return [c for c, final in zip(candidates, finals, strict=True) if not final]

    async def abandon_groups(self, group_ids: list[str], group_size: int) -> int:
        """Free the gate capacity of groups that never completed (the run is over). Returns how many."""
        return sum([await self.finish_group(gid, accepted=0, rejected=group_size)
                    for gid in dict.fromkeys(group_ids)])
