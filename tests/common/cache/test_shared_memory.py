"""Shared pool tensors: a second process opens a handle, reads what the owner wrote and writes
back what the owner sees; handles survive the wire; nothing is left in /dev/shm after close;
a peer exiting never removes the owner's segment. The CUDA IPC path runs on a GPU."""

from __future__ import annotations

import gc
import multiprocessing
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from common.cache.shared_memory import (CudaIpcHandle, PeerMemory, PeerMemoryError, ShareHandle,
                                        SharedTensors, host_id)

REPO = Path(__file__).resolve().parents[3]
SHM = Path("/dev/shm")


def _segments() -> set[str]:
    return {p.name for p in SHM.glob("psm_*")} if SHM.is_dir() else set()


def _peer_roundtrip(handle_bytes: bytes, expected_sum: float, write_value: float) -> None:
    """In the child: open, check the owner's bytes, write back, release everything."""
    handle = ShareHandle.from_bytes(handle_bytes)
    peer = PeerMemory()
    tensor = peer.open_handle(handle)
    if peer.open_handle(handle) is not tensor or len(peer) != 1:
        raise SystemExit("a second open did not return the cached tensor")
    if float(tensor.float().sum()) != expected_sum:
        raise SystemExit(f"read {float(tensor.float().sum())}, expected {expected_sum}")
    tensor[-1] = write_value
    if tensor.is_cuda:
        torch.cuda.synchronize()
    del tensor
    peer.close()
    gc.collect()


def _run_spawned(target, *args) -> int:
    proc = multiprocessing.get_context("spawn").Process(target=target, args=args)
    proc.start()
    proc.join(120)
    return proc.exitcode


@pytest.fixture
def owner():
    before = _segments()
    with SharedTensors() as shared:
        yield shared
    assert _segments() - before == set(), "segments left in /dev/shm after close"


def test_spawned_child_reads_and_writes_back(owner):
    tensor, handle = owner.allocate((4, 1000), torch.float32, "cpu", shareable=True)
    assert handle.kind == "cpu" and handle.name in _segments()
    assert tensor.shape == (4, 1000) and tensor.dtype == torch.float32 and tensor.is_contiguous()
    assert float(tensor.abs().sum()) == 0.0  # zero-filled
    tensor.copy_(torch.arange(4000, dtype=torch.float32).view(4, 1000))
    assert _run_spawned(_peer_roundtrip, handle.to_bytes(), float(tensor.sum()), -2.0) == 0
    assert torch.equal(tensor[-1], torch.full((1000,), -2.0))  # the child's write
    assert handle.name in _segments(), "the child's exit removed the owner's segment"


def test_separate_process_with_its_own_resource_tracker(owner):
    # a peer started on its own (as a service is), not a multiprocessing child: its exit must
    # not unlink the segment (it never registered it with a resource_tracker)
    tensor, handle = owner.allocate((3, 5), torch.bfloat16, "cpu", shareable=True)
    tensor.fill_(1.5)
    code = ("import sys; from tests.common.cache.test_shared_memory import _peer_roundtrip; "
            "_peer_roundtrip(bytes.fromhex(sys.argv[1]), 22.5, 7.0)")
    subprocess.run([sys.executable, "-W", "error", "-c", code, handle.to_bytes().hex()],
                   cwd=REPO, check=True, timeout=120)
    assert torch.equal(tensor[-1], torch.full((5,), 7.0, dtype=torch.bfloat16))
    assert handle.name in _segments()
    again = PeerMemory()
    assert float(again.open_handle(handle)[0, 0]) == 1.5  # still openable
    again.close()


def test_same_process_peer_shares_bytes_and_closing_is_safe():
    before = _segments()
    owner = SharedTensors()
    tensor, handle = owner.allocate((2, 8), torch.int32, "cpu", shareable=True)
    peer = PeerMemory()
    view = peer.open_handle(handle)
    assert view.data_ptr() != tensor.data_ptr()  # a second mapping of the same pages
    view[1, 3] = 42
    assert int(tensor[1, 3]) == 42
    owner.close()
    peer.close()
    # both sides closed while tensors still view the memory: the name is gone at once, the
    # pages stay mapped until the last view is freed (no dangling tensor)
    assert handle.name not in _segments()
    tensor[0, 0] = 5
    assert int(view[0, 0]) == 5
    with pytest.raises(PeerMemoryError, match="cannot open"):
        PeerMemory().open_handle(handle)
    del tensor, view
    gc.collect()
    assert _segments() - before == set()


def test_handle_wire_form_and_validation(owner):
    _, handle = owner.allocate((7,), torch.float16, "cpu", shareable=True)
    assert ShareHandle.from_bytes(handle.to_bytes()) == handle
    assert handle.host == host_id() and handle.owner_pid == os.getpid()
    assert handle.nbytes == 14 and handle.dtype == "float16"
    ipc = CudaIpcHandle(device=0, device_uuid="GPU-x", memory=b"\x01" * 64, storage_nbytes=14,
                        storage_offset_bytes=512, ref_counter=b"/torch_1_2_0",
                        ref_counter_offset=3, event=b"\x00" * 64, event_sync_required=True)
    cuda = ShareHandle("cuda", "h", 1, "float16", (7,), 14, cuda=ipc)
    assert ShareHandle.from_bytes(cuda.to_bytes()) == cuda
    for bad in (b"", b"\x93\x01\x02\x03", b"not msgpack \xc1", handle.to_bytes()[:-3]):
        with pytest.raises(ValueError, match="malformed"):
            ShareHandle.from_bytes(bad)
    with pytest.raises(ValueError, match="kind"):
        ShareHandle("tpu", "h", 1, "float16", (7,), 14, name="x")
    with pytest.raises(ValueError, match="segment name"):
        ShareHandle("cpu", "h", 1, "float16", (7,), 14)
    with pytest.raises(ValueError, match="nbytes"):
        ShareHandle("cpu", "h", 1, "float16", (7,), 13, name="x")
    with pytest.raises(ValueError, match="dtype"):
        ShareHandle("cpu", "h", 1, "float17", (7,), 14, name="x")


def test_allocate_and_share_refusals(owner):
    plain, none = owner.allocate((3,), torch.float32, "cpu", shareable=False)
    assert none is None and torch.equal(plain, torch.zeros(3))
    with pytest.raises(ValueError, match="only cpu and cuda"):
        owner.allocate((3,), torch.float32, "meta", shareable=True)
    with pytest.raises(ValueError, match="empty"):
        owner.allocate((0, 4), torch.float32, "cpu", shareable=True)
    tensor, handle = owner.allocate((4, 4), torch.float32, "cpu", shareable=True)
    assert owner.share(tensor) == handle  # CPU: one handle serves every peer
    for not_whole in (tensor[1:], tensor.view(16), plain):
        with pytest.raises(ValueError, match="not a shareable tensor"):
            owner.share(not_whole)
    other_host = ShareHandle("cpu", "another-host", 1, "float32", (4, 4), 64, name=handle.name)
    with pytest.raises(PeerMemoryError, match="host"):
        PeerMemory().open_handle(other_host)


def test_close_handle_forgets_one(owner):
    _, a = owner.allocate((4,), torch.float32, "cpu", shareable=True)
    _, b = owner.allocate((4,), torch.float32, "cpu", shareable=True)
    with PeerMemory() as peer:
        first = peer.open_handle(a)
        peer.open_handle(b)
        peer.close_handle(a)
        assert len(peer) == 1
        assert peer.open_handle(a) is not first  # mapped afresh
        peer.close_handle(a)
        peer.close_handle(a)  # a no-op the second time
        assert len(peer) == 1


def _ref_count(ipc: CudaIpcHandle) -> int:
    # The owner's counter file as torch keeps it in /dev/shm: a header (RefcountedMapAllocator's
    # own count), then CUDA_IPC_REF_COUNTER_FILE_SIZE = 10000 int64 counters.
    path = SHM / ipc.ref_counter.decode().lstrip("/")
    header = path.stat().st_size - 8 * 10_000
    with open(path, "rb") as f:
        f.seek(header + 8 * ipc.ref_counter_offset)
        return int.from_bytes(f.read(8), sys.byteorder, signed=True)


def _cuda_peer(first: bytes, second: bytes, expected_sum: float) -> None:
    """In the child: open the same storage through two handles, write back, release."""
    peer = PeerMemory()
    a = peer.open_handle(ShareHandle.from_bytes(first))
    if peer.open_handle(ShareHandle.from_bytes(second)) is not a:
        raise SystemExit("the second handle of one storage was not served from the cache")
    if float(a.float().sum()) != expected_sum:
        raise SystemExit(f"read {float(a.float().sum())}, expected {expected_sum}")
    a[-1] = -3
    torch.cuda.synchronize()
    del a
    peer.close()
    gc.collect()


@pytest.mark.gpu
def test_cuda_ipc_between_two_processes_on_one_gpu():
    owner = SharedTensors()
    tensor, handle = owner.allocate((64, 256), torch.bfloat16, "cuda", shareable=True)
    assert handle.kind == "cuda" and handle.cuda.device_uuid
    tensor.copy_(torch.ones(64, 256, dtype=torch.bfloat16))
    torch.cuda.synchronize()  # the handle's event predates the copy: order it here
    second = owner.share(tensor)
    assert second.cuda.ref_counter_offset != handle.cuda.ref_counter_offset or \
        second.cuda.ref_counter != handle.cuda.ref_counter
    assert _ref_count(handle.cuda) == 1 and _ref_count(second.cuda) == 1
    code = _run_spawned(_cuda_peer, handle.to_bytes(), second.to_bytes(), 64.0 * 256)
    assert code == 0
    assert torch.equal(tensor[-1].cpu(), torch.full((256,), -3, dtype=torch.bfloat16))
    # the child gave back both counts: the owner may free the allocation
    assert _ref_count(handle.cuda) == 0 and _ref_count(second.cuda) == 0
    owner.close()
