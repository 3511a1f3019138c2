"""What each --handoff-transport implies."""

from common.handoff.transports import HANDOFF_TRANSPORTS, shares_pools, takes_tcp


def test_each_transport_says_which_paths_it_takes():
    assert [t for t in HANDOFF_TRANSPORTS if shares_pools(t)] == ["auto", "device"]
    assert [t for t in HANDOFF_TRANSPORTS if takes_tcp(t)] == ["auto", "tcp"]
