from specd.proto.speculative.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class GetDrafterInfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class GetDrafterInfoResponse(_message.Message):
    __slots__ = ("model", "kind", "open_sequences", "kv_cache_bytes", "feature_size", "delivers")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    OPEN_SEQUENCES_FIELD_NUMBER: _ClassVar[int]
    KV_CACHE_BYTES_FIELD_NUMBER: _ClassVar[int]
    FEATURE_SIZE_FIELD_NUMBER: _ClassVar[int]
    DELIVERS_FIELD_NUMBER: _ClassVar[int]
    model: _common_pb2.ModelInfo
    kind: _common_pb2.DrafterKind
    open_sequences: int
    kv_cache_bytes: int
    feature_size: int
    delivers: bool
    def __init__(self, model: _Optional[_Union[_common_pb2.ModelInfo, _Mapping]] = ..., kind: _Optional[_Union[_common_pb2.DrafterKind, str]] = ..., open_sequences: _Optional[int] = ..., kv_cache_bytes: _Optional[int] = ..., feature_size: _Optional[int] = ..., delivers: _Optional[bool] = ...) -> None: ...

class OpenDraftSequencesRequest(_message.Message):
    __slots__ = ("sequences", "lease_owner")
    SEQUENCES_FIELD_NUMBER: _ClassVar[int]
    LEASE_OWNER_FIELD_NUMBER: _ClassVar[int]
    sequences: _containers.RepeatedCompositeFieldContainer[_common_pb2.SequenceSpec]
    lease_owner: str
    def __init__(self, sequences: _Optional[_Iterable[_Union[_common_pb2.SequenceSpec, _Mapping]]] = ..., lease_owner: _Optional[str] = ...) -> None: ...

class OpenDraftSequencesResponse(_message.Message):
    __slots__ = ("results",)
    RESULTS_FIELD_NUMBER: _ClassVar[int]
    results: _containers.RepeatedCompositeFieldContainer[_common_pb2.OpenResult]
    def __init__(self, results: _Optional[_Iterable[_Union[_common_pb2.OpenResult, _Mapping]]] = ...) -> None: ...

class CloseDraftSequencesRequest(_message.Message):
    __slots__ = ("sequence_ids", "lease_owner", "missing_ok", "tails")
    SEQUENCE_IDS_FIELD_NUMBER: _ClassVar[int]
    LEASE_OWNER_FIELD_NUMBER: _ClassVar[int]
    MISSING_OK_FIELD_NUMBER: _ClassVar[int]
    TAILS_FIELD_NUMBER: _ClassVar[int]
    sequence_ids: _containers.RepeatedScalarFieldContainer[str]
    lease_owner: str
    missing_ok: bool
    tails: _containers.RepeatedCompositeFieldContainer[DraftTail]
    def __init__(self, sequence_ids: _Optional[_Iterable[str]] = ..., lease_owner: _Optional[str] = ..., missing_ok: _Optional[bool] = ..., tails: _Optional[_Iterable[_Union[DraftTail, _Mapping]]] = ...) -> None: ...

class DraftTail(_message.Message):
    __slots__ = ("sequence_id", "new_token_ids", "num_committed")
    SEQUENCE_ID_FIELD_NUMBER: _ClassVar[int]
    NEW_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    NUM_COMMITTED_FIELD_NUMBER: _ClassVar[int]
    sequence_id: str
    new_token_ids: _containers.RepeatedScalarFieldContainer[int]
    num_committed: int
    def __init__(self, sequence_id: _Optional[str] = ..., new_token_ids: _Optional[_Iterable[int]] = ..., num_committed: _Optional[int] = ...) -> None: ...

class CloseDraftSequencesResponse(_message.Message):
    __slots__ = ("closed",)
    CLOSED_FIELD_NUMBER: _ClassVar[int]
    closed: int
    def __init__(self, closed: _Optional[int] = ...) -> None: ...

class DraftTask(_message.Message):
    __slots__ = ("sequence_id", "new_token_ids", "num_committed", "num_draft_tokens", "trace_context", "assumed_token_ids", "prefill_tokens", "hidden_states", "hidden_start", "guess_first", "num_siblings", "num_branches")
    class TraceContextEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    SEQUENCE_ID_FIELD_NUMBER: _ClassVar[int]
    NEW_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    NUM_COMMITTED_FIELD_NUMBER: _ClassVar[int]
    NUM_DRAFT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TRACE_CONTEXT_FIELD_NUMBER: _ClassVar[int]
    ASSUMED_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    PREFILL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    HIDDEN_STATES_FIELD_NUMBER: _ClassVar[int]
    HIDDEN_START_FIELD_NUMBER: _ClassVar[int]
    GUESS_FIRST_FIELD_NUMBER: _ClassVar[int]
    NUM_SIBLINGS_FIELD_NUMBER: _ClassVar[int]
    NUM_BRANCHES_FIELD_NUMBER: _ClassVar[int]
    sequence_id: str
    new_token_ids: _containers.RepeatedScalarFieldContainer[int]
    num_committed: int
    num_draft_tokens: int
    trace_context: _containers.ScalarMap[str, str]
    assumed_token_ids: _containers.RepeatedScalarFieldContainer[int]
    prefill_tokens: int
    hidden_states: bytes
    hidden_start: int
    guess_first: bool
    num_siblings: int
    num_branches: int
    def __init__(self, sequence_id: _Optional[str] = ..., new_token_ids: _Optional[_Iterable[int]] = ..., num_committed: _Optional[int] = ..., num_draft_tokens: _Optional[int] = ..., trace_context: _Optional[_Mapping[str, str]] = ..., assumed_token_ids: _Optional[_Iterable[int]] = ..., prefill_tokens: _Optional[int] = ..., hidden_states: _Optional[bytes] = ..., hidden_start: _Optional[int] = ..., guess_first: _Optional[bool] = ..., num_siblings: _Optional[int] = ..., num_branches: _Optional[int] = ...) -> None: ...

class DraftRequest(_message.Message):
    __slots__ = ("round_id", "tasks", "lease_owner", "deliver_to_verifier")
    ROUND_ID_FIELD_NUMBER: _ClassVar[int]
    TASKS_FIELD_NUMBER: _ClassVar[int]
    LEASE_OWNER_FIELD_NUMBER: _ClassVar[int]
    DELIVER_TO_VERIFIER_FIELD_NUMBER: _ClassVar[int]
    round_id: int
    tasks: _containers.RepeatedCompositeFieldContainer[DraftTask]
    lease_owner: str
    deliver_to_verifier: bool
    def __init__(self, round_id: _Optional[int] = ..., tasks: _Optional[_Iterable[_Union[DraftTask, _Mapping]]] = ..., lease_owner: _Optional[str] = ..., deliver_to_verifier: _Optional[bool] = ...) -> None: ...

class DraftProposal(_message.Message):
    __slots__ = ("sequence_id", "token_ids", "distributions", "error", "prefill_pending", "parents", "branches")
    SEQUENCE_ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    DISTRIBUTIONS_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    PREFILL_PENDING_FIELD_NUMBER: _ClassVar[int]
    PARENTS_FIELD_NUMBER: _ClassVar[int]
    BRANCHES_FIELD_NUMBER: _ClassVar[int]
    sequence_id: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    distributions: _containers.RepeatedCompositeFieldContainer[_common_pb2.SparseDistribution]
    error: _common_pb2.SequenceError
    prefill_pending: int
    parents: _containers.RepeatedScalarFieldContainer[int]
    branches: _containers.RepeatedCompositeFieldContainer[DraftBranch]
    def __init__(self, sequence_id: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ..., distributions: _Optional[_Iterable[_Union[_common_pb2.SparseDistribution, _Mapping]]] = ..., error: _Optional[_Union[_common_pb2.SequenceError, _Mapping]] = ..., prefill_pending: _Optional[int] = ..., parents: _Optional[_Iterable[int]] = ..., branches: _Optional[_Iterable[_Union[DraftBranch, _Mapping]]] = ...) -> None: ...

class DraftBranch(_message.Message):
    __slots__ = ("num_assumed", "token_ids", "distributions")
    NUM_ASSUMED_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    DISTRIBUTIONS_FIELD_NUMBER: _ClassVar[int]
    num_assumed: int
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    distributions: _containers.RepeatedCompositeFieldContainer[_common_pb2.SparseDistribution]
    def __init__(self, num_assumed: _Optional[int] = ..., token_ids: _Optional[_Iterable[int]] = ..., distributions: _Optional[_Iterable[_Union[_common_pb2.SparseDistribution, _Mapping]]] = ...) -> None: ...

class DraftResponse(_message.Message):
    __slots__ = ("round_id", "proposals", "timings")
    ROUND_ID_FIELD_NUMBER: _ClassVar[int]
    PROPOSALS_FIELD_NUMBER: _ClassVar[int]
    TIMINGS_FIELD_NUMBER: _ClassVar[int]
    round_id: int
    proposals: _containers.RepeatedCompositeFieldContainer[DraftProposal]
    timings: _common_pb2.ServiceTimings
    def __init__(self, round_id: _Optional[int] = ..., proposals: _Optional[_Iterable[_Union[DraftProposal, _Mapping]]] = ..., timings: _Optional[_Union[_common_pb2.ServiceTimings, _Mapping]] = ...) -> None: ...
