import pytest

from common.ops.gdn.reference import chunk_gated_delta_rule
from common.ops.registry import REFERENCE_OPS, OpRegistry, _import_factory, default_registry


def test_default_registry_resolves_every_reference_op():
    registry = default_registry()
    assert registry.ops() == sorted(REFERENCE_OPS)
    for op in REFERENCE_OPS:
        assert callable(registry.get(op, "reference"))
        assert "reference" in registry.backends(op)
    assert registry.get("chunk_gated_delta_rule") is chunk_gated_delta_rule


def test_unknown_backend_lists_supported_backends():
    registry = default_registry()
    registry.register("paged_attention", "fast", lambda: (lambda **kw: None))
    with pytest.raises(ValueError, match=r"supported backends: fast, flashinfer, reference"):
        registry.get("paged_attention", "cutlass")


def test_gpu_backends_are_registered_without_importing_their_libraries():
    import sys

    registry = default_registry()
    assert registry.backends("chunk_gated_delta_rule") == ["fla", "flashinfer", "reference", "torch-cpu"]
    for op in ("gdn_gating", "apply_rope", "store_paged_kv"):
        assert registry.backends(op) == ["reference", "triton"]
    for op in ("rms_norm", "gated_rms_norm", "add_rms_norm", "silu_and_mul", "linear"):
        assert registry.backends(op) == ["reference", "triton", "triton-pdl"]
    assert "common.ops.gdn.flashinfer" not in sys.modules  # nothing resolved, nothing imported


def test_unknown_op_lists_known_ops():
    with pytest.raises(ValueError, match="known ops: .*sparse_moe"):
        default_registry().get("flash_mla", "reference")


def test_factories_are_lazy_and_registries_independent():
    calls = []

    def factory():
        calls.append(1)
        return len

    registry = OpRegistry()
    registry.register("count", "reference", factory)
    assert calls == []
    assert registry.get("count") is len and registry.get("count") is len
    assert calls == [1]
    with pytest.raises(ValueError, match="already"):
        registry.register("count", "reference", factory)
    registry.register("count", "reference", lambda: max, replace=True)
    assert registry.get("count") is max
    with pytest.raises(ValueError, match="unknown op"):
        default_registry().get("count")


def test_pdl_backends_are_the_triton_ops_with_pdl_on():
    import functools

    fn = default_registry().get("linear", "triton-pdl")
    assert isinstance(fn, functools.partial) and fn.keywords == {"pdl": True}


def test_a_backend_whose_library_cannot_load_fails_when_chosen(monkeypatch):
    """A backend module that imports its library lazily says so through ``require()``: the
    registry calls it on resolving, so the library's absence is an error at selection (which
    ``select_kernels`` turns into advice), not at the first forward."""
    import sys
    import types

    from common.model.kernels import select_kernels

    def require():
        raise ImportError("No module named 'fastlib'")

    lazy = types.ModuleType("lazy_backend")
    lazy.require, lazy.paged_attention = require, lambda **kw: None
    monkeypatch.setitem(sys.modules, "lazy_backend", lazy)
    monkeypatch.setitem(sys.modules, "flashinfer", None)  # as on a machine without it
    registry = default_registry()
    registry.register("paged_attention", "lazy", _import_factory("lazy_backend", "paged_attention"))
    with pytest.raises(ImportError, match="fastlib"):
        registry.get("paged_attention", "lazy")
    with pytest.raises(ImportError):
        registry.get("paged_attention", "flashinfer")
    with pytest.raises(ValueError, match="needs its GPU libraries.*flashinfer"):
        select_kernels("gpu")
    lazy.require = lambda: None
    assert registry.get("paged_attention", "lazy") is lazy.paged_attention
