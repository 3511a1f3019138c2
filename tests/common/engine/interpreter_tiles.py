"""Wider tiles for our Triton kernels while Triton's interpreter runs them in engine tests.

The interpreter's cost is per program, not per element, and the GPU tiles are narrow on
purpose: one program per weight row of ``tiny``'s projections (the GEMV), four rows a program
for the MoE's experts, half a value head for the GDN verify and commit walk, because many
programs keep a GPU's SMs busy. Wider tiles run the same kernels in a fraction of the
programs. Tile edges and the GPU tiles themselves are checked against the references in
``tests/common/ops/test_triton_interpreter.py``.
"""

from __future__ import annotations

import dataclasses

import pytest
import triton

from common.ops.gdn import replay_triton
from common.ops.linear import triton as triton_linear
from common.ops.moe import triton as triton_moe


def widen_tiles(monkeypatch: pytest.MonkeyPatch) -> None:
    """For the rest of the test: 32 weight rows a GEMV program, 32 a MoE program, and every
    value column of a head in one verify/commit program (so each token's key conv runs once
    instead of once per value block)."""
    tile = triton_linear.config_for
    monkeypatch.setattr(triton_linear, "config_for", lambda rows, n, k: dataclasses.replace(
        tile(rows, n, k), block_n=max(32, tile(rows, n, k).block_n)))
    monkeypatch.setattr(triton_moe, "_BLOCK_N", max(32, triton_moe._BLOCK_N))
    monkeypatch.setattr(replay_triton, "value_block", lambda dk, dv: triton.next_power_of_2(dv))
