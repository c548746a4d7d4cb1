from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class TerminalReason(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    TERMINAL_REASON_UNSPECIFIED: _ClassVar[TerminalReason]
    EOS: _ClassVar[TerminalReason]
    ENV_DONE: _ClassVar[TerminalReason]
    MAX_TOKENS: _ClassVar[TerminalReason]
    MAX_TURNS: _ClassVar[TerminalReason]
    WALL_TIMEOUT: _ClassVar[TerminalReason]
    SANDBOX_ERROR: _ClassVar[TerminalReason]
    INFRA_FAILURE: _ClassVar[TerminalReason]
    SAFETY: _ClassVar[TerminalReason]
    STALE: _ClassVar[TerminalReason]

class InfraCause(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    INFRA_CAUSE_UNSPECIFIED: _ClassVar[InfraCause]
    INFRA_ENGINE: _ClassVar[InfraCause]
    INFRA_ENVIRONMENT: _ClassVar[InfraCause]
    INFRA_GRADER: _ClassVar[InfraCause]
    INFRA_AGENT: _ClassVar[InfraCause]
    INFRA_TEACHER: _ClassVar[InfraCause]
    INFRA_DEADLINE: _ClassVar[InfraCause]

class ActionType(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    ACTION_TYPE_UNSPECIFIED: _ClassVar[ActionType]
    PROMPT: _ClassVar[ActionType]
    TEXT: _ClassVar[ActionType]
    TOOL_CALL: _ClassVar[ActionType]
    CODE: _ClassVar[ActionType]
    OBSERVATION: _ClassVar[ActionType]

class ToolCallStatus(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    TOOL_CALL_STATUS_UNSPECIFIED: _ClassVar[ToolCallStatus]
    TOOL_OK: _ClassVar[ToolCallStatus]
    TOOL_ERROR: _ClassVar[ToolCallStatus]
    TOOL_TIMEOUT: _ClassVar[ToolCallStatus]
    TOOL_SANDBOX_VIOLATION: _ClassVar[ToolCallStatus]
    TOOL_INVALID: _ClassVar[ToolCallStatus]
TERMINAL_REASON_UNSPECIFIED: TerminalReason
EOS: TerminalReason
ENV_DONE: TerminalReason
MAX_TOKENS: TerminalReason
MAX_TURNS: TerminalReason
WALL_TIMEOUT: TerminalReason
SANDBOX_ERROR: TerminalReason
INFRA_FAILURE: TerminalReason
SAFETY: TerminalReason
STALE: TerminalReason
INFRA_CAUSE_UNSPECIFIED: InfraCause
INFRA_ENGINE: InfraCause
INFRA_ENVIRONMENT: InfraCause
INFRA_GRADER: InfraCause
INFRA_AGENT: InfraCause
INFRA_TEACHER: InfraCause
INFRA_DEADLINE: InfraCause
ACTION_TYPE_UNSPECIFIED: ActionType
PROMPT: ActionType
TEXT: ActionType
TOOL_CALL: ActionType
CODE: ActionType
OBSERVATION: ActionType
TOOL_CALL_STATUS_UNSPECIFIED: ToolCallStatus
TOOL_OK: ToolCallStatus
TOOL_ERROR: ToolCallStatus
TOOL_TIMEOUT: ToolCallStatus
TOOL_SANDBOX_VIOLATION: ToolCallStatus
TOOL_INVALID: ToolCallStatus

class Span(_message.Message):
    __slots__ = ("span_id", "parent_span_id", "turn_index", "action_type", "token_start", "token_end")
    SPAN_ID_FIELD_NUMBER: _ClassVar[int]
    PARENT_SPAN_ID_FIELD_NUMBER: _ClassVar[int]
    TURN_INDEX_FIELD_NUMBER: _ClassVar[int]
    ACTION_TYPE_FIELD_NUMBER: _ClassVar[int]
    TOKEN_START_FIELD_NUMBER: _ClassVar[int]
    TOKEN_END_FIELD_NUMBER: _ClassVar[int]
    span_id: str
    parent_span_id: str
    turn_index: int
    action_type: ActionType
    token_start: int
    token_end: int
    def __init__(self, span_id: _Optional[str] = ..., parent_span_id: _Optional[str] = ..., turn_index: _Optional[int] = ..., action_type: _Optional[_Union[ActionType, str]] = ..., token_start: _Optional[int] = ..., token_end: _Optional[int] = ...) -> None: ...

class ToolCall(_message.Message):
    __slots__ = ("span_id", "tool_name", "request", "response_sha256", "latency_seconds", "status")
    SPAN_ID_FIELD_NUMBER: _ClassVar[int]
    TOOL_NAME_FIELD_NUMBER: _ClassVar[int]
    REQUEST_FIELD_NUMBER: _ClassVar[int]
    RESPONSE_SHA256_FIELD_NUMBER: _ClassVar[int]
    LATENCY_SECONDS_FIELD_NUMBER: _ClassVar[int]
    STATUS_FIELD_NUMBER: _ClassVar[int]
    span_id: str
    tool_name: str
    request: str
    response_sha256: str
    latency_seconds: float
    status: ToolCallStatus
    def __init__(self, span_id: _Optional[str] = ..., tool_name: _Optional[str] = ..., request: _Optional[str] = ..., response_sha256: _Optional[str] = ..., latency_seconds: _Optional[float] = ..., status: _Optional[_Union[ToolCallStatus, str]] = ...) -> None: ...

class Timing(_message.Message):
    __slots__ = ("created_unix_seconds", "rollout_seconds", "environment_seconds", "grading_seconds", "queued_seconds", "deadline_unix_seconds")
    CREATED_UNIX_SECONDS_FIELD_NUMBER: _ClassVar[int]
    ROLLOUT_SECONDS_FIELD_NUMBER: _ClassVar[int]
    ENVIRONMENT_SECONDS_FIELD_NUMBER: _ClassVar[int]
    GRADING_SECONDS_FIELD_NUMBER: _ClassVar[int]
    QUEUED_SECONDS_FIELD_NUMBER: _ClassVar[int]
    DEADLINE_UNIX_SECONDS_FIELD_NUMBER: _ClassVar[int]
    created_unix_seconds: float
    rollout_seconds: float
    environment_seconds: float
    grading_seconds: float
    queued_seconds: float
    deadline_unix_seconds: float
    def __init__(self, created_unix_seconds: _Optional[float] = ..., rollout_seconds: _Optional[float] = ..., environment_seconds: _Optional[float] = ..., grading_seconds: _Optional[float] = ..., queued_seconds: _Optional[float] = ..., deadline_unix_seconds: _Optional[float] = ...) -> None: ...

class Trajectory(_message.Message):
    __slots__ = ("trajectory_id", "task_id", "group_id", "task_source", "task_revision", "environment_revision", "reset_seed", "initial_state_hash", "spans", "token_ids", "loss_mask", "behavior_logprobs", "behavior_versions", "tool_calls", "raw_reward_components", "verifier_output", "grader_revision", "reward", "graded", "terminal_reason", "truncated", "timing", "retry_lineage", "manifest_id", "prompt_length", "rollout_worker", "state_hashes", "final_answer", "sequence_starts", "step_rewards", "teacher_logprobs", "teacher", "infra_cause", "token_block")
    class RawRewardComponentsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    TRAJECTORY_ID_FIELD_NUMBER: _ClassVar[int]
    TASK_ID_FIELD_NUMBER: _ClassVar[int]
    GROUP_ID_FIELD_NUMBER: _ClassVar[int]
    TASK_SOURCE_FIELD_NUMBER: _ClassVar[int]
    TASK_REVISION_FIELD_NUMBER: _ClassVar[int]
    ENVIRONMENT_REVISION_FIELD_NUMBER: _ClassVar[int]
    RESET_SEED_FIELD_NUMBER: _ClassVar[int]
    INITIAL_STATE_HASH_FIELD_NUMBER: _ClassVar[int]
    SPANS_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    LOSS_MASK_FIELD_NUMBER: _ClassVar[int]
    BEHAVIOR_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    BEHAVIOR_VERSIONS_FIELD_NUMBER: _ClassVar[int]
    TOOL_CALLS_FIELD_NUMBER: _ClassVar[int]
    RAW_REWARD_COMPONENTS_FIELD_NUMBER: _ClassVar[int]
    VERIFIER_OUTPUT_FIELD_NUMBER: _ClassVar[int]
    GRADER_REVISION_FIELD_NUMBER: _ClassVar[int]
    REWARD_FIELD_NUMBER: _ClassVar[int]
    GRADED_FIELD_NUMBER: _ClassVar[int]
    TERMINAL_REASON_FIELD_NUMBER: _ClassVar[int]
    TRUNCATED_FIELD_NUMBER: _ClassVar[int]
    TIMING_FIELD_NUMBER: _ClassVar[int]
    RETRY_LINEAGE_FIELD_NUMBER: _ClassVar[int]
    MANIFEST_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LENGTH_FIELD_NUMBER: _ClassVar[int]
    ROLLOUT_WORKER_FIELD_NUMBER: _ClassVar[int]
    STATE_HASHES_FIELD_NUMBER: _ClassVar[int]
    FINAL_ANSWER_FIELD_NUMBER: _ClassVar[int]
    SEQUENCE_STARTS_FIELD_NUMBER: _ClassVar[int]
    STEP_REWARDS_FIELD_NUMBER: _ClassVar[int]
    TEACHER_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    TEACHER_FIELD_NUMBER: _ClassVar[int]
    INFRA_CAUSE_FIELD_NUMBER: _ClassVar[int]
    TOKEN_BLOCK_FIELD_NUMBER: _ClassVar[int]
    trajectory_id: str
    task_id: str
    group_id: str
    task_source: str
    task_revision: str
    environment_revision: str
    reset_seed: int
    initial_state_hash: str
    spans: _containers.RepeatedCompositeFieldContainer[Span]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    loss_mask: _containers.RepeatedScalarFieldContainer[int]
    behavior_logprobs: _containers.RepeatedScalarFieldContainer[float]
    behavior_versions: _containers.RepeatedScalarFieldContainer[int]
    tool_calls: _containers.RepeatedCompositeFieldContainer[ToolCall]
    raw_reward_components: _containers.ScalarMap[str, float]
    verifier_output: str
    grader_revision: str
    reward: float
    graded: bool
    terminal_reason: TerminalReason
    truncated: bool
    timing: Timing
    retry_lineage: _containers.RepeatedScalarFieldContainer[str]
    manifest_id: str
    prompt_length: int
    rollout_worker: str
    state_hashes: _containers.RepeatedScalarFieldContainer[str]
    final_answer: str
    sequence_starts: _containers.RepeatedScalarFieldContainer[int]
    step_rewards: _containers.RepeatedScalarFieldContainer[float]
    teacher_logprobs: _containers.RepeatedScalarFieldContainer[float]
    teacher: str
    infra_cause: InfraCause
    token_block: bytes
    def __init__(self, trajectory_id: _Optional[str] = ..., task_id: _Optional[str] = ..., group_id: _Optional[str] = ..., task_source: _Optional[str] = ..., task_revision: _Optional[str] = ..., environment_revision: _Optional[str] = ..., reset_seed: _Optional[int] = ..., initial_state_hash: _Optional[str] = ..., spans: _Optional[_Iterable[_Union[Span, _Mapping]]] = ..., token_ids: _Optional[_Iterable[int]] = ..., loss_mask: _Optional[_Iterable[int]] = ..., behavior_logprobs: _Optional[_Iterable[float]] = ..., behavior_versions: _Optional[_Iterable[int]] = ..., tool_calls: _Optional[_Iterable[_Union[ToolCall, _Mapping]]] = ..., raw_reward_components: _Optional[_Mapping[str, float]] = ..., verifier_output: _Optional[str] = ..., grader_revision: _Optional[str] = ..., reward: _Optional[float] = ..., graded: _Optional[bool] = ..., terminal_reason: _Optional[_Union[TerminalReason, str]] = ..., truncated: _Optional[bool] = ..., timing: _Optional[_Union[Timing, _Mapping]] = ..., retry_lineage: _Optional[_Iterable[str]] = ..., manifest_id: _Optional[str] = ..., prompt_length: _Optional[int] = ..., rollout_worker: _Optional[str] = ..., state_hashes: _Optional[_Iterable[str]] = ..., final_answer: _Optional[str] = ..., sequence_starts: _Optional[_Iterable[int]] = ..., step_rewards: _Optional[_Iterable[float]] = ..., teacher_logprobs: _Optional[_Iterable[float]] = ..., teacher: _Optional[str] = ..., infra_cause: _Optional[_Union[InfraCause, str]] = ..., token_block: _Optional[bytes] = ...) -> None: ...

class SamplingParams(_message.Message):
    __slots__ = ("temperature", "top_p", "top_k", "max_new_tokens", "stop_token_ids", "max_turns")
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    MAX_NEW_TOKENS_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    MAX_TURNS_FIELD_NUMBER: _ClassVar[int]
    temperature: float
    top_p: float
    top_k: int
    max_new_tokens: int
    stop_token_ids: _containers.RepeatedScalarFieldContainer[int]
    max_turns: int
    def __init__(self, temperature: _Optional[float] = ..., top_p: _Optional[float] = ..., top_k: _Optional[int] = ..., max_new_tokens: _Optional[int] = ..., stop_token_ids: _Optional[_Iterable[int]] = ..., max_turns: _Optional[int] = ...) -> None: ...

class Task(_message.Message):
    __slots__ = ("task_id", "group_id", "source", "revision", "seed", "group_size", "sampling", "environment", "prompt", "answer", "metadata_json", "admitted_at_version", "manifest_id", "prompt_token_ids", "evaluation", "first_sample", "refill_of")
    TASK_ID_FIELD_NUMBER: _ClassVar[int]
    GROUP_ID_FIELD_NUMBER: _ClassVar[int]
    SOURCE_FIELD_NUMBER: _ClassVar[int]
    REVISION_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    GROUP_SIZE_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    ENVIRONMENT_FIELD_NUMBER: _ClassVar[int]
    PROMPT_FIELD_NUMBER: _ClassVar[int]
    ANSWER_FIELD_NUMBER: _ClassVar[int]
    METADATA_JSON_FIELD_NUMBER: _ClassVar[int]
    ADMITTED_AT_VERSION_FIELD_NUMBER: _ClassVar[int]
    MANIFEST_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    EVALUATION_FIELD_NUMBER: _ClassVar[int]
    FIRST_SAMPLE_FIELD_NUMBER: _ClassVar[int]
    REFILL_OF_FIELD_NUMBER: _ClassVar[int]
    task_id: str
    group_id: str
    source: str
    revision: str
    seed: int
    group_size: int
    sampling: SamplingParams
    environment: str
    prompt: str
    answer: str
    metadata_json: str
    admitted_at_version: int
    manifest_id: str
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    evaluation: bool
    first_sample: int
    refill_of: str
    def __init__(self, task_id: _Optional[str] = ..., group_id: _Optional[str] = ..., source: _Optional[str] = ..., revision: _Optional[str] = ..., seed: _Optional[int] = ..., group_size: _Optional[int] = ..., sampling: _Optional[_Union[SamplingParams, _Mapping]] = ..., environment: _Optional[str] = ..., prompt: _Optional[str] = ..., answer: _Optional[str] = ..., metadata_json: _Optional[str] = ..., admitted_at_version: _Optional[int] = ..., manifest_id: _Optional[str] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., evaluation: _Optional[bool] = ..., first_sample: _Optional[int] = ..., refill_of: _Optional[str] = ...) -> None: ...

class GradeRequest(_message.Message):
    __slots__ = ("task", "trajectory")
    TASK_FIELD_NUMBER: _ClassVar[int]
    TRAJECTORY_FIELD_NUMBER: _ClassVar[int]
    task: Task
    trajectory: bytes
    def __init__(self, task: _Optional[_Union[Task, _Mapping]] = ..., trajectory: _Optional[bytes] = ...) -> None: ...

class RunManifest(_message.Message):
    __slots__ = ("manifest_id", "code_commit", "config_sha256", "model_revision", "tokenizer_revision", "chat_template_sha256", "environment_revisions", "grader_revisions", "algorithm_json", "created_unix_seconds", "framework_versions", "dirty_tree", "truncation_policy_json", "evaluation_protocol_json")
    class EnvironmentRevisionsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    class GraderRevisionsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    class FrameworkVersionsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    MANIFEST_ID_FIELD_NUMBER: _ClassVar[int]
    CODE_COMMIT_FIELD_NUMBER: _ClassVar[int]
    CONFIG_SHA256_FIELD_NUMBER: _ClassVar[int]
    MODEL_REVISION_FIELD_NUMBER: _ClassVar[int]
    TOKENIZER_REVISION_FIELD_NUMBER: _ClassVar[int]
    CHAT_TEMPLATE_SHA256_FIELD_NUMBER: _ClassVar[int]
    ENVIRONMENT_REVISIONS_FIELD_NUMBER: _ClassVar[int]
    GRADER_REVISIONS_FIELD_NUMBER: _ClassVar[int]
    ALGORITHM_JSON_FIELD_NUMBER: _ClassVar[int]
    CREATED_UNIX_SECONDS_FIELD_NUMBER: _ClassVar[int]
    FRAMEWORK_VERSIONS_FIELD_NUMBER: _ClassVar[int]
    DIRTY_TREE_FIELD_NUMBER: _ClassVar[int]
    TRUNCATION_POLICY_JSON_FIELD_NUMBER: _ClassVar[int]
    EVALUATION_PROTOCOL_JSON_FIELD_NUMBER: _ClassVar[int]
    manifest_id: str
    code_commit: str
    config_sha256: str
    model_revision: str
    tokenizer_revision: str
    chat_template_sha256: str
    environment_revisions: _containers.ScalarMap[str, str]
    grader_revisions: _containers.ScalarMap[str, str]
    algorithm_json: str
    created_unix_seconds: float
    framework_versions: _containers.ScalarMap[str, str]
    dirty_tree: bool
    truncation_policy_json: str
    evaluation_protocol_json: str
    def __init__(self, manifest_id: _Optional[str] = ..., code_commit: _Optional[str] = ..., config_sha256: _Optional[str] = ..., model_revision: _Optional[str] = ..., tokenizer_revision: _Optional[str] = ..., chat_template_sha256: _Optional[str] = ..., environment_revisions: _Optional[_Mapping[str, str]] = ..., grader_revisions: _Optional[_Mapping[str, str]] = ..., algorithm_json: _Optional[str] = ..., created_unix_seconds: _Optional[float] = ..., framework_versions: _Optional[_Mapping[str, str]] = ..., dirty_tree: _Optional[bool] = ..., truncation_policy_json: _Optional[str] = ..., evaluation_protocol_json: _Optional[str] = ...) -> None: ...

class WeightsAnnouncement(_message.Message):
    __slots__ = ("version", "path", "sha256", "published_unix_seconds")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    PATH_FIELD_NUMBER: _ClassVar[int]
    SHA256_FIELD_NUMBER: _ClassVar[int]
    PUBLISHED_UNIX_SECONDS_FIELD_NUMBER: _ClassVar[int]
    version: int
    path: str
    sha256: str
    published_unix_seconds: float
    def __init__(self, version: _Optional[int] = ..., path: _Optional[str] = ..., sha256: _Optional[str] = ..., published_unix_seconds: _Optional[float] = ...) -> None: ...
