"""The tcp transport's connection format: hello, frame headers, and where a target's host is."""

from __future__ import annotations

import io

import pytest

from common.handoff.tcp_frames import (FRAME_HEADER_BYTES, MAX_FRAME_BYTES, FrameError,
                                       frame_header, hello, parse_frame_header, read_hello,
                                       tcp_host)

TICKET = bytes(range(16))


@pytest.mark.parametrize("token", ["s3cret-token", None])
def test_a_hello_carries_the_token(token):
    assert read_hello(io.BytesIO(hello(token)).read) == token


@pytest.mark.parametrize("data", [b"", b"FSH1", b"HTTP/1.1 200 OK\r\n", b"FSH1\x05\x00\x00\x00ab",
                                  b"FSH1\xff\xff\x00\x00"])
def test_anything_else_is_not_a_hello(data):
    with pytest.raises(FrameError):
        read_hello(io.BytesIO(data).read)


def test_frame_headers_round_trip():
    head = frame_header(TICKET, 4 << 20)
    assert len(head) == FRAME_HEADER_BYTES == 32
    assert parse_frame_header(head) == (TICKET, 4 << 20)


@pytest.mark.parametrize("head", [
    b"",                                              # the connection closed
    frame_header(TICKET, 10)[:-1],                    # truncated
    b"XXXX" + frame_header(TICKET, 10)[4:],           # another magic
    frame_header(TICKET, 10)[:4] + b"\x01\x00\x00\x00" + frame_header(TICKET, 10)[8:],
    frame_header(TICKET, 10)[:24] + (0).to_bytes(8, "little"),                # empty
    frame_header(TICKET, 10)[:24] + (MAX_FRAME_BYTES + 1).to_bytes(8, "little"),  # too big
])
def test_malformed_frame_headers_are_refused(head):
    with pytest.raises(FrameError):
        parse_frame_header(head)


def test_a_sender_cannot_make_a_bad_frame():
    with pytest.raises(ValueError):
        frame_header(b"short", 10)
    with pytest.raises(ValueError):
        frame_header(TICKET, 0)


@pytest.mark.parametrize("address,host", [
    ("127.0.0.1:5001", "127.0.0.1"),
    ("decode-0.decode.default.svc:50062", "decode-0.decode.default.svc"),
    ("dns:///flashsplit-decode:50062", "flashsplit-decode"),
    ("ipv4:10.0.0.3:5001,10.0.0.4:5001", "10.0.0.3"),
    ("[::1]:5001", "::1"),
    ("ipv6:[fe80::1]:5001", "fe80::1"),
    ("unix:/tmp/decode.sock", None),
    ("localhost", "localhost"),
])
def test_the_listener_host_is_the_host_the_sender_dialled(address, host):
    assert tcp_host(address) == host
