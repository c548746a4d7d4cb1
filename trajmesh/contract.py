"""The trajectory contract: one typed class around the `trajmesh.v1.Trajectory` proto (docs/DESIGN.md §2).

Every service that produces or consumes trajectories goes through `Trajectory`: rollout workers build
one turn by turn with the `append_*` helpers, the store and the learner call `validate()` on intake
and quarantine anything it reports, and everyone ships `to_bytes()` / `Trajectory.from_bytes()`.

The per-token arrays travel as one packed columnar block (`token_block`, trajmesh/token_block.py):
the `append_*` helpers gather the engine's arrays and pack them once, when the message is first
needed; the `_T` views are numpy views of the block's bytes. A record written before the block
carries them in the repeated fields 10-13 and 31 instead and reads the same (its views are copies).

Layout of a multi-turn trajectory (per-token arrays, all of one length T)::

    tokens      | prompt .......... | sampled (turn 0) | observation | sampled (turn 1) | ...
    loss_mask   | 0 0 0 0 0 0 0 0 0 | 1 1 1 1 1 1 1 1  | 0 0 0 0 0 0 | 1 1 1 1 1 1 1 1  |
    logprobs    | 0.0 ............. | behavior log-p   | 0.0 ....... | behavior log-p   |
    versions    | -1 .............. | policy version   | -1 ........ | policy version   |

Each `append_*` call adds one `Span` covering the tokens it appended. The first span of a turn is
that turn's root: its parent is the previous turn's root (empty for the very first span), and the
other spans of the turn hang off it.

This module must import without torch (STYLE.md habit 6); numpy views are provided for the learner.
"""

from __future__ import annotations

import hashlib
import math
import struct
import uuid
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt
from google.protobuf.message import DecodeError

from trajmesh import token_block
from trajmesh.token_block import BlockError, TokenColumns
from trajmesh.v1 import trajectory_pb2

ActionType = trajectory_pb2.ActionType
TerminalReason = trajectory_pb2.TerminalReason
InfraCause = trajectory_pb2.InfraCause
ToolCallStatus = trajectory_pb2.ToolCallStatus

# Spans of these types hold tokens the policy sampled (loss mask 1); the others hold mask-0 tokens.
SAMPLED_ACTION_TYPES: frozenset[int] = frozenset(
    {trajectory_pb2.TEXT, trajectory_pb2.TOOL_CALL, trajectory_pb2.CODE}
)
UNSAMPLED_ACTION_TYPES: frozenset[int] = frozenset({trajectory_pb2.PROMPT, trajectory_pb2.OBSERVATION})
# Terminal reasons that cut an episode short of its natural end (proto comments).
TRUNCATING_REASONS: frozenset[int] = frozenset({trajectory_pb2.MAX_TOKENS, trajectory_pb2.MAX_TURNS})

# The behavior version of tokens the policy did not sample.
UNSAMPLED_VERSION = -1

# Every name `Trajectory.validate` can report, in the order it checks them.
VIOLATION_NAMES: tuple[str, ...] = (
    "missing_trajectory_id",
    "missing_task_id",
    "token_block_mixed",
    token_block.MALFORMED,
    token_block.LENGTH,
    token_block.CHECKSUM,
    "length_mismatch",
    "empty_tokens",
    "token_out_of_vocab",
    "mask_not_binary",
    "no_action_tokens",
    "logprob_not_finite",
    "logprob_positive",
    "action_version_negative",
    "masked_version_not_minus_one",
    "teacher_logprob_invalid",
    "version_from_future",
    "terminal_reason_unspecified",
    "span_out_of_range",
    "span_mask_mismatch",
    "reward_not_finite",
    "sequence_starts_invalid",
)


class ContractError(ValueError):
    """Bytes that are not a trajectory, or a construction call that would break the contract."""


@dataclass(frozen=True)
class Violation:
    """One broken invariant: `name` is a stable snake_case reason (see VIOLATION_NAMES)."""

    name: str
    detail: str


def _where(bad_T: npt.NDArray[np.bool_], what: str) -> str:
    """'3 token(s) <what>, first at index 5' for a boolean mask of offending positions."""
    idx = np.flatnonzero(bad_T)
    return f"{idx.size} token(s) {what}, first at index {int(idx[0])}"


_PER_TOKEN_FIELDS = ("token_ids", "loss_mask", "behavior_logprobs", "behavior_versions", "teacher_logprobs")
"""The repeated per-token fields of records written before `token_block`."""
_COLUMN_DTYPES: tuple[tuple[str, type[np.generic]], ...] = (
    ("token_ids", np.int64), ("loss_mask", np.int64), ("behavior_logprobs", np.float32),
    ("behavior_versions", np.int64), ("teacher_logprobs", np.float32),
)
"""`TokenColumns`' fields in order, with the dtype a replacement is read as (ints wide, so the
block's encoder sees a value out of its column's range rather than a wrapped one)."""


class Trajectory:
    """A typed view over one `trajectory_pb2.Trajectory`; the message itself is `.pb`.

    Per-token numpy views carry the `_T` suffix (T = number of tokens). They are read-only views of
    the token block (copies for a record without one). The per-token arrays change only through
    this class's methods: a message whose block or repeated fields were edited through `.pb` is
    read again by a new `Trajectory(pb)`.
    """

    __slots__ = ("_pb", "_cols", "_pending")

    def __init__(self, pb: trajectory_pb2.Trajectory | None = None) -> None:
        self._pb: trajectory_pb2.Trajectory = pb if pb is not None else trajectory_pb2.Trajectory()
        self._cols: TokenColumns | None = None
        """The per-token arrays of `_pb` (decoded on first use, kept: the block's bytes are copied
        out of the message once)."""
        self._pending: list[TokenColumns] = []
        """Arrays appended since the block was last packed (`_pack` runs when the message is read)."""

    @property
    def pb(self) -> trajectory_pb2.Trajectory:
        """The message, with every appended token packed into its block."""
        if self._pending:
            self._pack()
        return self._pb

    # ---------------------------------------------------------------- creation and wire format

    @classmethod
    def new(
        cls,
        task: trajectory_pb2.Task | None = None,
        *,
        trajectory_id: str | None = None,
        manifest_id: str = "",
        environment_revision: str = "",
        initial_state_hash: str = "",
        rollout_worker: str = "",
        created_unix_seconds: float = 0.0,
    ) -> Trajectory:
        """A fresh, empty trajectory for `task` (ids, source, revision and seed copied from it).

        `trajectory_id` defaults to a uuid4 hex string; `manifest_id` defaults to the task's.
        """
        pb = trajectory_pb2.Trajectory(
            trajectory_id=trajectory_id if trajectory_id is not None else uuid.uuid4().hex,
            manifest_id=manifest_id,
            environment_revision=environment_revision,
            initial_state_hash=initial_state_hash,
            rollout_worker=rollout_worker,
        )
        if task is not None:
            pb.task_id = task.task_id
            pb.group_id = task.group_id
            pb.task_source = task.source
            pb.task_revision = task.revision
            pb.reset_seed = task.seed
            if not manifest_id:
                pb.manifest_id = task.manifest_id
        pb.timing.created_unix_seconds = created_unix_seconds
        return cls(pb)

    def to_bytes(self) -> bytes:
        """Deterministic protobuf wire bytes (map entries sorted); float32 log-probs bit-exact."""
        return self.pb.SerializeToString(deterministic=True)

    @property
    def token_block(self) -> bytes:
        """The packed per-token arrays (b"" for a record written before the block, and for an
        empty trajectory that never had one)."""
        return self.pb.token_block

    @classmethod
    def from_bytes(cls, data: bytes | bytearray | memoryview) -> Trajectory:
        """Parse wire bytes; raises ContractError if they are not a trajectory."""
        pb = trajectory_pb2.Trajectory()
        try:
            pb.ParseFromString(bytes(data))
        except DecodeError as exc:
            raise ContractError(f"not a trajectory: protobuf decode failed ({exc})") from exc
        if not pb.trajectory_id and len(pb.token_ids) == 0 and not pb.token_block:
            raise ContractError(
                f"not a trajectory: {len(data)} byte(s) decode to no trajectory_id and no tokens"
            )
        return cls(pb)

    def __len__(self) -> int:
        return self.num_tokens

    def __repr__(self) -> str:
        return (
            f"Trajectory(id={self.trajectory_id!r}, task={self.task_id!r}, tokens={len(self)}, "
            f"spans={len(self._pb.spans)}, terminal={TerminalReason.Name(self._pb.terminal_reason)})"
        )

    # ---------------------------------------------------------------- the per-token arrays

    def _columns(self) -> TokenColumns:
        """Every token's arrays, packed first if any were appended. Raises ContractError on a
        block that cannot be read (`validate` names what is wrong with it)."""
        if self._pending:
            self._pack()
        return self._stored()

    def _stored(self) -> TokenColumns:
        """The arrays in the message (without those still pending)."""
        if self._cols is None:
            block = self._pb.token_block
            if block:
                try:  # the checksum is `validate`'s: a view needs only a sound layout
                    self._cols = token_block.decode(block, check_crc=False)
                except BlockError as exc:
                    raise ContractError(f"unreadable token block: {exc}") from exc
            else:
                pb = self._pb
                teacher = np.array(pb.teacher_logprobs, dtype=np.float32) if len(pb.teacher_logprobs) else None
                self._cols = TokenColumns(np.array(pb.token_ids, dtype=np.uint32),
                                          np.array(pb.loss_mask, dtype=np.uint32),
                                          np.array(pb.behavior_logprobs, dtype=np.float32),
                                          np.array(pb.behavior_versions, dtype=np.int64), teacher)
        return self._cols

    def _append_columns(self, cols: TokenColumns) -> None:
        if self._stored().teacher_logprobs_T is not None:
            raise ContractError("tokens appended after a teacher scored the trajectory")
        self._pending.append(cols)

    def _pack(self) -> None:
        """Writes the stored and pending arrays as the message's block (a record in the old
        layout moves to the block: its repeated fields are cleared)."""
        stored = self._stored()
        self._set_columns(token_block.concat_columns([stored, *self._pending] if stored.num_tokens else self._pending))

    def _set_columns(self, cols: TokenColumns) -> None:
        block = token_block.encode(cols)
        for name in _PER_TOKEN_FIELDS:
            self._pb.ClearField(name)  # type: ignore[arg-type]
        self._pb.token_block = block
        self._pending = []
        self._cols = token_block.decode(block, check_crc=False)

    def replace_token_arrays(self, **arrays_T: npt.ArrayLike) -> None:
        """Replaces whole per-token arrays by name (`token_ids`, `loss_mask`, `behavior_logprobs`,
        `behavior_versions`, `teacher_logprobs`), each of the trajectory's length: what a tool or
        a test that edits tokens calls (a record in the old layout moves to the block)."""
        cols = self._columns()
        values = {name: getattr(cols, f"{name}_T") for name in _PER_TOKEN_FIELDS}
        unknown = set(arrays_T) - set(values)
        if unknown:
            raise ContractError(f"replace_token_arrays: no per-token array {sorted(unknown)}")
        values.update({name: np.asarray(v).reshape(-1) for name, v in arrays_T.items()})
        typed: dict[str, Any] = {name: None if values[name] is None else np.asarray(values[name], dtype=dtype)
                                 for name, dtype in _COLUMN_DTYPES}
        try:
            self._set_columns(TokenColumns(**{f"{name}_T": array for name, array in typed.items()}))
        except ValueError as exc:
            raise ContractError(str(exc)) from exc

    # ---------------------------------------------------------------- typed fields

    @property
    def trajectory_id(self) -> str:
        return self.pb.trajectory_id

    @property
    def task_id(self) -> str:
        return self.pb.task_id

    @property
    def group_id(self) -> str:
        return self.pb.group_id

    @property
    def manifest_id(self) -> str:
        return self.pb.manifest_id

    @property
    def num_tokens(self) -> int:
        """T, the length of every per-token array (token_ids' length if they disagree; 0 for a
        block that cannot be read, so `len` and truth tests never raise)."""
        try:
            stored = self._stored().num_tokens
        except ContractError:
            return 0
        return stored + sum(p.num_tokens for p in self._pending)

    @property
    def prompt_length(self) -> int:
        """Tokens before the first sampled token."""
        return self.pb.prompt_length

    @property
    def spans(self) -> Sequence[trajectory_pb2.Span]:
        return self.pb.spans

    @property
    def tool_calls(self) -> Sequence[trajectory_pb2.ToolCall]:
        return self.pb.tool_calls

    @property
    def reward(self) -> float:
        """Scalar reward from the grader (meaningful only when `graded`)."""
        return self.pb.reward

    @property
    def graded(self) -> bool:
        return self.pb.graded

    @property
    def terminal_reason(self) -> trajectory_pb2.TerminalReason:
        return self.pb.terminal_reason

    @property
    def truncated(self) -> bool:
        return self.pb.truncated

    @property
    def infra_cause(self) -> trajectory_pb2.InfraCause:
        """Which infrastructure failed it (INFRA_CAUSE_UNSPECIFIED unless it ended INFRA_FAILURE
        through `fail_infra`; a record written before the field ended INFRA_FAILURE reads so too)."""
        return self.pb.infra_cause

    @property
    def num_turns(self) -> int:
        """1 + the largest span turn_index (0 for a trajectory without spans)."""
        return 1 + max((s.turn_index for s in self.pb.spans), default=-1)

    # ---------------------------------------------------------------- numpy views

    @property
    def token_ids_T(self) -> npt.NDArray[np.uint32]:
        """uint32 token ids (a read-only view of the block)."""
        return self._columns().token_ids_T

    @property
    def loss_mask_T(self) -> npt.NDArray[np.unsignedinteger[Any]]:
        """The loss mask, uint8 in the block (uint32 in a record written before it)."""
        return self._columns().loss_mask_T

    @property
    def behavior_logprobs_T(self) -> npt.NDArray[np.float32]:
        """float32 behavior log-probs, bit-exact as stored (finite values, infinities, NaNs)."""
        return self._columns().behavior_logprobs_T

    @property
    def behavior_versions_T(self) -> npt.NDArray[np.signedinteger[Any]]:
        """int32 in the block when every version fits (else int64), int64 in a record written before it."""
        return self._columns().behavior_versions_T

    @property
    def teacher_logprobs_T(self) -> npt.NDArray[np.float32] | None:
        """The teacher's float32 log-prob of each token (on-policy distillation); None when no
        teacher scored this trajectory."""
        return self._columns().teacher_logprobs_T

    def set_teacher_logprobs(self, logprobs_T: npt.ArrayLike, teacher: str) -> None:
        """Records a teacher's log-probs of every token (0 is stored where loss_mask is 0) and its name."""
        lp_T = np.where(self.loss_mask_T == 1, np.asarray(logprobs_T, dtype=np.float32), np.float32(0.0))
        self.replace_token_arrays(teacher_logprobs=lp_T)
        self._pb.teacher = teacher

    # ---------------------------------------------------------------- construction helpers

    def append_prompt(
        self, token_ids: Sequence[int] | npt.ArrayLike, turn_index: int = 0
    ) -> trajectory_pb2.Span:
        """Append prompt/system tokens (mask 0, log-prob 0.0, version -1) as one PROMPT span."""
        return self._append_unsampled(token_ids, trajectory_pb2.PROMPT, turn_index)

    def start_segment(self) -> None:
        """The tokens appended next begin a new sequence (an agent session's segment, see
        ``sequence_starts``): the learner trains it as a row of its own. Append its prompt first."""
        starts, n = self._pb.sequence_starts, self.num_tokens
        if not starts:
            starts.append(0)
        if n > starts[-1]:
            starts.append(n)

    def append_observation(
        self, token_ids: Sequence[int] | npt.ArrayLike, turn_index: int | None = None
    ) -> trajectory_pb2.Span:
        """Append tool output / environment observation tokens (mask 0, version -1).

        `turn_index` defaults to the turn of the last span (the turn whose action it answers).
        """
        return self._append_unsampled(token_ids, trajectory_pb2.OBSERVATION, turn_index)

    def append_sampled(
        self,
        token_ids: Sequence[int] | npt.ArrayLike,
        logprobs: Sequence[float] | npt.ArrayLike,
        versions: int | Sequence[int] | npt.ArrayLike,
        action_type: trajectory_pb2.ActionType = trajectory_pb2.TEXT,
        turn_index: int | None = None,
    ) -> trajectory_pb2.Span:
        """Append tokens the policy sampled (mask 1) with their behavior log-probs and versions.

        `versions` is the policy version that sampled each token: one int for the whole segment or
        one per token (a segment may straddle a weight update). `turn_index` defaults to the turn
        of the last span.
        """
        if action_type not in SAMPLED_ACTION_TYPES:
            raise ContractError(
                f"append_sampled needs TEXT, TOOL_CALL or CODE, got {ActionType.Name(action_type)}"
            )
        ids_T = _as_token_ids(token_ids)
        logprobs_T = _as_array(logprobs, np.float32, "d")
        if isinstance(versions, (int, np.integer)):
            versions_T = np.full(ids_T.size, int(versions), dtype=np.int64)
        else:
            versions_T = _as_array(versions, np.int64, "q")  # an engine's list: packed, not converted one by one
        if not (ids_T.size == logprobs_T.size == versions_T.size):
            raise ContractError(
                f"append_sampled: {ids_T.size} token ids, {logprobs_T.size} logprobs, {versions_T.size} versions"
            )
        span = self._new_span(action_type, turn_index, ids_T.size)
        self._append_columns(TokenColumns(ids_T, np.ones(ids_T.size, np.uint8), logprobs_T, versions_T))
        return span

    def add_tool_call(
        self,
        tool_name: str,
        request: str,
        response: bytes | str = b"",
        *,
        status: trajectory_pb2.ToolCallStatus = trajectory_pb2.TOOL_OK,
        latency_seconds: float = 0.0,
        span_id: str | None = None,
    ) -> trajectory_pb2.ToolCall:
        """Record a tool call; the response is stored as its sha256 hex digest.

        `span_id` defaults to the last TOOL_CALL span (the tokens in which the policy wrote the call).
        """
        if span_id is None:
            tool_spans = [s.span_id for s in self.pb.spans if s.action_type == trajectory_pb2.TOOL_CALL]
            if not tool_spans:
                raise ContractError("add_tool_call: no TOOL_CALL span yet; append one or pass span_id")
            span_id = tool_spans[-1]
        body = response.encode("utf-8") if isinstance(response, str) else response
        return self.pb.tool_calls.add(
            span_id=span_id,
            tool_name=tool_name,
            request=request,
            response_sha256=hashlib.sha256(body).hexdigest(),
            latency_seconds=latency_seconds,
            status=status,
        )

    def finish(
        self, terminal_reason: trajectory_pb2.TerminalReason, *, truncated: bool | None = None
    ) -> None:
        """Set why the episode ended; `truncated` defaults to MAX_TOKENS / MAX_TURNS."""
        self.pb.terminal_reason = terminal_reason
        self.pb.truncated = terminal_reason in TRUNCATING_REASONS if truncated is None else truncated

    def fail_infra(self, cause: trajectory_pb2.InfraCause, detail: str = "") -> None:
        """End it as an infrastructure failure (terminal_reason INFRA_FAILURE) caused by `cause`:
        the one way the engine, environment, agent, teacher, grader and deadline paths mark one.
        Never rewarded or trained; the store refills its group (docs/RELIABILITY.md). `detail`
        goes to verifier_output. Truncation is left as it was."""
        if cause == trajectory_pb2.INFRA_CAUSE_UNSPECIFIED:
            raise ContractError("fail_infra: name the infrastructure that failed")
        self.pb.terminal_reason = trajectory_pb2.INFRA_FAILURE
        self.pb.infra_cause = cause
        if detail:
            self.pb.verifier_output = detail

    def past_deadline(self, now: float) -> bool:
        """Whether `now` (unix seconds) is past the sample's deadline (`timing.deadline_unix_seconds`;
        none set: never)."""
        deadline = self.pb.timing.deadline_unix_seconds
        return deadline > 0 and now > deadline

    def set_reward(
        self,
        reward: float,
        *,
        components: Mapping[str, float] | None = None,
        grader_revision: str = "",
        verifier_output: str = "",
    ) -> None:
        """Record the grader's verdict and mark the trajectory graded."""
        self.pb.reward = reward
        self.pb.graded = True
        self.pb.raw_reward_components.clear()
        self.pb.raw_reward_components.update(components or {})
        self.pb.grader_revision = grader_revision
        self.pb.verifier_output = verifier_output

    def _append_unsampled(
        self,
        token_ids: Sequence[int] | npt.ArrayLike,
        action_type: trajectory_pb2.ActionType,
        turn_index: int | None,
    ) -> trajectory_pb2.Span:
        ids_T = _as_token_ids(token_ids)
        # Everything so far is prompt (no sampled token yet): the prompt grows with these tokens.
        n = self.num_tokens
        extends_prompt = self._pb.prompt_length == n
        span = self._new_span(action_type, turn_index, ids_T.size)
        self._append_columns(TokenColumns(ids_T, np.zeros(ids_T.size, np.uint8), np.zeros(ids_T.size, np.float32),
                                          np.full(ids_T.size, UNSAMPLED_VERSION, np.int64)))
        if extends_prompt:
            self._pb.prompt_length = n + ids_T.size
        return span

    def _new_span(
        self, action_type: trajectory_pb2.ActionType, turn_index: int | None, num_tokens: int
    ) -> trajectory_pb2.Span:
        """Add a span over the next `num_tokens` tokens, wired to its turn's root (see module doc)."""
        spans = self._pb.spans
        if turn_index is None:
            turn_index = spans[-1].turn_index if spans else 0
        if turn_index < 0:
            raise ContractError(f"turn_index must be >= 0, got {turn_index}")
        parent = ""
        earlier_roots: dict[int, str] = {}
        for s in spans:
            earlier_roots.setdefault(s.turn_index, s.span_id)
        if turn_index in earlier_roots:
            parent = earlier_roots[turn_index]
        elif earlier_roots and min(earlier_roots) < turn_index:
            parent = earlier_roots[max(t for t in earlier_roots if t < turn_index)]
        start = self.num_tokens
        return spans.add(
            span_id=self._next_span_id(),
            parent_span_id=parent,
            turn_index=turn_index,
            action_type=action_type,
            token_start=start,
            token_end=start + num_tokens,
        )

    def _next_span_id(self) -> str:
        """'<trajectory_id>/<n>': unique within and across trajectories, deterministic for tests."""
        taken = {s.span_id for s in self._pb.spans}
        n = len(self._pb.spans)
        while f"{self._pb.trajectory_id}/{n}" in taken:
            n += 1
        return f"{self._pb.trajectory_id}/{n}"

    # ---------------------------------------------------------------- invariants

    def validate(
        self, *, vocab_size: int | None = None, learner_version: int | None = None
    ) -> list[Violation]:
        """Every broken invariant of docs/DESIGN.md §2, each once, by name; [] when the trajectory is sound.

        `vocab_size` enables the vocabulary check, `learner_version` the no-future-versions check.
        Per-token checks that relate two arrays look at their common prefix, so a length mismatch
        does not hide other problems.
        """
        block = list(self._check_block())
        if block:  # no per-token array to check: name what is wrong with the block, and the rest
            return [*self._check_identity(), *block, *self._check_terminal_reason(), *self._check_reward()]
        return [
            *self._check_identity(),
            *self._check_tokens(vocab_size, learner_version),
            *self._check_terminal_reason(),
            *self._check_spans(),
            *self._check_reward(),
            *self._check_sequence_starts(),
        ]

    def _check_block(self) -> Iterator[Violation]:
        """The block's header, length and checksum (trajmesh/token_block.py), and that a record
        with a block leaves the old repeated per-token fields empty."""
        pb = self.pb
        block = pb.token_block
        if not block:
            return
        mixed = [name for name in _PER_TOKEN_FIELDS if len(getattr(pb, name))]
        if mixed:
            yield Violation("token_block_mixed", "a token block and the repeated field(s) " + ", ".join(mixed))
            return
        try:
            cols = token_block.decode(block)
        except BlockError as exc:
            yield Violation(exc.name, exc.detail)
            return
        self._cols = cols  # the bytes just checked are the ones the views read

    def _check_identity(self) -> Iterator[Violation]:
        if not self.pb.trajectory_id:
            yield Violation("missing_trajectory_id", "trajectory_id is empty")
        if not self.pb.task_id:
            yield Violation("missing_task_id", "task_id is empty")

    def _check_tokens(self, vocab_size: int | None, learner_version: int | None) -> Iterator[Violation]:
        ids_T, mask_T = self.token_ids_T, self.loss_mask_T
        logprobs_T, versions_T = self.behavior_logprobs_T, self.behavior_versions_T
        lengths = {
            "token_ids": ids_T.size,
            "loss_mask": mask_T.size,
            "behavior_logprobs": logprobs_T.size,
            "behavior_versions": versions_T.size,
        }
        if (teacher := self.teacher_logprobs_T) is not None:
            lengths["teacher_logprobs"] = teacher.size
        if len(set(lengths.values())) > 1:
            yield Violation("length_mismatch", ", ".join(f"{k}={v}" for k, v in lengths.items()))
        if (teacher_T := self.teacher_logprobs_T) is not None and teacher_T.size == mask_T.size:
            act_T = mask_T == 1
            if (bad_T := act_T & ~(np.isfinite(teacher_T) & (teacher_T <= 0))).any():
                yield Violation("teacher_logprob_invalid", _where(bad_T, "with a teacher log-prob not finite and <= 0"))
        infra = self._pb.terminal_reason == trajectory_pb2.INFRA_FAILURE
        if ids_T.size == 0 and not infra:  # an episode whose environment never answered has none
            yield Violation("empty_tokens", "token_ids is empty")
        if vocab_size is not None and (oov_T := ids_T >= vocab_size).any():
            yield Violation("token_out_of_vocab", _where(oov_T, f">= vocab_size {vocab_size}"))
        if (nonbinary_T := (mask_T != 0) & (mask_T != 1)).any():
            yield Violation("mask_not_binary", _where(nonbinary_T, "with loss_mask not in {0, 1}"))
        if not (mask_T == 1).any() and not infra:
            yield Violation("no_action_tokens", "no token has loss_mask 1")

        n = min(lengths.values())
        act_T, lp_T, ver_T = mask_T[:n] == 1, logprobs_T[:n], versions_T[:n]
        finite_T = np.isfinite(lp_T)
        if (bad_T := act_T & ~finite_T).any():
            yield Violation(
                "logprob_not_finite", _where(bad_T, "sampled with a non-finite behavior log-prob")
            )
        if (bad_T := act_T & finite_T & (lp_T > 0)).any():
            yield Violation("logprob_positive", _where(bad_T, "sampled with a behavior log-prob > 0"))
        if (bad_T := act_T & (ver_T < 0)).any():
            yield Violation("action_version_negative", _where(bad_T, "sampled with a behavior version < 0"))
        if (bad_T := (mask_T[:n] == 0) & (ver_T != UNSAMPLED_VERSION)).any():
            yield Violation(
                "masked_version_not_minus_one",
                _where(bad_T, "masked out with a behavior version != -1")
            )
        if learner_version is not None and (bad_T := versions_T > learner_version).any():
            yield Violation(
                "version_from_future",
                _where(bad_T, f"with behavior version > learner version {learner_version}"),
            )

    def _check_terminal_reason(self) -> Iterator[Violation]:
        reason = int(self.pb.terminal_reason)
        if reason == trajectory_pb2.TERMINAL_REASON_UNSPECIFIED or reason not in TerminalReason.values():
            yield Violation(
                "terminal_reason_unspecified", f"terminal_reason is {reason}, not one of the known ends"
            )

    def _check_spans(self) -> Iterator[Violation]:
        mask_T = self.loss_mask_T
        num_tokens = self.num_tokens
        out_of_range: list[str] = []
        mismatched: list[str] = []
        for s in self.pb.spans:
            if s.token_start > s.token_end or s.token_end > num_tokens:
                out_of_range.append(f"{s.span_id}=[{s.token_start},{s.token_end})")
                continue
            covered_T = mask_T[s.token_start : s.token_end]
            name = ActionType.Name(s.action_type)
            if s.action_type in UNSAMPLED_ACTION_TYPES and (covered_T == 1).any():
                mismatched.append(f"{name} span {s.span_id} covers mask-1 tokens")
            elif s.action_type in SAMPLED_ACTION_TYPES and (covered_T == 0).any():
                mismatched.append(f"{name} span {s.span_id} covers mask-0 tokens")
        if out_of_range:
            detail = f"{len(out_of_range)} span(s) outside [0, {num_tokens}]: " + "; ".join(out_of_range[:3])
            yield Violation("span_out_of_range", detail)
        if mismatched:
            yield Violation("span_mask_mismatch", f"{len(mismatched)} span(s): " + "; ".join(mismatched[:3]))

    def _check_reward(self) -> Iterator[Violation]:
        rewards = {"reward": self.pb.reward}
        rewards.update({f"raw_reward_components[{k!r}]": v for k, v in self.pb.raw_reward_components.items()})
        bad = sorted(k for k, v in rewards.items() if not math.isfinite(v))
        if bad:
            yield Violation("reward_not_finite", "non-finite: " + ", ".join(bad))


    def _check_sequence_starts(self) -> Iterator[Violation]:
        """``sequence_starts`` (an agent session's segments): first 0, strictly increasing, each
        inside the tokens and on a mask-0 token (every segment opens with its prompt)."""
        starts = list(self.pb.sequence_starts)
        if not starts:
            return
        n = self.num_tokens
        problems = []
        if starts[0] != 0:
            problems.append(f"first start is {starts[0]}, not 0")
        if any(b <= a for a, b in zip(starts, starts[1:], strict=False)):
            problems.append(f"not strictly increasing: {starts[:8]}")
        if any(s >= n for s in starts):
            problems.append(f"a start at or past the {n} tokens: {starts[-1]}")
        mask_T = self.loss_mask_T
        opens = [s for s in starts if s < min(n, mask_T.size) and mask_T[s] != 0]
        if opens:
            problems.append(f"segment(s) starting on a mask-1 token at {opens[:3]} (no prompt)")
        if problems:
            yield Violation("sequence_starts_invalid", "; ".join(problems))

    def segment_bounds(self) -> list[tuple[int, int]]:
        """[start, end) of each sequence in the per-token arrays: one (0, T) unless
        ``sequence_starts`` splits the trajectory into an agent session's segments."""
        n = self.num_tokens
        starts = [s for s in self._pb.sequence_starts if s < n] or [0]
        return [(a, b) for a, b in zip(starts, [*starts[1:], n], strict=True) if b > a]


def _as_array(values: Sequence[float] | npt.ArrayLike, dtype: type[np.generic], code: str) -> npt.NDArray[Any]:
    """`values` as a flat array of `dtype`. A Python list (what engines return) goes through
    `struct.pack` as C type `code` (q: int64, d: a Python float), then `dtype`: 2-3x faster than
    `np.asarray` on 4k elements; a list `struct` refuses (a float token id, a string, an int
    beyond int64) takes `np.asarray`, as before, and so does every other input."""
    if isinstance(values, list):
        try:
            packed = struct.pack(f"<{len(values)}{code}", *values)
        except (struct.error, OverflowError, TypeError):
            pass
        else:
            return np.frombuffer(packed, dtype=_STRUCT_DTYPES[code]).astype(dtype, copy=False)
    return np.asarray(values, dtype=dtype).reshape(-1)


_STRUCT_DTYPES: dict[str, type[np.generic]] = {"q": np.int64, "d": np.float64}


def _as_token_ids(token_ids: Sequence[int] | npt.ArrayLike) -> npt.NDArray[np.int64]:
    ids_T = _as_array(token_ids, np.int64, "q")
    if ids_T.size and (ids_T.min() < 0 or ids_T.max() > _UINT32_MAX):
        raise ContractError("token ids must fit in uint32")
    return ids_T


def varint(value: int) -> bytes:
    """One protobuf varint (a non-negative int below 2**64; the store frames NextBatch with it)."""
    if value < 0x80:
        return bytes((value,))
    if value < 0x4000:
        return bytes((value & 0x7F | 0x80, value >> 7))
    out = bytearray()
    while value >= 0x80:
        out.append((value & 0x7F) | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


_UINT32_MAX = int(np.iinfo(np.uint32).max)
