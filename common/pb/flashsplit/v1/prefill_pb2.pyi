from . import types_pb2 as _types_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class PrefillRequest(_message.Message):
    __slots__ = ("handoff_id", "prompt_token_ids", "sampling", "decode_address", "request_id")
    HANDOFF_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    DECODE_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    handoff_id: int
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    sampling: _types_pb2.SamplingParams
    decode_address: str
    request_id: str
    def __init__(self, handoff_id: _Optional[int] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., sampling: _Optional[_Union[_types_pb2.SamplingParams, _Mapping]] = ..., decode_address: _Optional[str] = ..., request_id: _Optional[str] = ...) -> None: ...

class PrefillTimings(_message.Message):
    __slots__ = ("queue_s", "prefill_s", "handoff_s")
    QUEUE_S_FIELD_NUMBER: _ClassVar[int]
    PREFILL_S_FIELD_NUMBER: _ClassVar[int]
    HANDOFF_S_FIELD_NUMBER: _ClassVar[int]
    queue_s: float
    prefill_s: float
    handoff_s: float
    def __init__(self, queue_s: _Optional[float] = ..., prefill_s: _Optional[float] = ..., handoff_s: _Optional[float] = ...) -> None: ...

class FirstToken(_message.Message):
    __slots__ = ("token_id", "logprobs")
    TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    token_id: int
    logprobs: _types_pb2.TokenLogprobs
    def __init__(self, token_id: _Optional[int] = ..., logprobs: _Optional[_Union[_types_pb2.TokenLogprobs, _Mapping]] = ...) -> None: ...

class PrefillUpdate(_message.Message):
    __slots__ = ("first_token", "done")
    FIRST_TOKEN_FIELD_NUMBER: _ClassVar[int]
    DONE_FIELD_NUMBER: _ClassVar[int]
    first_token: FirstToken
    done: PrefillResponse
    def __init__(self, first_token: _Optional[_Union[FirstToken, _Mapping]] = ..., done: _Optional[_Union[PrefillResponse, _Mapping]] = ...) -> None: ...

class PrefillResponse(_message.Message):
    __slots__ = ("handoff_id", "first_token", "prompt_len", "timings", "finish_reason", "first_token_logprobs")
    HANDOFF_ID_FIELD_NUMBER: _ClassVar[int]
    FIRST_TOKEN_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LEN_FIELD_NUMBER: _ClassVar[int]
    TIMINGS_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    FIRST_TOKEN_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    handoff_id: int
    first_token: int
    prompt_len: int
    timings: PrefillTimings
    finish_reason: _types_pb2.FinishReason
    first_token_logprobs: _types_pb2.TokenLogprobs
    def __init__(self, handoff_id: _Optional[int] = ..., first_token: _Optional[int] = ..., prompt_len: _Optional[int] = ..., timings: _Optional[_Union[PrefillTimings, _Mapping]] = ..., finish_reason: _Optional[_Union[_types_pb2.FinishReason, str]] = ..., first_token_logprobs: _Optional[_Union[_types_pb2.TokenLogprobs, _Mapping]] = ...) -> None: ...
