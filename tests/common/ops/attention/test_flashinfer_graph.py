"""common/ops/attention/flashinfer_graph.py's plans, against a stand-in for FlashInfer's decode
wrapper that does what its CUDA-graph ``plan`` does with the buffers (the real one runs in the
GPU tests of the decode and verify graphs): the page description reaches it with the rows'
lengths on the host and the page indices already on the wrapper's device, which it copies
without a stream synchronisation."""

from __future__ import annotations

import sys
from types import SimpleNamespace

import pytest
import torch

from common.ops.attention.flashinfer_graph import FlashInferGraphAttention
from common.ops.attention.planned import page_layout


class Wrapper:
    """FlashInfer's BatchDecodeWithPagedKVCacheWrapper in CUDA-graph mode, as far as plans go."""

    def __init__(self, workspace, layout, *, use_cuda_graph, use_tensor_cores,
                 paged_kv_indptr_buffer, paged_kv_indices_buffer,
                 paged_kv_last_page_len_buffer, backend) -> None:
        self.device = workspace.device
        self.indptr_buf, self.indices_buf = paged_kv_indptr_buffer, paged_kv_indices_buffer
        self.last_buf = paged_kv_last_page_len_buffer
        self.plans = []

    def plan(self, indptr, indices, last_page_len, num_qo_heads, num_kv_heads, head_dim,
             page_size, **kwargs) -> None:
        self.plans.append(SimpleNamespace(
            indptr_device=indptr.device, indices_device=indices.device,
            last_device=last_page_len.device, num_indices=len(indices), kwargs=kwargs,
            # what the wrapper plans from on the host
            indptr=indptr.tolist(), last=last_page_len.tolist()))
        self.indptr_buf.copy_(indptr)
        self.last_buf.copy_(last_page_len)
        self.indices_buf[:len(indices)].copy_(indices)


@pytest.fixture
def fake_flashinfer(monkeypatch):
    monkeypatch.setitem(sys.modules, "flashinfer",
                        SimpleNamespace(BatchDecodeWithPagedKVCacheWrapper=Wrapper))


def attention(device: str, rows: int = 3, q_len: int = 4, max_pages: int = 40):
    return FlashInferGraphAttention(
        batch_size=rows, q_len=q_len, num_qo_heads=4, num_kv_heads=2, head_dim=8,
        page_size=16, max_pages=max_pages, dtype=torch.bfloat16, scale=0.125,
        float_workspace=torch.zeros(64, dtype=torch.uint8, device=device))


def test_each_plan_gives_the_wrapper_its_rows_and_no_more(fake_flashinfer):
    plans = attention("cpu")
    first = ([[7, 3, 9], [1, 2], [5]], [40, 20, 4])
    second = ([[11], [12, 13], [14]], [5, 17, 16])  # fewer pages than the first plan
    for pages, lens in (first, second):
        plans.plan(pages, lens)
        indptr, indices, last = page_layout(pages, lens, 16)
        seen = plans.wrapper.plans[-1]
        assert seen.indptr == indptr and seen.last == last
        assert seen.num_indices == len(indices)
        assert plans.indices[:len(indices)].tolist() == indices
        assert plans.indptr.tolist() == indptr and plans.last_page_len.tolist() == last
        assert seen.kwargs["q_len_per_req"] == 4 and seen.kwargs["non_blocking"]


def test_page_indices_reach_the_wrapper_on_its_device_and_lengths_stay_on_the_host(
        fake_flashinfer):
    # on the meta device a host tensor handed over would show as "cpu"
    plans = attention("meta")
    plans.plan([[1, 2], [3], [4, 5, 6]], [17, 4, 33])
    seen = plans.wrapper.plans[-1]
    assert seen.indices_device.type == "meta" and seen.num_indices == 6
    assert seen.indptr_device.type == "cpu" and seen.last_device.type == "cpu"
    assert seen.indptr == [0, 2, 3, 6] and seen.last == [1, 4, 1]


def test_a_plan_past_its_pages_or_rows_is_refused(fake_flashinfer):
    plans = attention("cpu", max_pages=4)
    with pytest.raises(ValueError, match="exceed"):
        plans.plan([[1, 2], [3, 4], [5]], [20, 20, 4])
    with pytest.raises(ValueError, match="rows"):
        plans.plan([[1], [2]], [4, 4])
    with pytest.raises(ValueError, match="q_len"):
        plans.plan([[1], [2], [3]], [4, 4, 3])
    assert plans.wrapper.plans == []
