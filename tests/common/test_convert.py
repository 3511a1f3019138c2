"""common/convert.py: protobuf <-> dataclass round trips, through serialized bytes."""

from __future__ import annotations

import msgpack
import pytest
import torch

from common import convert
from common.handoff.errors import HandoffError
from common.handoff.layout import LayoutDescriptor
from common.handoff.manifest import FieldSpec
from common.handoff.parts import HeaderPart, TrailerPart
from common.handoff.payload import HandoffPayload
from common.handoff.stream import assemble_payload, split_payload
from common.load_report import LoadReport
from common.logprobs import TokenLogprobs
from common.model.family_registry import parse_model_config
from common.pb.flashsplit.v1 import decode_pb2, prefill_pb2, types_pb2
from common.request_spec import RequestSpec
from common.sampling import SamplingParams

TINY = {
    "model_type": "qwen3_5_text", "vocab_size": 64, "hidden_size": 32, "num_hidden_layers": 4,
    "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
    "linear_num_key_heads": 2, "linear_num_value_heads": 4, "linear_key_head_dim": 8,
    "linear_value_head_dim": 8, "linear_conv_kernel_dim": 4, "intermediate_size": 64,
    "full_attention_interval": 2,
}
LAYOUT = LayoutDescriptor.from_model(parse_model_config(TINY), 16, torch.bfloat16)


def _wire(msg):
    return type(msg).FromString(msg.SerializeToString())


def test_unset_sampling_takes_defaults():
    params = convert.sampling_from_pb(_wire(types_pb2.SamplingParams()))
    assert params == SamplingParams() and params.speculative is None


def test_explicit_zero_temperature_stays_greedy():
    params = convert.sampling_from_pb(_wire(types_pb2.SamplingParams(temperature=0.0)))
    assert params.temperature == 0.0 and params.is_greedy
    assert params.top_p == SamplingParams().top_p  # the others keep their defaults


def test_sampling_round_trip():
    params = SamplingParams(temperature=0.7, top_p=0.9, top_k=-1, min_p=0.05, seed=2**63 + 5,
                            max_new_tokens=128, stop_token_ids=(3, 9), ignore_eos=True,
                            logprobs=3, speculative=True)
    msg = _wire(convert.sampling_to_pb(params))
    assert all(msg.HasField(f) for f in ("temperature", "top_p", "top_k", "min_p", "seed",
                                          "max_new_tokens", "ignore_eos", "speculative",
                                          "logprobs"))
    assert convert.sampling_from_pb(msg) == params
    refused = _wire(convert.sampling_to_pb(SamplingParams(speculative=False)))
    assert refused.HasField("speculative") and refused.speculative is False
    assert convert.sampling_from_pb(refused).speculative is False
    unseeded = _wire(convert.sampling_to_pb(SamplingParams()))
    assert not unseeded.HasField("seed") and not unseeded.HasField("speculative")
    assert convert.sampling_from_pb(unseeded) == SamplingParams()


def test_invalid_sampling_is_a_value_error():
    with pytest.raises(ValueError):
        convert.sampling_from_pb(types_pb2.SamplingParams(top_p=0.0))


def test_finish_reasons():
    for reason in ("", "stop", "length", "abort", "error"):
        assert convert.finish_reason_from_pb(convert.finish_reason_to_pb(reason)) == reason
    assert convert.finish_reason_to_pb(None) == types_pb2.FINISH_REASON_UNSPECIFIED
    with pytest.raises(ValueError):
        convert.finish_reason_to_pb("eos")


def test_load_report_round_trip():
    report = LoadReport(kind="decode", address="127.0.0.1:5", model_fingerprint="ab",
                        free_pages=3, total_pages=10, free_slots=1, total_slots=4, queue_len=2,
                        running=3, counters={"handoffs_refused": 7})
    assert convert.load_report_from_pb(_wire(convert.load_report_to_pb(report))) == report
    with pytest.raises(ValueError):
        convert.load_report_from_pb(types_pb2.LoadReport())  # kind unspecified


def test_layout_round_trip():
    assert convert.layout_from_pb(_wire(convert.layout_to_pb(LAYOUT))) == LAYOUT


def test_handoff_round_trip_through_protobuf():
    fields = {name: torch.randn(LAYOUT.field_shape(name, 21)).to(
        getattr(torch, LAYOUT.field_dtype(name))) for name in ("kv", "conv_state", "ssm_state")}
    fields["top_k"] = torch.arange(12, dtype=torch.int32).reshape(2, 6)
    spec = RequestSpec("r", tuple(range(21)),
                       SamplingParams(temperature=0.0, seed=1, speculative=False))
    payload = HandoffPayload(handoff_id=2**64 - 1, fingerprint="f" * 64, layout=LAYOUT,
                             spec=spec, first_token=7, fields=fields)
    wire = [_wire(convert.handoff_part_to_pb(p)) for p in split_payload(payload, 300)]
    assert [m.WhichOneof("part") for m in (wire[0], wire[1], wire[-1])] == \
        ["header", "chunk", "trailer"]
    got = assemble_payload(convert.handoff_part_from_pb(m) for m in wire)
    assert got.spec == spec and got.spec.sampling.speculative is False
    assert got.layout == LAYOUT
    assert got.first_token == 7 and wire[-1].trailer.first_token == 7
    for name, tensor in fields.items():
        assert torch.equal(got.fields[name].view(torch.uint8), tensor.view(torch.uint8)), name


def _header_msg(**changes):
    part = HeaderPart(handoff_id=1, fingerprint="x", layout=LAYOUT,
                      spec=RequestSpec("", (1, 2), SamplingParams()),
                      manifest={"kv": FieldSpec("bfloat16", (2, 2, 1, 16, 2, 16))})
    msg = convert.handoff_part_to_pb(part)
    for key, value in changes.items():
        setattr(msg.header, key, value)
    return msg


@pytest.mark.parametrize("changes", [
    {"prompt_len": 3},
    {"manifest": b"\xc1"},                                         # not msgpack
    {"manifest": msgpack.packb([1, 2])},                           # not a map
    {"manifest": msgpack.packb({"kv": {"dtype": "bfloat16", "shape": [2], "nbytes": 5}})},
    {"manifest": msgpack.packb({"kv": {"dtype": "nope", "shape": [2], "nbytes": 4}})},
    {"manifest": msgpack.packb({"kv": {"shape": [2], "nbytes": 4}})},
])
def test_malformed_header_is_invalid_argument(changes):
    convert.handoff_part_from_pb(_header_msg())  # the unchanged header is fine
    with pytest.raises(HandoffError) as info:
        convert.handoff_part_from_pb(_header_msg(**changes))
    assert info.value.code == "INVALID_ARGUMENT"


def test_empty_handoff_message_and_header_without_layout():
    with pytest.raises(HandoffError):
        convert.handoff_part_from_pb(decode_pb2.HandoffMessage())
    msg = _header_msg()
    msg.header.ClearField("layout")
    with pytest.raises(HandoffError):
        convert.handoff_part_from_pb(msg)


def test_logprobs_round_trip_in_sampling_and_trailer():
    params = SamplingParams(logprobs=0)  # 0 is "the chosen token's only", not unset
    msg = _wire(convert.sampling_to_pb(params))
    assert msg.HasField("logprobs") and convert.sampling_from_pb(msg) == params
    assert not _wire(convert.sampling_to_pb(SamplingParams())).HasField("logprobs")
    with pytest.raises(ValueError, match="logprobs"):
        convert.sampling_from_pb(types_pb2.SamplingParams(logprobs=21))
    # float32 on the wire: values that are float32 already come back exactly
    lp = TokenLogprobs(-0.5, ((3, -0.5), (7, -2.25)))
    assert convert.logprobs_from_pb(_wire(convert.logprobs_to_pb(lp))) == lp
    trailer = TrailerPart(checksums={"kv": 5}, first_token=3, first_logprobs=lp)
    assert convert.handoff_part_from_pb(_wire(convert.handoff_part_to_pb(trailer))) == trailer
    bare = TrailerPart(checksums={"kv": 5}, first_token=3)
    assert convert.handoff_part_from_pb(_wire(convert.handoff_part_to_pb(bare))) == bare
    broken = convert.handoff_part_to_pb(trailer)
    broken.trailer.first_token_logprobs.top_logprobs.append(-9.0)  # 2 ids, 3 values
    with pytest.raises(HandoffError, match="top token ids"):
        convert.handoff_part_from_pb(_wire(broken))


def test_sampling_bytes_match_the_fields_set_one_by_one():
    # the table writes exactly what a field-by-field message holds: the wire is unchanged
    params = SamplingParams(temperature=0.0, top_k=5, seed=9, max_new_tokens=3,
                            stop_token_ids=(4,), speculative=False)
    by_hand = types_pb2.SamplingParams(temperature=0.0, top_p=1.0, top_k=5, min_p=0.0, seed=9,
                                       max_new_tokens=3, stop_token_ids=[4], ignore_eos=False,
                                       speculative=False)
    assert convert.sampling_to_pb(params).SerializeToString(deterministic=True) == \
        by_hand.SerializeToString(deterministic=True)


def test_request_spec_round_trip_through_prefill_request_and_header():
    spec = RequestSpec("r-1", (5, 6, 7), SamplingParams(seed=3, speculative=True))
    request = _wire(prefill_pb2.PrefillRequest(handoff_id=4, decode_address="d:1",
                                               **convert.request_spec_to_pb(spec)))
    assert convert.request_spec_from_pb(request) == spec
    header = HeaderPart(handoff_id=4, fingerprint="x", layout=LAYOUT, spec=spec)
    got = convert.handoff_part_from_pb(_wire(convert.handoff_part_to_pb(header)))
    assert got.spec == spec and got.prompt_len == 3


def test_request_spec_from_pb_refuses_a_long_id_and_bad_sampling():
    with pytest.raises(ValueError, match="request_id"):
        convert.request_spec_from_pb(prefill_pb2.PrefillRequest(request_id="x" * 300))
    with pytest.raises(ValueError, match="top_p"):
        convert.request_spec_from_pb(prefill_pb2.PrefillRequest(
            sampling=types_pb2.SamplingParams(top_p=2.0)))
    msg = _header_msg()
    msg.header.sampling.top_p = 2.0
    with pytest.raises(HandoffError, match="top_p") as info:
        convert.handoff_part_from_pb(msg)
    assert info.value.code == "INVALID_ARGUMENT"


@pytest.mark.parametrize("ids", [[], [0], [5, 17, 200, 5], [2**32 - 1, 0, 248_000]],
                         ids=["empty", "one", "repeats", "extremes"])
def test_token_ids_come_out_of_a_repeated_field_as_python_ints_in_order(ids):
    msg = prefill_pb2.PrefillRequest(prompt_token_ids=ids)
    out = convert.token_ids_from_pb(msg.prompt_token_ids)
    assert out == ids and all(type(i) is int for i in out)
    assert convert.request_spec_from_pb(msg).prompt_ids == tuple(ids)
