"""The trajectory contract: one typed class around the `trajmesh.v1.Trajectory` proto (docs/DESIGN.md §2).

Every service that produces or consumes trajectories goes through `Trajectory`: rollout workers build
one turn by turn with the `append_*` helpers, the store and the learner call `validate()` on intake
and quarantine anything it reports, and everyone ships `to_bytes()` / `Trajectory.from_bytes()`.

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


class Trajectory:
    """A typed view over one `trajectory_pb2.Trajectory`; the message itself is `.pb`.

    Per-token numpy views carry the `_T` suffix (T = number of tokens) and are fresh copies.
    """

    __slots__ = ("pb",)

    def __init__(self, pb: trajectory_pb2.Trajectory | None = None) -> None:
        self.pb: trajectory_pb2.Trajectory = pb if pb is not None else trajectory_pb2.Trajectory()

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

    @classmethod
    def from_bytes(cls, data: bytes | bytearray | memoryview) -> Trajectory:
        """Parse wire bytes; raises ContractError if they are not a trajectory."""
        pb = trajectory_pb2.Trajectory()
        try:
            pb.ParseFromString(bytes(data))
        except DecodeError as exc:
            raise ContractError(f"not a trajectory: protobuf decode failed ({exc})") from exc
        if not pb.trajectory_id and len(pb.token_ids) == 0:
            raise ContractError(
                f"not a trajectory: {len(data)} byte(s) decode to no trajectory_id and no tokens"
            )
        return cls(pb)

    def __len__(self) -> int:
        return len(self.pb.token_ids)

    def __repr__(self) -> str:
        return (
            f"Trajectory(id={self.trajectory_id!r}, task={self.task_id!r}, tokens={len(self)}, "
            f"spans={len(self.pb.spans)}, terminal={TerminalReason.Name(self.pb.terminal_reason)})"
        )

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
        """T, the length of every per-token array (token_ids' length if they disagree)."""
        return len(self.pb.token_ids)

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
    def token_ids_T(self) -> npt.NDArray[np.int64]:
        return np.array(self.pb.token_ids, dtype=np.int64)

    @property
    def loss_mask_T(self) -> npt.NDArray[np.int64]:
        return np.array(self.pb.loss_mask, dtype=np.int64)

    @property
    def behavior_logprobs_T(self) -> npt.NDArray[np.float32]:
        """float32 behavior log-probs, bit-exact as stored (finite values, infinities, NaNs).

        The arrays are copied through the repeated fields' buffer protocol (upb), ~30x faster than
        iterating them; any NaN fails `validate()` anyway.
        """
        return np.array(self.pb.behavior_logprobs, dtype=np.float32)

    @property
    def behavior_versions_T(self) -> npt.NDArray[np.int64]:
        return np.array(self.pb.behavior_versions, dtype=np.int64)

    @property
    def teacher_logprobs_T(self) -> npt.NDArray[np.float32] | None:
        """The teacher's float32 log-prob of each token (on-policy distillation); None when no
        teacher scored this trajectory."""
        return np.array(self.pb.teacher_logprobs, dtype=np.float32) if len(self.pb.teacher_logprobs) else None

    def set_teacher_logprobs(self, logprobs_T: npt.ArrayLike, teacher: str) -> None:
        """Records a teacher's log-probs of every token (0 is stored where loss_mask is 0) and its name."""
        lp_T = np.where(self.loss_mask_T == 1, np.asarray(logprobs_T, dtype=np.float32), np.float32(0.0))
        del self.pb.teacher_logprobs[:]
        payload = lp_T.astype("<f4").tobytes()
        self.pb.MergeFromString(b"".join([_TEACHER_LOGPROBS_KEY, varint(len(payload)), payload]))
        self.pb.teacher = teacher

    # ---------------------------------------------------------------- construction helpers

    def append_prompt(
        self, token_ids: Sequence[int] | npt.ArrayLike, turn_index: int = 0
    ) -> trajectory_pb2.Span:
        """Append prompt/system tokens (mask 0, log-prob 0.0, version -1) as one PROMPT span."""
        return self._append_unsampled(token_ids, trajectory_pb2.PROMPT, turn_index)

    def start_segment(self) -> None:
        """The tokens appended next begin a new sequence (an agent session's segment, see
        ``sequence_starts``): the learner trains it as a row of its own. Append its prompt first."""
        if not self.pb.sequence_starts:
            self.pb.sequence_starts.append(0)
        if len(self.pb.token_ids) > self.pb.sequence_starts[-1]:
            self.pb.sequence_starts.append(len(self.pb.token_ids))

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
            versions_T = np.asarray(versions, dtype=np.int64).reshape(-1)
        if not (ids_T.size == logprobs_T.size == versions_T.size):
            raise ContractError(
                f"append_sampled: {ids_T.size} token ids, {logprobs_T.size} logprobs, {versions_T.size} versions"
            )
        span = self._new_span(action_type, turn_index, ids_T.size)
        if ids_T.size < _WIRE_FROM_TOKENS:
            self.pb.token_ids.extend(ids_T.tolist())
            self.pb.loss_mask.extend([1] * ids_T.size)
            self.pb.behavior_logprobs.extend(logprobs_T.tolist())
            self.pb.behavior_versions.extend(versions_T.tolist())
            return span
        versions = varint(int(versions) & _UINT64_MASK) * ids_T.size if isinstance(versions, (int, np.integer)) \
            else _varints(versions_T)
        self._extend_per_token(_varints(ids_T), b"\x01" * ids_T.size, logprobs_T.astype("<f4").tobytes(), versions)
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
        extends_prompt = self.pb.prompt_length == len(self.pb.token_ids)
        span = self._new_span(action_type, turn_index, ids_T.size)
        if ids_T.size < _WIRE_FROM_TOKENS:
            self.pb.token_ids.extend(ids_T.tolist())
            self.pb.loss_mask.extend([0] * ids_T.size)
            self.pb.behavior_logprobs.extend([0.0] * ids_T.size)
            self.pb.behavior_versions.extend([UNSAMPLED_VERSION] * ids_T.size)
        else:
            self._extend_per_token(_varints(ids_T), bytes(ids_T.size), bytes(4 * ids_T.size),
                                   _UNSAMPLED_VERSION_VARINT * ids_T.size)
        if extends_prompt:
            self.pb.prompt_length = len(self.pb.token_ids)
        return span

    def _extend_per_token(self, token_ids: bytes, loss_mask: bytes, logprobs: bytes, versions: bytes) -> None:
        """Appends to the four per-token arrays their packed wire encodings (`_varints`, float32
        bytes). Merging wire bytes appends to repeated fields, and upb parses them in C, where
        `extend` converts every element to a Python object and back (~100 µs per 4k-token array):
        a 4k-token turn from the engine's lists is built in ~0.2 ms instead of ~0.7 ms (about a
        third of the rollout's CPU in the mesh benchmark). The message is the one `extend` builds,
        field for field (tests/unit/trajmesh/test_contract.py). Below `_WIRE_FROM_TOKENS` tokens the
        builders still `extend`: this path's fixed cost (~25 µs) is more than a few elements cost."""
        self.pb.MergeFromString(b"".join([
            _TOKEN_IDS_KEY, varint(len(token_ids)), token_ids, _LOSS_MASK_KEY, varint(len(loss_mask)), loss_mask,
            _LOGPROBS_KEY, varint(len(logprobs)), logprobs, _VERSIONS_KEY, varint(len(versions)), versions,
        ]))

    def _new_span(
        self, action_type: trajectory_pb2.ActionType, turn_index: int | None, num_tokens: int
    ) -> trajectory_pb2.Span:
        """Add a span over the next `num_tokens` tokens, wired to its turn's root (see module doc)."""
        spans = self.pb.spans
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
        start = len(self.pb.token_ids)
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
        taken = {s.span_id for s in self.pb.spans}
        n = len(self.pb.spans)
        while f"{self.pb.trajectory_id}/{n}" in taken:
            n += 1
        return f"{self.pb.trajectory_id}/{n}"

    # ---------------------------------------------------------------- invariants

    def validate(
        self, *, vocab_size: int | None = None, learner_version: int | None = None
    ) -> list[Violation]:
        """Every broken invariant of docs/DESIGN.md §2, each once, by name; [] when the trajectory is sound.

        `vocab_size` enables the vocabulary check, `learner_version` the no-future-versions check.
        Per-token checks that relate two arrays look at their common prefix, so a length mismatch
        does not hide other problems.
        """
        return [
            *self._check_identity(),
            *self._check_tokens(vocab_size, learner_version),
            *self._check_terminal_reason(),
            *self._check_spans(),
            *self._check_reward(),
            *self._check_sequence_starts(),
        ]

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
        if len(self.pb.teacher_logprobs):
            lengths["teacher_logprobs"] = len(self.pb.teacher_logprobs)
        if len(set(lengths.values())) > 1:
            yield Violation("length_mismatch", ", ".join(f"{k}={v}" for k, v in lengths.items()))
        if (teacher_T := self.teacher_logprobs_T) is not None and teacher_T.size == mask_T.size:
            act_T = mask_T == 1
            if (bad_T := act_T & ~(np.isfinite(teacher_T) & (teacher_T <= 0))).any():
                yield Violation("teacher_logprob_invalid", _where(bad_T, "with a teacher log-prob not finite and <= 0"))
        infra = self.pb.terminal_reason == trajectory_pb2.INFRA_FAILURE
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
        num_tokens = len(self.pb.token_ids)
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
        n = len(self.pb.token_ids)
        problems = []
        if starts[0] != 0:
            problems.append(f"first start is {starts[0]}, not 0")
        if any(b <= a for a, b in zip(starts, starts[1:], strict=False)):
            problems.append(f"not strictly increasing: {starts[:8]}")
        if any(s >= n for s in starts):
            problems.append(f"a start at or past the {n} tokens: {starts[-1]}")
        mask = self.pb.loss_mask
        opens = [s for s in starts if s < min(n, len(mask)) and mask[s] != 0]
        if opens:
            problems.append(f"segment(s) starting on a mask-1 token at {opens[:3]} (no prompt)")
        if problems:
            yield Violation("sequence_starts_invalid", "; ".join(problems))

    def segment_bounds(self) -> list[tuple[int, int]]:
        """[start, end) of each sequence in the per-token arrays: one (0, T) unless
        ``sequence_starts`` splits the trajectory into an agent session's segments."""
        n = len(self.pb.token_ids)
        starts = [s for s in self.pb.sequence_starts if s < n] or [0]
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


def _field_key(name: str) -> bytes:
    """The wire key of a packed repeated field of Trajectory (wire type 2: length-delimited)."""
    return varint(trajectory_pb2.Trajectory.DESCRIPTOR.fields_by_name[name].number << 3 | 2)


_TOKEN_IDS_KEY = _field_key("token_ids")
_LOSS_MASK_KEY = _field_key("loss_mask")
_LOGPROBS_KEY = _field_key("behavior_logprobs")
_VERSIONS_KEY = _field_key("behavior_versions")
_TEACHER_LOGPROBS_KEY = _field_key("teacher_logprobs")
_UINT64_MASK = 0xFFFF_FFFF_FFFF_FFFF
"""An int64 on the wire is the varint of its 64-bit two's complement (10 bytes when negative)."""
_UNSAMPLED_VERSION_VARINT = varint(UNSAMPLED_VERSION & _UINT64_MASK)
_UINT32_MAX = int(np.iinfo(np.uint32).max)
_WIRE_FROM_TOKENS = 64
"""Appends of at least this many tokens go through wire bytes (`Trajectory._extend_per_token`)."""


def _varints(values_T: npt.NDArray[np.int64]) -> bytes:
    """The varints of int64 values (negative ones as their 64-bit two's complement, as protobuf
    encodes int64), vectorized: 7-bit groups column by column, low group first, the continuation
    bit on every group but a value's last, then the groups each value needs, in order."""
    v_T: npt.NDArray[np.unsignedinteger[Any]] = np.ascontiguousarray(values_T, dtype=np.int64).view(np.uint64)
    if v_T.size == 0:
        return b""
    top = int(v_T.max())
    if top < 0x80:  # one byte each (masks, small ids and versions)
        return v_T.astype(np.uint8).tobytes()
    if top <= 0xFFFF_FFFF:
        v_T = v_T.astype(np.uint32)  # narrower arithmetic for token ids
    width = (top.bit_length() + 6) // 7
    groups = np.empty((v_T.size, width), dtype=np.uint8)
    keep = np.empty((v_T.size, width), dtype=np.bool_)
    keep[:, 0] = True
    rest: npt.NDArray[Any] = v_T
    for j in range(width):  # 1-D operations per column: much faster than broadcasting over (T, width)
        nxt = rest >> 7
        more = nxt != 0
        groups[:, j] = rest & 0x7F
        groups[:, j] |= more.view(np.uint8) << 7
        if j + 1 < width:
            keep[:, j + 1] = more
        rest = nxt
    return groups[keep].tobytes()
