"""What each --handoff-transport implies, and that the plaintext TCP frames never go beside TLS."""

import pytest

from common.handoff.transports import HANDOFF_TRANSPORTS, shares_pools, takes_tcp_with

TLS = object()  # any TLS settings


def test_each_transport_says_which_paths_it_takes():
    assert [t for t in HANDOFF_TRANSPORTS if shares_pools(t)] == ["auto", "device"]
    assert [t for t in HANDOFF_TRANSPORTS if takes_tcp_with(t, None)] == ["auto", "tcp"]


def test_tcp_frames_never_go_beside_tls():
    assert not any(takes_tcp_with(t, TLS) for t in ("auto", "stream", "device"))
    with pytest.raises(ValueError, match="plaintext.*cannot be used with TLS"):
        takes_tcp_with("tcp", TLS)
