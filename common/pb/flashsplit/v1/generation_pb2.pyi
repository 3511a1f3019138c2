from . import types_pb2 as _types_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class GenerateRequest(_message.Message):
    __slots__ = ("request_id", "text", "token_ids", "sampling", "stop")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    STOP_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    text: str
    token_ids: _types_pb2.TokenIds
    sampling: _types_pb2.SamplingParams
    stop: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, request_id: _Optional[str] = ..., text: _Optional[str] = ..., token_ids: _Optional[_Union[_types_pb2.TokenIds, _Mapping]] = ..., sampling: _Optional[_Union[_types_pb2.SamplingParams, _Mapping]] = ..., stop: _Optional[_Iterable[str]] = ...) -> None: ...

class Usage(_message.Message):
    __slots__ = ("prompt_tokens", "completion_tokens")
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    COMPLETION_TOKENS_FIELD_NUMBER: _ClassVar[int]
    prompt_tokens: int
    completion_tokens: int
    def __init__(self, prompt_tokens: _Optional[int] = ..., completion_tokens: _Optional[int] = ...) -> None: ...

class Timings(_message.Message):
    __slots__ = ("time_to_first_token_s", "inter_token_latencies_s", "total_s", "prefill_queue_s", "prefill_s", "handoff_s")
    TIME_TO_FIRST_TOKEN_S_FIELD_NUMBER: _ClassVar[int]
    INTER_TOKEN_LATENCIES_S_FIELD_NUMBER: _ClassVar[int]
    TOTAL_S_FIELD_NUMBER: _ClassVar[int]
    PREFILL_QUEUE_S_FIELD_NUMBER: _ClassVar[int]
    PREFILL_S_FIELD_NUMBER: _ClassVar[int]
    HANDOFF_S_FIELD_NUMBER: _ClassVar[int]
    time_to_first_token_s: float
    inter_token_latencies_s: _containers.RepeatedScalarFieldContainer[float]
    total_s: float
    prefill_queue_s: float
    prefill_s: float
    handoff_s: float
    def __init__(self, time_to_first_token_s: _Optional[float] = ..., inter_token_latencies_s: _Optional[_Iterable[float]] = ..., total_s: _Optional[float] = ..., prefill_queue_s: _Optional[float] = ..., prefill_s: _Optional[float] = ..., handoff_s: _Optional[float] = ...) -> None: ...

class GenerateResponse(_message.Message):
    __slots__ = ("request_id", "text", "token_ids", "finish_reason", "usage", "timings", "accept_lengths", "logprobs")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    USAGE_FIELD_NUMBER: _ClassVar[int]
    TIMINGS_FIELD_NUMBER: _ClassVar[int]
    ACCEPT_LENGTHS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    text: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    finish_reason: _types_pb2.FinishReason
    usage: Usage
    timings: Timings
    accept_lengths: _containers.RepeatedScalarFieldContainer[int]
    logprobs: _containers.RepeatedCompositeFieldContainer[_types_pb2.TokenLogprobs]
    def __init__(self, request_id: _Optional[str] = ..., text: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ..., finish_reason: _Optional[_Union[_types_pb2.FinishReason, str]] = ..., usage: _Optional[_Union[Usage, _Mapping]] = ..., timings: _Optional[_Union[Timings, _Mapping]] = ..., accept_lengths: _Optional[_Iterable[int]] = ..., logprobs: _Optional[_Iterable[_Union[_types_pb2.TokenLogprobs, _Mapping]]] = ...) -> None: ...

class ModelInfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ModelInfo(_message.Message):
    __slots__ = ("model_name", "model_type", "model_fingerprint", "vocab_size", "max_context_len", "eos_token_ids", "speculative_available", "dtype")
    MODEL_NAME_FIELD_NUMBER: _ClassVar[int]
    MODEL_TYPE_FIELD_NUMBER: _ClassVar[int]
    MODEL_FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    MAX_CONTEXT_LEN_FIELD_NUMBER: _ClassVar[int]
    EOS_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SPECULATIVE_AVAILABLE_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    model_name: str
    model_type: str
    model_fingerprint: str
    vocab_size: int
    max_context_len: int
    eos_token_ids: _containers.RepeatedScalarFieldContainer[int]
    speculative_available: bool
    dtype: str
    def __init__(self, model_name: _Optional[str] = ..., model_type: _Optional[str] = ..., model_fingerprint: _Optional[str] = ..., vocab_size: _Optional[int] = ..., max_context_len: _Optional[int] = ..., eos_token_ids: _Optional[_Iterable[int]] = ..., speculative_available: _Optional[bool] = ..., dtype: _Optional[str] = ...) -> None: ...

class ListWorkersRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class WorkerInfo(_message.Message):
    __slots__ = ("address", "kind", "healthy", "load", "last_error")
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    HEALTHY_FIELD_NUMBER: _ClassVar[int]
    LOAD_FIELD_NUMBER: _ClassVar[int]
    LAST_ERROR_FIELD_NUMBER: _ClassVar[int]
    address: str
    kind: _types_pb2.WorkerKind
    healthy: bool
    load: _types_pb2.LoadReport
    last_error: str
    def __init__(self, address: _Optional[str] = ..., kind: _Optional[_Union[_types_pb2.WorkerKind, str]] = ..., healthy: _Optional[bool] = ..., load: _Optional[_Union[_types_pb2.LoadReport, _Mapping]] = ..., last_error: _Optional[str] = ...) -> None: ...

class ListWorkersResponse(_message.Message):
    __slots__ = ("workers",)
    WORKERS_FIELD_NUMBER: _ClassVar[int]
    workers: _containers.RepeatedCompositeFieldContainer[WorkerInfo]
    def __init__(self, workers: _Optional[_Iterable[_Union[WorkerInfo, _Mapping]]] = ...) -> None: ...
