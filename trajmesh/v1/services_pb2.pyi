from trajmesh.v1 import trajectory_pb2 as _trajectory_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class NextBatchRequest(_message.Message):
    __slots__ = ("learner_version", "max_trajectories", "timeout_seconds", "learner_restarted", "max_groups", "peek", "batch_ready_elsewhere")
    LEARNER_VERSION_FIELD_NUMBER: _ClassVar[int]
    MAX_TRAJECTORIES_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_SECONDS_FIELD_NUMBER: _ClassVar[int]
    LEARNER_RESTARTED_FIELD_NUMBER: _ClassVar[int]
    MAX_GROUPS_FIELD_NUMBER: _ClassVar[int]
    PEEK_FIELD_NUMBER: _ClassVar[int]
    BATCH_READY_ELSEWHERE_FIELD_NUMBER: _ClassVar[int]
    learner_version: int
    max_trajectories: int
    timeout_seconds: float
    learner_restarted: bool
    max_groups: int
    peek: bool
    batch_ready_elsewhere: bool
    def __init__(self, learner_version: _Optional[int] = ..., max_trajectories: _Optional[int] = ..., timeout_seconds: _Optional[float] = ..., learner_restarted: _Optional[bool] = ..., max_groups: _Optional[int] = ..., peek: _Optional[bool] = ..., batch_ready_elsewhere: _Optional[bool] = ...) -> None: ...

class NextBatchResponse(_message.Message):
    __slots__ = ("trajectories", "batch_index", "exhausted", "held", "ready_versions")
    TRAJECTORIES_FIELD_NUMBER: _ClassVar[int]
    BATCH_INDEX_FIELD_NUMBER: _ClassVar[int]
    EXHAUSTED_FIELD_NUMBER: _ClassVar[int]
    HELD_FIELD_NUMBER: _ClassVar[int]
    READY_VERSIONS_FIELD_NUMBER: _ClassVar[int]
    trajectories: _containers.RepeatedCompositeFieldContainer[_trajectory_pb2.Trajectory]
    batch_index: int
    exhausted: bool
    held: bool
    ready_versions: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, trajectories: _Optional[_Iterable[_Union[_trajectory_pb2.Trajectory, _Mapping]]] = ..., batch_index: _Optional[int] = ..., exhausted: _Optional[bool] = ..., held: _Optional[bool] = ..., ready_versions: _Optional[_Iterable[int]] = ...) -> None: ...

class ReportRequest(_message.Message):
    __slots__ = ("learner_version", "trained_ids", "quarantined_ids", "quarantine_reasons", "batch_index")
    LEARNER_VERSION_FIELD_NUMBER: _ClassVar[int]
    TRAINED_IDS_FIELD_NUMBER: _ClassVar[int]
    QUARANTINED_IDS_FIELD_NUMBER: _ClassVar[int]
    QUARANTINE_REASONS_FIELD_NUMBER: _ClassVar[int]
    BATCH_INDEX_FIELD_NUMBER: _ClassVar[int]
    learner_version: int
    trained_ids: _containers.RepeatedScalarFieldContainer[str]
    quarantined_ids: _containers.RepeatedScalarFieldContainer[str]
    quarantine_reasons: _containers.RepeatedScalarFieldContainer[str]
    batch_index: int
    def __init__(self, learner_version: _Optional[int] = ..., trained_ids: _Optional[_Iterable[str]] = ..., quarantined_ids: _Optional[_Iterable[str]] = ..., quarantine_reasons: _Optional[_Iterable[str]] = ..., batch_index: _Optional[int] = ...) -> None: ...

class ReportResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ResetRequest(_message.Message):
    __slots__ = ("session_id", "task", "seed")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    TASK_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    task: _trajectory_pb2.Task
    seed: int
    def __init__(self, session_id: _Optional[str] = ..., task: _Optional[_Union[_trajectory_pb2.Task, _Mapping]] = ..., seed: _Optional[int] = ...) -> None: ...

class ResetResponse(_message.Message):
    __slots__ = ("observation", "state_hash", "environment_revision")
    OBSERVATION_FIELD_NUMBER: _ClassVar[int]
    STATE_HASH_FIELD_NUMBER: _ClassVar[int]
    ENVIRONMENT_REVISION_FIELD_NUMBER: _ClassVar[int]
    observation: str
    state_hash: str
    environment_revision: str
    def __init__(self, observation: _Optional[str] = ..., state_hash: _Optional[str] = ..., environment_revision: _Optional[str] = ...) -> None: ...

class StepRequest(_message.Message):
    __slots__ = ("session_id", "action")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    ACTION_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    action: str
    def __init__(self, session_id: _Optional[str] = ..., action: _Optional[str] = ...) -> None: ...

class StepResponse(_message.Message):
    __slots__ = ("observation", "done", "state_hash", "info_json", "reward")
    OBSERVATION_FIELD_NUMBER: _ClassVar[int]
    DONE_FIELD_NUMBER: _ClassVar[int]
    STATE_HASH_FIELD_NUMBER: _ClassVar[int]
    INFO_JSON_FIELD_NUMBER: _ClassVar[int]
    REWARD_FIELD_NUMBER: _ClassVar[int]
    observation: str
    done: bool
    state_hash: str
    info_json: str
    reward: float
    def __init__(self, observation: _Optional[str] = ..., done: _Optional[bool] = ..., state_hash: _Optional[str] = ..., info_json: _Optional[str] = ..., reward: _Optional[float] = ...) -> None: ...

class CloseRequest(_message.Message):
    __slots__ = ("session_id",)
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    def __init__(self, session_id: _Optional[str] = ...) -> None: ...

class CloseResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class RunAgentRequest(_message.Message):
    __slots__ = ("session_id", "task", "base_url", "api_key", "model", "budget_s")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    TASK_FIELD_NUMBER: _ClassVar[int]
    BASE_URL_FIELD_NUMBER: _ClassVar[int]
    API_KEY_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    BUDGET_S_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    task: _trajectory_pb2.Task
    base_url: str
    api_key: str
    model: str
    budget_s: float
    def __init__(self, session_id: _Optional[str] = ..., task: _Optional[_Union[_trajectory_pb2.Task, _Mapping]] = ..., base_url: _Optional[str] = ..., api_key: _Optional[str] = ..., model: _Optional[str] = ..., budget_s: _Optional[float] = ...) -> None: ...

class RunAgentResponse(_message.Message):
    __slots__ = ("terminal_reason", "answer", "detail", "environment_revision")
    TERMINAL_REASON_FIELD_NUMBER: _ClassVar[int]
    ANSWER_FIELD_NUMBER: _ClassVar[int]
    DETAIL_FIELD_NUMBER: _ClassVar[int]
    ENVIRONMENT_REVISION_FIELD_NUMBER: _ClassVar[int]
    terminal_reason: _trajectory_pb2.TerminalReason
    answer: str
    detail: str
    environment_revision: str
    def __init__(self, terminal_reason: _Optional[_Union[_trajectory_pb2.TerminalReason, str]] = ..., answer: _Optional[str] = ..., detail: _Optional[str] = ..., environment_revision: _Optional[str] = ...) -> None: ...
