from . import types_pb2 as _types_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class LayoutDescriptor(_message.Message):
    __slots__ = ("dtype", "page_size", "full_attention_layers", "gdn_layers", "kv_heads", "head_dim", "conv_dim", "conv_window", "num_key_heads", "num_value_heads", "key_head_dim", "value_head_dim", "state_layout", "ssm_dtype")
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    PAGE_SIZE_FIELD_NUMBER: _ClassVar[int]
    FULL_ATTENTION_LAYERS_FIELD_NUMBER: _ClassVar[int]
    GDN_LAYERS_FIELD_NUMBER: _ClassVar[int]
    KV_HEADS_FIELD_NUMBER: _ClassVar[int]
    HEAD_DIM_FIELD_NUMBER: _ClassVar[int]
    CONV_DIM_FIELD_NUMBER: _ClassVar[int]
    CONV_WINDOW_FIELD_NUMBER: _ClassVar[int]
    NUM_KEY_HEADS_FIELD_NUMBER: _ClassVar[int]
    NUM_VALUE_HEADS_FIELD_NUMBER: _ClassVar[int]
    KEY_HEAD_DIM_FIELD_NUMBER: _ClassVar[int]
    VALUE_HEAD_DIM_FIELD_NUMBER: _ClassVar[int]
    STATE_LAYOUT_FIELD_NUMBER: _ClassVar[int]
    SSM_DTYPE_FIELD_NUMBER: _ClassVar[int]
    dtype: str
    page_size: int
    full_attention_layers: _containers.RepeatedScalarFieldContainer[int]
    gdn_layers: _containers.RepeatedScalarFieldContainer[int]
    kv_heads: int
    head_dim: int
    conv_dim: int
    conv_window: int
    num_key_heads: int
    num_value_heads: int
    key_head_dim: int
    value_head_dim: int
    state_layout: str
    ssm_dtype: str
    def __init__(self, dtype: _Optional[str] = ..., page_size: _Optional[int] = ..., full_attention_layers: _Optional[_Iterable[int]] = ..., gdn_layers: _Optional[_Iterable[int]] = ..., kv_heads: _Optional[int] = ..., head_dim: _Optional[int] = ..., conv_dim: _Optional[int] = ..., conv_window: _Optional[int] = ..., num_key_heads: _Optional[int] = ..., num_value_heads: _Optional[int] = ..., key_head_dim: _Optional[int] = ..., value_head_dim: _Optional[int] = ..., state_layout: _Optional[str] = ..., ssm_dtype: _Optional[str] = ...) -> None: ...

class HandoffHeader(_message.Message):
    __slots__ = ("handoff_id", "model_fingerprint", "layout", "prompt_len", "prompt_token_ids", "sampling", "manifest", "request_id", "source_pools", "rank_streams")
    HANDOFF_ID_FIELD_NUMBER: _ClassVar[int]
    MODEL_FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LEN_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    MANIFEST_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    SOURCE_POOLS_FIELD_NUMBER: _ClassVar[int]
    RANK_STREAMS_FIELD_NUMBER: _ClassVar[int]
    handoff_id: int
    model_fingerprint: str
    layout: LayoutDescriptor
    prompt_len: int
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    sampling: _types_pb2.SamplingParams
    manifest: bytes
    request_id: str
    source_pools: bytes
    rank_streams: int
    def __init__(self, handoff_id: _Optional[int] = ..., model_fingerprint: _Optional[str] = ..., layout: _Optional[_Union[LayoutDescriptor, _Mapping]] = ..., prompt_len: _Optional[int] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., sampling: _Optional[_Union[_types_pb2.SamplingParams, _Mapping]] = ..., manifest: _Optional[bytes] = ..., request_id: _Optional[str] = ..., source_pools: _Optional[bytes] = ..., rank_streams: _Optional[int] = ...) -> None: ...

class PoolCopy(_message.Message):
    __slots__ = ("field", "src_index", "dst_start")
    FIELD_FIELD_NUMBER: _ClassVar[int]
    SRC_INDEX_FIELD_NUMBER: _ClassVar[int]
    DST_START_FIELD_NUMBER: _ClassVar[int]
    field: str
    src_index: _containers.RepeatedScalarFieldContainer[int]
    dst_start: int
    def __init__(self, field: _Optional[str] = ..., src_index: _Optional[_Iterable[int]] = ..., dst_start: _Optional[int] = ...) -> None: ...

class TensorChunk(_message.Message):
    __slots__ = ("field", "layer", "offset", "data")
    FIELD_FIELD_NUMBER: _ClassVar[int]
    LAYER_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    field: str
    layer: int
    offset: int
    data: bytes
    def __init__(self, field: _Optional[str] = ..., layer: _Optional[int] = ..., offset: _Optional[int] = ..., data: _Optional[bytes] = ...) -> None: ...

class HandoffTrailer(_message.Message):
    __slots__ = ("crc32c", "first_token", "first_token_logprobs", "tcp_chunks", "rank_chunks")
    class Crc32cEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    CRC32C_FIELD_NUMBER: _ClassVar[int]
    FIRST_TOKEN_FIELD_NUMBER: _ClassVar[int]
    FIRST_TOKEN_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    TCP_CHUNKS_FIELD_NUMBER: _ClassVar[int]
    RANK_CHUNKS_FIELD_NUMBER: _ClassVar[int]
    crc32c: _containers.ScalarMap[str, int]
    first_token: int
    first_token_logprobs: _types_pb2.TokenLogprobs
    tcp_chunks: int
    rank_chunks: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, crc32c: _Optional[_Mapping[str, int]] = ..., first_token: _Optional[int] = ..., first_token_logprobs: _Optional[_Union[_types_pb2.TokenLogprobs, _Mapping]] = ..., tcp_chunks: _Optional[int] = ..., rank_chunks: _Optional[_Iterable[int]] = ...) -> None: ...

class HandoffMessage(_message.Message):
    __slots__ = ("header", "chunk", "trailer", "pool_copy")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    CHUNK_FIELD_NUMBER: _ClassVar[int]
    TRAILER_FIELD_NUMBER: _ClassVar[int]
    POOL_COPY_FIELD_NUMBER: _ClassVar[int]
    header: HandoffHeader
    chunk: TensorChunk
    trailer: HandoffTrailer
    pool_copy: PoolCopy
    def __init__(self, header: _Optional[_Union[HandoffHeader, _Mapping]] = ..., chunk: _Optional[_Union[TensorChunk, _Mapping]] = ..., trailer: _Optional[_Union[HandoffTrailer, _Mapping]] = ..., pool_copy: _Optional[_Union[PoolCopy, _Mapping]] = ...) -> None: ...

class HandoffAck(_message.Message):
    __slots__ = ("handoff_id", "bytes_received")
    HANDOFF_ID_FIELD_NUMBER: _ClassVar[int]
    BYTES_RECEIVED_FIELD_NUMBER: _ClassVar[int]
    handoff_id: int
    bytes_received: int
    def __init__(self, handoff_id: _Optional[int] = ..., bytes_received: _Optional[int] = ...) -> None: ...

class HandoffAccepted(_message.Message):
    __slots__ = ("handoff_id", "pool_copies", "tcp_port", "tcp_ticket", "rank_ports", "rank_ticket", "without_draft_context")
    HANDOFF_ID_FIELD_NUMBER: _ClassVar[int]
    POOL_COPIES_FIELD_NUMBER: _ClassVar[int]
    TCP_PORT_FIELD_NUMBER: _ClassVar[int]
    TCP_TICKET_FIELD_NUMBER: _ClassVar[int]
    RANK_PORTS_FIELD_NUMBER: _ClassVar[int]
    RANK_TICKET_FIELD_NUMBER: _ClassVar[int]
    WITHOUT_DRAFT_CONTEXT_FIELD_NUMBER: _ClassVar[int]
    handoff_id: int
    pool_copies: bool
    tcp_port: int
    tcp_ticket: bytes
    rank_ports: _containers.RepeatedScalarFieldContainer[int]
    rank_ticket: bytes
    without_draft_context: bool
    def __init__(self, handoff_id: _Optional[int] = ..., pool_copies: _Optional[bool] = ..., tcp_port: _Optional[int] = ..., tcp_ticket: _Optional[bytes] = ..., rank_ports: _Optional[_Iterable[int]] = ..., rank_ticket: _Optional[bytes] = ..., without_draft_context: _Optional[bool] = ...) -> None: ...

class HandoffReply(_message.Message):
    __slots__ = ("accepted", "ack")
    ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    ACK_FIELD_NUMBER: _ClassVar[int]
    accepted: HandoffAccepted
    ack: HandoffAck
    def __init__(self, accepted: _Optional[_Union[HandoffAccepted, _Mapping]] = ..., ack: _Optional[_Union[HandoffAck, _Mapping]] = ...) -> None: ...

class StreamRequest(_message.Message):
    __slots__ = ("handoff_id",)
    HANDOFF_ID_FIELD_NUMBER: _ClassVar[int]
    handoff_id: int
    def __init__(self, handoff_id: _Optional[int] = ...) -> None: ...

class TokenEvent(_message.Message):
    __slots__ = ("token_ids", "finish_reason", "accept_lengths", "error", "logprobs")
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    ACCEPT_LENGTHS_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    finish_reason: _types_pb2.FinishReason
    accept_lengths: _containers.RepeatedScalarFieldContainer[int]
    error: str
    logprobs: _containers.RepeatedCompositeFieldContainer[_types_pb2.TokenLogprobs]
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ..., finish_reason: _Optional[_Union[_types_pb2.FinishReason, str]] = ..., accept_lengths: _Optional[_Iterable[int]] = ..., error: _Optional[str] = ..., logprobs: _Optional[_Iterable[_Union[_types_pb2.TokenLogprobs, _Mapping]]] = ...) -> None: ...
