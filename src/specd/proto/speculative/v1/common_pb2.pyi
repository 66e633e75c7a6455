from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class DrafterKind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    DRAFTER_KIND_UNSPECIFIED: _ClassVar[DrafterKind]
    DRAFTER_KIND_MODEL: _ClassVar[DrafterKind]
    DRAFTER_KIND_NGRAM: _ClassVar[DrafterKind]
    DRAFTER_KIND_SUFFIX: _ClassVar[DrafterKind]

class ErrorCode(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    ERROR_CODE_UNSPECIFIED: _ClassVar[ErrorCode]
    ERROR_CODE_NOT_FOUND: _ClassVar[ErrorCode]
    ERROR_CODE_INVALID_ARGUMENT: _ClassVar[ErrorCode]
    ERROR_CODE_RESOURCE_EXHAUSTED: _ClassVar[ErrorCode]
    ERROR_CODE_FAILED_PRECONDITION: _ClassVar[ErrorCode]
    ERROR_CODE_INTERNAL: _ClassVar[ErrorCode]
    ERROR_CODE_UNAVAILABLE: _ClassVar[ErrorCode]
DRAFTER_KIND_UNSPECIFIED: DrafterKind
DRAFTER_KIND_MODEL: DrafterKind
DRAFTER_KIND_NGRAM: DrafterKind
DRAFTER_KIND_SUFFIX: DrafterKind
ERROR_CODE_UNSPECIFIED: ErrorCode
ERROR_CODE_NOT_FOUND: ErrorCode
ERROR_CODE_INVALID_ARGUMENT: ErrorCode
ERROR_CODE_RESOURCE_EXHAUSTED: ErrorCode
ERROR_CODE_FAILED_PRECONDITION: ErrorCode
ERROR_CODE_INTERNAL: ErrorCode
ERROR_CODE_UNAVAILABLE: ErrorCode

class SamplingParams(_message.Message):
    __slots__ = ("temperature", "top_p", "top_k", "seed", "presence_penalty", "frequency_penalty", "repetition_penalty", "logit_bias", "min_p", "min_tokens", "min_tokens_eos_ids")
    class LogitBiasEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: int
        value: float
        def __init__(self, key: _Optional[int] = ..., value: _Optional[float] = ...) -> None: ...
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    PRESENCE_PENALTY_FIELD_NUMBER: _ClassVar[int]
    FREQUENCY_PENALTY_FIELD_NUMBER: _ClassVar[int]
    REPETITION_PENALTY_FIELD_NUMBER: _ClassVar[int]
    LOGIT_BIAS_FIELD_NUMBER: _ClassVar[int]
    MIN_P_FIELD_NUMBER: _ClassVar[int]
    MIN_TOKENS_FIELD_NUMBER: _ClassVar[int]
    MIN_TOKENS_EOS_IDS_FIELD_NUMBER: _ClassVar[int]
    temperature: float
    top_p: float
    top_k: int
    seed: int
    presence_penalty: float
    frequency_penalty: float
    repetition_penalty: float
    logit_bias: _containers.ScalarMap[int, float]
    min_p: float
    min_tokens: int
    min_tokens_eos_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, temperature: _Optional[float] = ..., top_p: _Optional[float] = ..., top_k: _Optional[int] = ..., seed: _Optional[int] = ..., presence_penalty: _Optional[float] = ..., frequency_penalty: _Optional[float] = ..., repetition_penalty: _Optional[float] = ..., logit_bias: _Optional[_Mapping[int, float]] = ..., min_p: _Optional[float] = ..., min_tokens: _Optional[int] = ..., min_tokens_eos_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class LogprobsRequest(_message.Message):
    __slots__ = ("top_logprobs", "prompt")
    TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_FIELD_NUMBER: _ClassVar[int]
    top_logprobs: int
    prompt: bool
    def __init__(self, top_logprobs: _Optional[int] = ..., prompt: _Optional[bool] = ...) -> None: ...

class TokenLogprob(_message.Message):
    __slots__ = ("token_id", "logprob", "top_token_ids", "top_logprobs")
    TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    TOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    token_id: int
    logprob: float
    top_token_ids: _containers.RepeatedScalarFieldContainer[int]
    top_logprobs: _containers.RepeatedScalarFieldContainer[float]
    def __init__(self, token_id: _Optional[int] = ..., logprob: _Optional[float] = ..., top_token_ids: _Optional[_Iterable[int]] = ..., top_logprobs: _Optional[_Iterable[float]] = ...) -> None: ...

class TokenizerFingerprint(_message.Message):
    __slots__ = ("vocab_size", "vocab_sha256", "special_token_ids", "end_token_ids", "special_ids")
    class SpecialTokenIdsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    VOCAB_SHA256_FIELD_NUMBER: _ClassVar[int]
    SPECIAL_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    END_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SPECIAL_IDS_FIELD_NUMBER: _ClassVar[int]
    vocab_size: int
    vocab_sha256: str
    special_token_ids: _containers.ScalarMap[str, int]
    end_token_ids: _containers.RepeatedScalarFieldContainer[int]
    special_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, vocab_size: _Optional[int] = ..., vocab_sha256: _Optional[str] = ..., special_token_ids: _Optional[_Mapping[str, int]] = ..., end_token_ids: _Optional[_Iterable[int]] = ..., special_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class ModelInfo(_message.Message):
    __slots__ = ("model_id", "tokenizer", "max_context", "device", "dtype", "model_vocab_size", "max_sequences", "max_draft_tokens", "lease_seconds", "hidden_size", "step_timings", "weights", "activations")
    MODEL_ID_FIELD_NUMBER: _ClassVar[int]
    TOKENIZER_FIELD_NUMBER: _ClassVar[int]
    MAX_CONTEXT_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    MODEL_VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    MAX_SEQUENCES_FIELD_NUMBER: _ClassVar[int]
    MAX_DRAFT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    LEASE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    HIDDEN_SIZE_FIELD_NUMBER: _ClassVar[int]
    STEP_TIMINGS_FIELD_NUMBER: _ClassVar[int]
    WEIGHTS_FIELD_NUMBER: _ClassVar[int]
    ACTIVATIONS_FIELD_NUMBER: _ClassVar[int]
    model_id: str
    tokenizer: TokenizerFingerprint
    max_context: int
    device: str
    dtype: str
    model_vocab_size: int
    max_sequences: int
    max_draft_tokens: int
    lease_seconds: float
    hidden_size: int
    step_timings: _containers.RepeatedCompositeFieldContainer[StepTiming]
    weights: str
    activations: str
    def __init__(self, model_id: _Optional[str] = ..., tokenizer: _Optional[_Union[TokenizerFingerprint, _Mapping]] = ..., max_context: _Optional[int] = ..., device: _Optional[str] = ..., dtype: _Optional[str] = ..., model_vocab_size: _Optional[int] = ..., max_sequences: _Optional[int] = ..., max_draft_tokens: _Optional[int] = ..., lease_seconds: _Optional[float] = ..., hidden_size: _Optional[int] = ..., step_timings: _Optional[_Iterable[_Union[StepTiming, _Mapping]]] = ..., weights: _Optional[str] = ..., activations: _Optional[str] = ...) -> None: ...

class StepTiming(_message.Message):
    __slots__ = ("sequences", "forward_ns")
    SEQUENCES_FIELD_NUMBER: _ClassVar[int]
    FORWARD_NS_FIELD_NUMBER: _ClassVar[int]
    sequences: int
    forward_ns: int
    def __init__(self, sequences: _Optional[int] = ..., forward_ns: _Optional[int] = ...) -> None: ...

class SequenceError(_message.Message):
    __slots__ = ("code", "message")
    CODE_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    code: ErrorCode
    message: str
    def __init__(self, code: _Optional[_Union[ErrorCode, str]] = ..., message: _Optional[str] = ...) -> None: ...

class SparseDistribution(_message.Message):
    __slots__ = ("token_ids", "probs")
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    PROBS_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    probs: _containers.RepeatedScalarFieldContainer[float]
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ..., probs: _Optional[_Iterable[float]] = ...) -> None: ...

class SequenceSpec(_message.Message):
    __slots__ = ("sequence_id", "prompt_token_ids", "sampling", "num_generated", "logprobs", "json_schema", "prefill_tokens", "grammar", "tenant", "end_token_ids", "trace_context")
    class TraceContextEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    SEQUENCE_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    NUM_GENERATED_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    JSON_SCHEMA_FIELD_NUMBER: _ClassVar[int]
    PREFILL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    GRAMMAR_FIELD_NUMBER: _ClassVar[int]
    TENANT_FIELD_NUMBER: _ClassVar[int]
    END_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    TRACE_CONTEXT_FIELD_NUMBER: _ClassVar[int]
    sequence_id: str
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    sampling: SamplingParams
    num_generated: int
    logprobs: LogprobsRequest
    json_schema: str
    prefill_tokens: int
    grammar: str
    tenant: str
    end_token_ids: _containers.RepeatedScalarFieldContainer[int]
    trace_context: _containers.ScalarMap[str, str]
    def __init__(self, sequence_id: _Optional[str] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., sampling: _Optional[_Union[SamplingParams, _Mapping]] = ..., num_generated: _Optional[int] = ..., logprobs: _Optional[_Union[LogprobsRequest, _Mapping]] = ..., json_schema: _Optional[str] = ..., prefill_tokens: _Optional[int] = ..., grammar: _Optional[str] = ..., tenant: _Optional[str] = ..., end_token_ids: _Optional[_Iterable[int]] = ..., trace_context: _Optional[_Mapping[str, str]] = ...) -> None: ...

class OpenResult(_message.Message):
    __slots__ = ("sequence_id", "error", "prompt_logprobs", "prefill_pending")
    SEQUENCE_ID_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    PREFILL_PENDING_FIELD_NUMBER: _ClassVar[int]
    sequence_id: str
    error: SequenceError
    prompt_logprobs: _containers.RepeatedCompositeFieldContainer[TokenLogprob]
    prefill_pending: int
    def __init__(self, sequence_id: _Optional[str] = ..., error: _Optional[_Union[SequenceError, _Mapping]] = ..., prompt_logprobs: _Optional[_Iterable[_Union[TokenLogprob, _Mapping]]] = ..., prefill_pending: _Optional[int] = ...) -> None: ...

class ServiceTimings(_message.Message):
    __slots__ = ("queue_ns", "forward_ns", "total_ns")
    QUEUE_NS_FIELD_NUMBER: _ClassVar[int]
    FORWARD_NS_FIELD_NUMBER: _ClassVar[int]
    TOTAL_NS_FIELD_NUMBER: _ClassVar[int]
    queue_ns: int
    forward_ns: int
    total_ns: int
    def __init__(self, queue_ns: _Optional[int] = ..., forward_ns: _Optional[int] = ..., total_ns: _Optional[int] = ...) -> None: ...

class KeepAliveRequest(_message.Message):
    __slots__ = ("lease_owner",)
    LEASE_OWNER_FIELD_NUMBER: _ClassVar[int]
    lease_owner: str
    def __init__(self, lease_owner: _Optional[str] = ...) -> None: ...

class AttachRequest(_message.Message):
    __slots__ = ("lease_owner",)
    LEASE_OWNER_FIELD_NUMBER: _ClassVar[int]
    lease_owner: str
    def __init__(self, lease_owner: _Optional[str] = ...) -> None: ...

class AttachResponse(_message.Message):
    __slots__ = ("detach_seconds",)
    DETACH_SECONDS_FIELD_NUMBER: _ClassVar[int]
    detach_seconds: float
    def __init__(self, detach_seconds: _Optional[float] = ...) -> None: ...

class KeepAliveResponse(_message.Message):
    __slots__ = ("open_sequences", "lease_seconds")
    OPEN_SEQUENCES_FIELD_NUMBER: _ClassVar[int]
    LEASE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    open_sequences: int
    lease_seconds: float
    def __init__(self, open_sequences: _Optional[int] = ..., lease_seconds: _Optional[float] = ...) -> None: ...
