"""Conversions between the protobuf messages and the dataclasses the rest of the code uses.

This is the only module outside the servicers and clients that imports ``*_pb2``. Conversions of
handoff messages raise ``HandoffError`` (INVALID_ARGUMENT) for malformed input, so the decode
servicer has one error path; the others raise ``ValueError``, which servicers answer with
INVALID_ARGUMENT.
"""

from __future__ import annotations

import msgpack
import numpy as np

from common.handoff.errors import HandoffError
from common.handoff.layout import LayoutDescriptor
from common.handoff.manifest import FieldSpec
from common.handoff.parts import ChunkPart, HandoffPart, HeaderPart, PoolCopyPart, TrailerPart
from common.limits import check_request_id, unique_stop_token_ids
from common.load_report import LoadReport
from common.logprobs import TokenLogprobs
from common.pb.flashsplit.v1 import decode_pb2, prefill_pb2, types_pb2
from common.request_spec import RequestSpec
from common.sampling import SamplingParams

# finish reasons: the engines' strings <-> the wire enum ("" = not finished)
_FINISH_TO_PB = {
    "": types_pb2.FINISH_REASON_UNSPECIFIED,
    "stop": types_pb2.FINISH_REASON_STOP,
    "length": types_pb2.FINISH_REASON_LENGTH,
    "abort": types_pb2.FINISH_REASON_ABORT,
    "error": types_pb2.FINISH_REASON_ERROR,
}
_FINISH_FROM_PB = {v: k for k, v in _FINISH_TO_PB.items()}
_KIND_TO_PB = {"prefill": types_pb2.WORKER_KIND_PREFILL, "decode": types_pb2.WORKER_KIND_DECODE}
_KIND_FROM_PB = {v: k for k, v in _KIND_TO_PB.items()}
# SamplingParams fields with explicit presence on the wire, in declaration order: written when
# not None and read when present, so this one list is the conversion both ways (the one
# repeated field, stop_token_ids, is beside it)
_SAMPLING_SCALARS = ("temperature", "top_p", "top_k", "min_p", "seed", "max_new_tokens",
                     "ignore_eos", "logprobs", "speculative")


def finish_reason_to_pb(reason: str | None) -> int:
    """"stop" | "length" | "abort" | "error" | "" (or None: not finished) -> FinishReason."""
    try:
        return _FINISH_TO_PB[reason or ""]
    except KeyError:
        raise ValueError(f"unknown finish reason {reason!r}; expected one of "
                         f"{sorted(_FINISH_TO_PB)}") from None


def finish_reason_from_pb(value: int) -> str:
    """FinishReason -> "" (not finished), "stop", "length", "abort" or "error"."""
    try:
        return _FINISH_FROM_PB[value]
    except KeyError:
        raise ValueError(f"unknown FinishReason value {value}") from None


# sampling
def sampling_to_pb(params: SamplingParams) -> types_pb2.SamplingParams:
    """Every field set (fully resolved); those that may be None (``seed``, ``logprobs``,
    ``speculative``) only when they are not."""
    msg = types_pb2.SamplingParams(stop_token_ids=list(params.stop_token_ids))
    for name in _SAMPLING_SCALARS:
        value = getattr(params, name)
        if value is not None:
            setattr(msg, name, value)
    return msg


def sampling_from_pb(msg: types_pb2.SamplingParams) -> SamplingParams:
    """Set fields as given, unset ones at ``SamplingParams``' defaults.

    Presence, not value, decides: an explicit ``temperature: 0`` stays 0 (greedy), an unset
    ``speculative`` leaves the choice to the worker. Stop ids are de-duplicated (first
    occurrence kept). Raises ``ValueError`` for values ``SamplingParams`` rejects and for more
    than ``common.limits.MAX_STOP_TOKEN_IDS`` distinct stop ids.
    """
    kwargs = {name: getattr(msg, name) for name in _SAMPLING_SCALARS if msg.HasField(name)}
    if msg.stop_token_ids:
        kwargs["stop_token_ids"] = unique_stop_token_ids(msg.stop_token_ids)
    return SamplingParams(**kwargs)


# request spec: ``PrefillRequest`` and ``HandoffHeader`` name its fields alike
def request_spec_to_pb(spec: RequestSpec) -> dict:
    """The spec's fields of a ``PrefillRequest`` or ``HandoffHeader``, as constructor keywords."""
    return {"request_id": spec.request_id, "prompt_token_ids": list(spec.prompt_ids),
            "sampling": sampling_to_pb(spec.sampling)}


def request_spec_from_pb(msg: prefill_pb2.PrefillRequest | decode_pb2.HandoffHeader
                         ) -> RequestSpec:
    """The spec a ``PrefillRequest`` or ``HandoffHeader`` carries; ``ValueError`` for a request id
    over ``common.limits.MAX_REQUEST_ID_BYTES`` or sampling settings ``sampling_from_pb``
    rejects."""
    check_request_id(msg.request_id)
    return RequestSpec(msg.request_id, tuple(token_ids_from_pb(msg.prompt_token_ids)),
                       sampling_from_pb(msg.sampling))


def token_ids_from_pb(field) -> list[int]:
    """A repeated token-id field as a list, read through the field's buffer (upb's protobuf
    gives one): one C pass, where ``list(field)`` goes through the field id by id (32k ids:
    0.4 against 1.1 ms on the 2-core CPU machine, at every hop of a prompt)."""
    return np.asarray(field, dtype=np.int64).tolist()


def logprobs_to_pb(logprobs: TokenLogprobs) -> types_pb2.TokenLogprobs:
    return types_pb2.TokenLogprobs(
        logprob=logprobs.logprob, top_token_ids=[t for t, _ in logprobs.top],
        top_logprobs=[v for _, v in logprobs.top])


def logprobs_from_pb(msg: types_pb2.TokenLogprobs) -> TokenLogprobs:
    """Raises ``ValueError`` when the top ids and values differ in number."""
    if len(msg.top_token_ids) != len(msg.top_logprobs):
        raise ValueError(f"log-probabilities with {len(msg.top_token_ids)} top token ids but "
                         f"{len(msg.top_logprobs)} values")
    return TokenLogprobs(msg.logprob, tuple(zip(msg.top_token_ids, msg.top_logprobs)))


# layout and manifest
def layout_to_pb(layout: LayoutDescriptor) -> decode_pb2.LayoutDescriptor:
    return decode_pb2.LayoutDescriptor(
        dtype=layout.dtype, page_size=layout.page_size,
        full_attention_layers=list(layout.full_attention_layers),
        gdn_layers=list(layout.gdn_layers), kv_heads=layout.kv_heads, head_dim=layout.head_dim,
        conv_dim=layout.conv_dim, conv_window=layout.conv_window,
        num_key_heads=layout.num_key_heads, num_value_heads=layout.num_value_heads,
        key_head_dim=layout.key_head_dim, value_head_dim=layout.value_head_dim,
        state_layout=layout.state_layout, ssm_dtype=layout.ssm_dtype)


def layout_from_pb(msg: decode_pb2.LayoutDescriptor) -> LayoutDescriptor:
    """No validation here: the receiver compares the result with its own layout."""
    return LayoutDescriptor(
        dtype=msg.dtype, page_size=msg.page_size,
        full_attention_layers=tuple(msg.full_attention_layers), gdn_layers=tuple(msg.gdn_layers),
        kv_heads=msg.kv_heads, head_dim=msg.head_dim, conv_dim=msg.conv_dim,
        conv_window=msg.conv_window, num_key_heads=msg.num_key_heads,
        num_value_heads=msg.num_value_heads, key_head_dim=msg.key_head_dim,
        value_head_dim=msg.value_head_dim, state_layout=msg.state_layout,
        ssm_dtype=msg.ssm_dtype)


def manifest_to_bytes(manifest: dict[str, FieldSpec]) -> bytes:
    """msgpack ``{field: {"dtype": str, "shape": [int], "nbytes": int}}``."""
    return msgpack.packb({name: {"dtype": spec.dtype, "shape": list(spec.shape),
                                 "nbytes": spec.nbytes} for name, spec in manifest.items()})


def manifest_from_bytes(data: bytes) -> dict[str, FieldSpec]:
    """Parse and check a manifest's structure; INVALID_ARGUMENT when it is malformed or a
    declared ``nbytes`` disagrees with its dtype and shape."""
    try:
        raw = msgpack.unpackb(data, raw=False)
        if not isinstance(raw, dict):
            raise TypeError("not a map")
        manifest = {}
        for name, entry in raw.items():
            dtype, shape, nbytes = entry["dtype"], entry["shape"], entry["nbytes"]
            if (not isinstance(name, str) or not isinstance(dtype, str)
                    or not isinstance(shape, list) or not isinstance(nbytes, int)
                    or not all(isinstance(d, int) and not isinstance(d, bool) for d in shape)):
                raise TypeError(f"bad entry for {name!r}")
            spec = FieldSpec(dtype, tuple(shape))
            if spec.nbytes != nbytes:
                raise ValueError(f"field {name!r}: nbytes {nbytes} but dtype {dtype} and shape "
                                 f"{shape} make {spec.nbytes}")
            manifest[name] = spec
    except (ValueError, TypeError, KeyError, msgpack.exceptions.UnpackException) as err:
        raise HandoffError("INVALID_ARGUMENT", f"malformed manifest: {err}") from None
    return manifest


# handoff messages
def handoff_part_to_pb(part: HandoffPart) -> decode_pb2.HandoffMessage:
    if isinstance(part, ChunkPart):
        return decode_pb2.HandoffMessage(chunk=decode_pb2.TensorChunk(
            field=part.field, layer=part.layer, offset=part.offset, data=part.data))
    if isinstance(part, HeaderPart):
        return decode_pb2.HandoffMessage(header=decode_pb2.HandoffHeader(
            handoff_id=part.handoff_id, model_fingerprint=part.fingerprint,
            layout=layout_to_pb(part.layout), prompt_len=part.prompt_len,
            manifest=manifest_to_bytes(part.manifest), source_pools=part.source_pools,
            rank_streams=part.rank_streams, **request_spec_to_pb(part.spec)))
    if isinstance(part, PoolCopyPart):
        return decode_pb2.HandoffMessage(pool_copy=decode_pb2.PoolCopy(
            field=part.field, src_index=list(part.src_index), dst_start=part.dst_start))
    if isinstance(part, TrailerPart):
        trailer = decode_pb2.HandoffTrailer(crc32c=dict(part.checksums),
                                            first_token=part.first_token,
                                            tcp_chunks=part.tcp_chunks,
                                            rank_chunks=list(part.rank_chunks))
        if part.first_logprobs is not None:
            trailer.first_token_logprobs.CopyFrom(logprobs_to_pb(part.first_logprobs))
        return decode_pb2.HandoffMessage(trailer=trailer)
    raise TypeError(f"not a handoff part: {type(part)!r}")


def handoff_part_from_pb(msg: decode_pb2.HandoffMessage) -> HandoffPart:
    """Raises INVALID_ARGUMENT for an empty message or a malformed header."""
    kind = msg.WhichOneof("part")
    if kind == "chunk":
        c = msg.chunk
        return ChunkPart(field=c.field, layer=c.layer, offset=c.offset, data=c.data)
    if kind == "pool_copy":
        c = msg.pool_copy
        return PoolCopyPart(field=c.field, src_index=tuple(c.src_index), dst_start=c.dst_start)
    if kind == "trailer":
        t = msg.trailer
        try:
            first_logprobs = (logprobs_from_pb(t.first_token_logprobs)
                              if t.HasField("first_token_logprobs") else None)
        except ValueError as err:
            raise HandoffError("INVALID_ARGUMENT", f"trailer: {err}") from None
        return TrailerPart(checksums=dict(t.crc32c),
                           first_token=t.first_token if t.HasField("first_token") else None,
                           first_logprobs=first_logprobs, tcp_chunks=t.tcp_chunks,
                           rank_chunks=tuple(t.rank_chunks))
    if kind != "header":
        raise HandoffError("INVALID_ARGUMENT", "handoff message carries no part")
    h = msg.header
    if not h.HasField("layout") or not h.HasField("sampling"):
        raise HandoffError("INVALID_ARGUMENT", "handoff header lacks its layout or sampling")
    if h.prompt_len != len(h.prompt_token_ids):
        raise HandoffError("INVALID_ARGUMENT", f"prompt_len {h.prompt_len} but "
                           f"{len(h.prompt_token_ids)} prompt token ids")
    try:
        spec = request_spec_from_pb(h)
    except ValueError as err:
        raise HandoffError("INVALID_ARGUMENT", f"bad request in the header: {err}") from None
    return HeaderPart(
        handoff_id=h.handoff_id, fingerprint=h.model_fingerprint, layout=layout_from_pb(h.layout),
        spec=spec, manifest=manifest_from_bytes(h.manifest), source_pools=h.source_pools,
        rank_streams=h.rank_streams)


# load
def load_report_to_pb(report: LoadReport) -> types_pb2.LoadReport:
    return types_pb2.LoadReport(
        kind=_KIND_TO_PB[report.kind], address=report.address,
        model_fingerprint=report.model_fingerprint, free_pages=report.free_pages,
        total_pages=report.total_pages, free_slots=report.free_slots,
        total_slots=report.total_slots, queue_len=report.queue_len, running=report.running,
        counters=dict(report.counters), max_request_tokens=report.max_request_tokens)


def load_report_from_pb(msg: types_pb2.LoadReport) -> LoadReport:
    """Raises ``ValueError`` for an unspecified worker kind or inconsistent counts."""
    if msg.kind not in _KIND_FROM_PB:
        raise ValueError(f"load report with unknown worker kind {msg.kind}")
    return LoadReport(
        kind=_KIND_FROM_PB[msg.kind], address=msg.address,
        model_fingerprint=msg.model_fingerprint, free_pages=msg.free_pages,
        total_pages=msg.total_pages, free_slots=msg.free_slots, total_slots=msg.total_slots,
        queue_len=msg.queue_len, running=msg.running, counters=dict(msg.counters),
        max_request_tokens=msg.max_request_tokens)
