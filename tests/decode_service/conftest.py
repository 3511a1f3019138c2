"""The handoff tests' tiny config and random payloads, shared with the decode side's tests."""

from tests.common.handoff.conftest import (config, fingerprint, layout,  # noqa: F401
                                           make_payload)
