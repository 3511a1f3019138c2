"""Programmatic dependent launch on the GPU: each ``triton-pdl`` backend gives its plain Triton
backend's bits, alone and in a chain of dependent kernels replayed from a CUDA graph (where a
missing wait would read a half-written input)."""

from __future__ import annotations

import pytest
import torch

from common.ops.registry import default_registry
from tests.common.compare import randn

pytestmark = pytest.mark.gpu

OPS = ("linear", "rms_norm", "add_rms_norm", "gated_rms_norm", "silu_and_mul",
       "sigmoid_gate_mul")


def _ops(backend: str) -> dict:
    pytest.importorskip("triton", reason="triton is not installed")
    registry = default_registry()
    return {op: registry.get(op, backend) for op in OPS}


def test_launch_options_follow_the_device():
    from common.ops.pdl import launch_options

    assert launch_options(True, torch.device("cpu")) == {"PDL": False}
    assert launch_options(False, torch.device("cuda")) == {"PDL": False}
    on = torch.cuda.get_device_capability()[0] >= 9
    assert launch_options(True, torch.device("cuda")) == (
        {"PDL": True, "launch_pdl": True} if on else {"PDL": False})


def _layer(kn: dict, x, residual, w: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """A decode step's chain of dependent kernels, one row: norm -> GEMV -> gated norm ->
    GEMV -> add + norm -> GEMV -> SwiGLU -> GEMV -> gate."""
    h, residual = kn["add_rms_norm"](x=x, residual=residual, weight=w["n1"], eps=1e-6)
    p = kn["linear"](x=h, weight=w["in"])  # [1, 2 * 4 * 128]
    o = kn["gated_rms_norm"](x=p[:, :512].view(1, 4, 128), gate=p[:, 512:].view(1, 4, 128),
                             weight=w["gn"], eps=1e-6)
    x = kn["linear"](x=o.reshape(1, 512), weight=w["out"])
    h, residual = kn["add_rms_norm"](x=x, residual=residual, weight=w["n2"], eps=1e-6)
    act = kn["silu_and_mul"](x=kn["linear"](x=h, weight=w["gate_up"]))
    x = kn["linear"](x=act, weight=w["down"])
    g = kn["sigmoid_gate_mul"](x=x.view(1, 4, 160), gate=kn["rms_norm"](
        x=residual, weight=w["n1"], eps=1e-6).view(1, 4, 160))
    return g.view(1, 640), residual


def test_pdl_chain_gives_the_plain_bits_eager_and_replayed():
    gen = torch.Generator(device="cuda").manual_seed(1)
    bf = torch.bfloat16
    w = {"n1": randn(gen, 640, dtype=bf) * 0.1, "n2": randn(gen, 640, dtype=bf) * 0.1,
         "gn": randn(gen, 128, dtype=bf), "in": randn(gen, 1024, 640, dtype=bf) * 0.04,
         "out": randn(gen, 640, 512, dtype=bf) * 0.04,
         "gate_up": randn(gen, 2 * 1728, 640, dtype=bf) * 0.04,
         "down": randn(gen, 640, 1728, dtype=bf) * 0.02}
    x0, r0 = randn(gen, 1, 640, dtype=bf), randn(gen, 1, 640, dtype=bf)

    def run(kn, steps=12):
        x, r = x0, r0
        for _ in range(steps):
            x, r = _layer(kn, x, r, w)
        return x, r

    plain, pdl = _ops("triton"), _ops("triton-pdl")
    want = run(plain)
    got = run(pdl)
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    run(pdl)  # warm before capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = run(pdl)
    for _ in range(20):
        graph.replay()
        torch.cuda.synchronize()
        assert all(torch.equal(a, b) for a, b in zip(out, want))
