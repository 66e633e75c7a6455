from specd.proto.speculative.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class GetVerifierInfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class GetVerifierInfoResponse(_message.Message):
    __slots__ = ("model", "open_sequences", "kv_cache_bytes")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    OPEN_SEQUENCES_FIELD_NUMBER: _ClassVar[int]
    KV_CACHE_BYTES_FIELD_NUMBER: _ClassVar[int]
    model: _common_pb2.ModelInfo
    open_sequences: int
    kv_cache_bytes: int
    def __init__(self, model: _Optional[_Union[_common_pb2.ModelInfo, _Mapping]] = ..., open_sequences: _Optional[int] = ..., kv_cache_bytes: _Optional[int] = ...) -> None: ...

class OpenVerifySequencesRequest(_message.Message):
    __slots__ = ("sequences", "lease_owner")
    SEQUENCES_FIELD_NUMBER: _ClassVar[int]
    LEASE_OWNER_FIELD_NUMBER: _ClassVar[int]
    sequences: _containers.RepeatedCompositeFieldContainer[_common_pb2.SequenceSpec]
    lease_owner: str
    def __init__(self, sequences: _Optional[_Iterable[_Union[_common_pb2.SequenceSpec, _Mapping]]] = ..., lease_owner: _Optional[str] = ...) -> None: ...

class OpenVerifySequencesResponse(_message.Message):
    __slots__ = ("results",)
    RESULTS_FIELD_NUMBER: _ClassVar[int]
    results: _containers.RepeatedCompositeFieldContainer[_common_pb2.OpenResult]
    def __init__(self, results: _Optional[_Iterable[_Union[_common_pb2.OpenResult, _Mapping]]] = ...) -> None: ...

class CloseVerifySequencesRequest(_message.Message):
    __slots__ = ("sequence_ids", "lease_owner", "missing_ok")
    SEQUENCE_IDS_FIELD_NUMBER: _ClassVar[int]
    LEASE_OWNER_FIELD_NUMBER: _ClassVar[int]
    MISSING_OK_FIELD_NUMBER: _ClassVar[int]
    sequence_ids: _containers.RepeatedScalarFieldContainer[str]
    lease_owner: str
    missing_ok: bool
    def __init__(self, sequence_ids: _Optional[_Iterable[str]] = ..., lease_owner: _Optional[str] = ..., missing_ok: _Optional[bool] = ...) -> None: ...

class CloseVerifySequencesResponse(_message.Message):
    __slots__ = ("closed",)
    CLOSED_FIELD_NUMBER: _ClassVar[int]
    closed: int
    def __init__(self, closed: _Optional[int] = ...) -> None: ...

class VerifyTask(_message.Message):
    __slots__ = ("sequence_id", "num_committed", "draft_token_ids", "draft_distributions", "trace_context", "prefill_tokens", "return_hidden_states", "draft_parents", "direct_drafts")
    class TraceContextEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    SEQUENCE_ID_FIELD_NUMBER: _ClassVar[int]
    NUM_COMMITTED_FIELD_NUMBER: _ClassVar[int]
    DRAFT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    DRAFT_DISTRIBUTIONS_FIELD_NUMBER: _ClassVar[int]
    TRACE_CONTEXT_FIELD_NUMBER: _ClassVar[int]
    PREFILL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    RETURN_HIDDEN_STATES_FIELD_NUMBER: _ClassVar[int]
    DRAFT_PARENTS_FIELD_NUMBER: _ClassVar[int]
    DIRECT_DRAFTS_FIELD_NUMBER: _ClassVar[int]
    sequence_id: str
    num_committed: int
    draft_token_ids: _containers.RepeatedScalarFieldContainer[int]
    draft_distributions: _containers.RepeatedCompositeFieldContainer[_common_pb2.SparseDistribution]
    trace_context: _containers.ScalarMap[str, str]
    prefill_tokens: int
    return_hidden_states: bool
    draft_parents: _containers.RepeatedScalarFieldContainer[int]
    direct_drafts: int
    def __init__(self, sequence_id: _Optional[str] = ..., num_committed: _Optional[int] = ..., draft_token_ids: _Optional[_Iterable[int]] = ..., draft_distributions: _Optional[_Iterable[_Union[_common_pb2.SparseDistribution, _Mapping]]] = ..., trace_context: _Optional[_Mapping[str, str]] = ..., prefill_tokens: _Optional[int] = ..., return_hidden_states: _Optional[bool] = ..., draft_parents: _Optional[_Iterable[int]] = ..., direct_drafts: _Optional[int] = ...) -> None: ...

class VerifyRequest(_message.Message):
    __slots__ = ("round_id", "tasks", "lease_owner", "drafts_wait_ms")
    ROUND_ID_FIELD_NUMBER: _ClassVar[int]
    TASKS_FIELD_NUMBER: _ClassVar[int]
    LEASE_OWNER_FIELD_NUMBER: _ClassVar[int]
    DRAFTS_WAIT_MS_FIELD_NUMBER: _ClassVar[int]
    round_id: int
    tasks: _containers.RepeatedCompositeFieldContainer[VerifyTask]
    lease_owner: str
    drafts_wait_ms: int
    def __init__(self, round_id: _Optional[int] = ..., tasks: _Optional[_Iterable[_Union[VerifyTask, _Mapping]]] = ..., lease_owner: _Optional[str] = ..., drafts_wait_ms: _Optional[int] = ...) -> None: ...

class VerifyResult(_message.Message):
    __slots__ = ("sequence_id", "num_accepted", "next_token_id", "error", "logprobs", "prefill_pending", "hidden_states", "hidden_start", "accepted_path", "direct_draft_token_ids")
    SEQUENCE_ID_FIELD_NUMBER: _ClassVar[int]
    NUM_ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    NEXT_TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    PREFILL_PENDING_FIELD_NUMBER: _ClassVar[int]
    HIDDEN_STATES_FIELD_NUMBER: _ClassVar[int]
    HIDDEN_START_FIELD_NUMBER: _ClassVar[int]
    ACCEPTED_PATH_FIELD_NUMBER: _ClassVar[int]
    DIRECT_DRAFT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    sequence_id: str
    num_accepted: int
    next_token_id: int
    error: _common_pb2.SequenceError
    logprobs: _containers.RepeatedCompositeFieldContainer[_common_pb2.TokenLogprob]
    prefill_pending: int
    hidden_states: bytes
    hidden_start: int
    accepted_path: _containers.RepeatedScalarFieldContainer[int]
    direct_draft_token_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, sequence_id: _Optional[str] = ..., num_accepted: _Optional[int] = ..., next_token_id: _Optional[int] = ..., error: _Optional[_Union[_common_pb2.SequenceError, _Mapping]] = ..., logprobs: _Optional[_Iterable[_Union[_common_pb2.TokenLogprob, _Mapping]]] = ..., prefill_pending: _Optional[int] = ..., hidden_states: _Optional[bytes] = ..., hidden_start: _Optional[int] = ..., accepted_path: _Optional[_Iterable[int]] = ..., direct_draft_token_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class VerifyResponse(_message.Message):
    __slots__ = ("round_id", "results", "timings", "drafts_missing", "drafts_wait_ns")
    ROUND_ID_FIELD_NUMBER: _ClassVar[int]
    RESULTS_FIELD_NUMBER: _ClassVar[int]
    TIMINGS_FIELD_NUMBER: _ClassVar[int]
    DRAFTS_MISSING_FIELD_NUMBER: _ClassVar[int]
    DRAFTS_WAIT_NS_FIELD_NUMBER: _ClassVar[int]
    round_id: int
    results: _containers.RepeatedCompositeFieldContainer[VerifyResult]
    timings: _common_pb2.ServiceTimings
    drafts_missing: bool
    drafts_wait_ns: int
    def __init__(self, round_id: _Optional[int] = ..., results: _Optional[_Iterable[_Union[VerifyResult, _Mapping]]] = ..., timings: _Optional[_Union[_common_pb2.ServiceTimings, _Mapping]] = ..., drafts_missing: _Optional[bool] = ..., drafts_wait_ns: _Optional[int] = ...) -> None: ...

class DraftDelivery(_message.Message):
    __slots__ = ("lease_owner", "round_id", "drafts", "released")
    LEASE_OWNER_FIELD_NUMBER: _ClassVar[int]
    ROUND_ID_FIELD_NUMBER: _ClassVar[int]
    DRAFTS_FIELD_NUMBER: _ClassVar[int]
    RELEASED_FIELD_NUMBER: _ClassVar[int]
    lease_owner: str
    round_id: int
    drafts: _containers.RepeatedCompositeFieldContainer[DeliveredDrafts]
    released: bool
    def __init__(self, lease_owner: _Optional[str] = ..., round_id: _Optional[int] = ..., drafts: _Optional[_Iterable[_Union[DeliveredDrafts, _Mapping]]] = ..., released: _Optional[bool] = ...) -> None: ...

class DeliveredDrafts(_message.Message):
    __slots__ = ("sequence_id", "token_ids", "distributions")
    SEQUENCE_ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    DISTRIBUTIONS_FIELD_NUMBER: _ClassVar[int]
    sequence_id: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    distributions: _containers.RepeatedCompositeFieldContainer[_common_pb2.SparseDistribution]
    def __init__(self, sequence_id: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ..., distributions: _Optional[_Iterable[_Union[_common_pb2.SparseDistribution, _Mapping]]] = ...) -> None: ...

class DeliveryAck(_message.Message):
    __slots__ = ("round_id", "error")
    ROUND_ID_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    round_id: int
    error: str
    def __init__(self, round_id: _Optional[int] = ..., error: _Optional[str] = ...) -> None: ...
