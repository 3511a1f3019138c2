"""Pool tensors that a second process on the same host can open.

The owner (say, the prefill worker) allocates its pool tensors through ``SharedTensors``; each
shareable one comes with a ``ShareHandle``, a small frozen record that serializes to bytes and
so travels in a gRPC message. The peer (the decode worker) opens handles through its
``PeerMemory``, which maps each one once and releases them all at shutdown.

- CPU: a POSIX shared-memory segment with a random name (``/dev/shm/psm_*`` on Linux), made by
  ``multiprocessing.shared_memory.SharedMemory`` and unlinked when the owner closes. The peer
  maps it without registering it with Python's resource_tracker (which would otherwise unlink
  the owner's segment when the peer exits).
- CUDA: torch's CUDA IPC. ``storage._share_cuda_()`` on the owner exports the allocation's IPC
  handle, records an interprocess event on the current stream and puts the storage behind a
  reference counter in a shared file; ``UntypedStorage._new_shared_cuda`` on the peer waits on
  that event, maps the allocation and, when its last view dies, decrements the counter. The
  owner's allocation is freed only when its own tensor is gone and the counter is 0 (torch's
  "limbo", torch/multiprocessing/cuda_multiprocessing.md). Each handle carries one count, so a
  CUDA handle is for one peer process: ``SharedTensors.share`` makes another.

Both kinds share the memory, not a snapshot: ordering the owner's writes before the peer's
reads (a CUDA event, an acknowledgement over gRPC) is the transport's job. The event in a CUDA
handle only orders what the owner queued before the handle was made.

Lifetimes: ``close`` on either side never leaves a tensor pointing at unmapped memory. A
mapping stays until the last tensor viewing it is gone; on the owner the segment's name is
removed at ``close`` all the same, so nothing is left in /dev/shm once every process unmaps.
"""

from __future__ import annotations

import math
import mmap
import os
import socket
import threading
import weakref
from collections.abc import Sequence
from dataclasses import dataclass
from multiprocessing import shared_memory

import msgpack
import numpy as np
import torch

try:
    # The C module behind SharedMemory. Mapping through it directly (on every Python version;
    # 3.13 added SharedMemory(track=False)) skips the resource_tracker registration and gives
    # this module the mapping's lifetime, which SharedMemory.close would end under live views.
    import _posixshmem
except ImportError:  # not a POSIX system: no shareable CPU memory
    _posixshmem = None

_FORMAT_VERSION = 1
_KINDS = ("cpu", "cuda")


class PeerMemoryError(RuntimeError):
    """A handle cannot be opened here (another host, segment gone, GPU not visible, CUDA IPC
    refused): the caller falls back to sending bytes."""


def host_id() -> str:
    """This machine's identity: the kernel's boot id (the same in every container on the host,
    whose /dev/shm may still differ: opening can fail all the same), else the host name."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f.read().strip()
    except OSError:
        return socket.gethostname()


@dataclass(frozen=True)
class CudaIpcHandle:
    """What ``storage._share_cuda_()`` returns, by name (see the module docstring)."""

    device: int                 # the owner's device index (its numbering)
    device_uuid: str            # the GPU itself, whatever CUDA_VISIBLE_DEVICES each side has
    memory: bytes               # IPC handle of the CUDA allocation that holds the storage
    storage_nbytes: int
    storage_offset_bytes: int   # where the storage starts inside that allocation
    ref_counter: bytes          # name of the owner's shared file of reference counters
    ref_counter_offset: int
    event: bytes                # IPC handle of the event recorded when the handle was made
    event_sync_required: bool


@dataclass(frozen=True)
class ShareHandle:
    """How a peer opens one contiguous tensor of the owner's: its kind (``"cpu"``, ``"cuda"``),
    the owner's host and pid, dtype name, shape and size; ``name`` of the shared-memory segment
    (CPU) or ``cuda`` (the IPC handle). ``to_bytes`` / ``from_bytes`` give its wire form."""

    kind: str
    host: str
    owner_pid: int
    dtype: str
    shape: tuple[int, ...]
    nbytes: int
    name: str = ""
    cuda: CudaIpcHandle | None = None

    def __post_init__(self) -> None:
        if self.kind == "cpu" and (not self.name or self.cuda is not None):
            raise ValueError("a cpu handle has a segment name and no cuda part")
        if self.kind == "cuda" and (self.name or self.cuda is None):
            raise ValueError("a cuda handle has a cuda part and no segment name")
        if self.kind not in _KINDS:
            raise ValueError(f"kind must be one of {_KINDS}, got {self.kind!r}")
        dtype = _dtype(self.dtype)
        if any(not isinstance(d, int) or d < 0 for d in self.shape):
            raise ValueError(f"shape must be non-negative ints, got {self.shape}")
        if self.nbytes != math.prod(self.shape) * dtype.itemsize or self.nbytes < 1:
            raise ValueError(f"nbytes {self.nbytes} != {self.dtype} x {self.shape}, or empty")

    def to_bytes(self) -> bytes:
        """msgpack of the fields (bytes stay bytes), versioned."""
        record = {"v": _FORMAT_VERSION, "kind": self.kind, "host": self.host,
                  "owner_pid": self.owner_pid, "dtype": self.dtype, "shape": list(self.shape),
                  "nbytes": self.nbytes, "name": self.name}
        if self.cuda is not None:
            record["cuda"] = {k: getattr(self.cuda, k)
                              for k in CudaIpcHandle.__dataclass_fields__}
        return msgpack.packb(record, use_bin_type=True)

    @classmethod
    def from_bytes(cls, data: bytes) -> ShareHandle:
        """The handle ``to_bytes`` wrote; ValueError if ``data`` is not one."""
        try:
            record = msgpack.unpackb(data, raw=False)
            if not isinstance(record, dict) or record.get("v") != _FORMAT_VERSION:
                raise ValueError(f"not a version-{_FORMAT_VERSION} share handle")
            cuda = record.get("cuda")
            return cls(kind=record["kind"], host=record["host"], owner_pid=record["owner_pid"],
                       dtype=record["dtype"], shape=tuple(record["shape"]),
                       nbytes=record["nbytes"], name=record["name"],
                       cuda=None if cuda is None else CudaIpcHandle(**cuda))
        except (ValueError, KeyError, TypeError, msgpack.UnpackException) as err:
            raise ValueError(f"malformed share handle: {err}") from err


def _dtype(name: str) -> torch.dtype:
    dtype = getattr(torch, name, None) if isinstance(name, str) else None
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"not a torch dtype name: {name!r}")
    return dtype


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _map_segment(name: str) -> mmap.mmap:
    """Map an existing segment read-write, unregistered with the resource_tracker."""
    if _posixshmem is None:
        raise PeerMemoryError("POSIX shared memory is not available on this system")
    try:
        fd = _posixshmem.shm_open("/" + name, os.O_RDWR, mode=0o600)
    except OSError as err:
        raise PeerMemoryError(f"cannot open shared memory {name!r}: {err}") from err
    try:
        return mmap.mmap(fd, os.fstat(fd).st_size)  # the mapping outlives the descriptor
    finally:
        os.close(fd)


def _tensor_over(mapping: mmap.mmap, nbytes: int, dtype: torch.dtype,
                 shape: tuple[int, ...]) -> torch.Tensor:
    if len(mapping) < nbytes:
        raise PeerMemoryError(f"segment has {len(mapping)} bytes, the handle says {nbytes}")
    # The ndarray holds a buffer export on the mapping and torch.frombuffer keeps the ndarray:
    # mapping.close() then raises BufferError while any view lives. torch.frombuffer(mapping)
    # alone holds no export, so a close would leave its tensors on unmapped memory.
    array = np.frombuffer(mapping, dtype=np.uint8, count=nbytes)
    return torch.frombuffer(array, dtype=torch.uint8).view(dtype).view(shape)


def _close_mapping(mapping: mmap.mmap) -> None:
    try:
        mapping.close()
    except BufferError:
        pass  # tensors still view it: it is unmapped when the last of them is freed


def _device_uuid(index: int) -> str:
    return str(torch.cuda.get_device_properties(index).uuid)


def _share_cuda(tensor: torch.Tensor) -> CudaIpcHandle:
    (device, memory, storage_nbytes, storage_offset_bytes, ref_counter, ref_counter_offset,
     event, event_sync_required) = tensor.untyped_storage()._share_cuda_()
    return CudaIpcHandle(device=device, device_uuid=_device_uuid(device), memory=memory,
                         storage_nbytes=storage_nbytes,
                         storage_offset_bytes=storage_offset_bytes, ref_counter=ref_counter,
                         ref_counter_offset=ref_counter_offset, event=event,
                         event_sync_required=bool(event_sync_required))


class SharedTensors:
    """The owner's shareable pool tensors: makes them, hands out their handles, and at
    ``close`` unlinks its shared-memory segments. Thread-safe."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._segments: dict[str, tuple[shared_memory.SharedMemory, mmap.mmap]] = {}
        # data_ptr -> (the tensor, weakly: a pointer may be reused; its first handle)
        self._handles: dict[int, tuple[weakref.ref, ShareHandle]] = {}
        self._closed = False

    def allocate(self, shape: Sequence[int], dtype: torch.dtype, device: str | torch.device,
                 shareable: bool) -> tuple[torch.Tensor, ShareHandle | None]:
        """A zero-filled contiguous tensor and, when ``shareable``, the handle a peer process
        on this host opens it with (None otherwise: a plain ``torch.zeros``). ``device``: cpu
        or cuda[:i]. ValueError for another device or an empty shareable tensor."""
        shape = tuple(int(d) for d in shape)
        device = torch.device(device)
        if not shareable:
            return torch.zeros(shape, dtype=dtype, device=device), None
        if device.type not in _KINDS:
            raise ValueError(f"only cpu and cuda memory can be shared, got {device}")
        nbytes = math.prod(shape) * dtype.itemsize
        if nbytes < 1:
            raise ValueError(f"nothing to share in an empty tensor of shape {shape}")
        with self._lock:
            if self._closed:
                raise RuntimeError("SharedTensors is closed")
            if device.type == "cpu":
                tensor, name = self._new_segment(nbytes, dtype, shape)
                handle = ShareHandle("cpu", host_id(), os.getpid(), _dtype_name(dtype), shape,
                                     nbytes, name=name)
            else:
                tensor = torch.zeros(shape, dtype=dtype, device=device)
                # made on the current stream after the fill: the peer's open waits for it
                handle = ShareHandle("cuda", host_id(), os.getpid(), _dtype_name(dtype), shape,
                                     nbytes, cuda=_share_cuda(tensor))
            self._handles[tensor.data_ptr()] = (weakref.ref(tensor), handle)
        return tensor, handle

    def share(self, tensor: torch.Tensor) -> ShareHandle:
        """A handle for ``tensor`` (one that ``allocate`` returned) for one more peer process:
        the same one for CPU memory, a new IPC handle with its own reference count for CUDA.
        ValueError if ``tensor`` is not a whole shareable allocation of this owner."""
        with self._lock:
            if self._closed:
                raise RuntimeError("SharedTensors is closed")
            ref, first = self._handles.get(tensor.data_ptr(), (None, None))
            if ref is None or ref() is not tensor:
                raise ValueError("not a shareable tensor allocated by this SharedTensors "
                                 "(pass the whole tensor allocate returned, not a view)")
            if first.kind == "cpu":
                return first
            return ShareHandle("cuda", first.host, first.owner_pid, first.dtype, first.shape,
                               first.nbytes, cuda=_share_cuda(tensor))

    def close(self) -> None:
        """Unlink every segment (peers that mapped one keep it until they unmap) and unmap
        those no tensor views any more. Idempotent. CUDA memory is freed by torch once the
        tensors are gone here and every peer has released its handle."""
        with self._lock:
            self._closed = True
            segments, self._segments = self._segments, {}
            self._handles.clear()
        for shm, mapping in segments.values():
            shm.unlink()
            _close_mapping(mapping)

    def __enter__(self) -> SharedTensors:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _new_segment(self, nbytes: int, dtype: torch.dtype, shape: tuple[int, ...]
                     ) -> tuple[torch.Tensor, str]:
        # SharedMemory picks a free random name, creates the segment exclusively and registers
        # it with the resource_tracker, which unlinks it if this process dies before close.
        shm = shared_memory.SharedMemory(create=True, size=nbytes)
        try:
            mapping = _map_segment(shm.name)
        except BaseException:
            shm.close()
            shm.unlink()
            raise
        shm.close()  # SharedMemory's own mapping: never viewed, so it closes at once
        self._segments[shm.name] = (shm, mapping)
        return _tensor_over(mapping, nbytes, dtype, shape), shm.name


class PeerMemory:
    """A process's view of its peers' shared tensors: ``open_handle`` maps each handle once and
    returns the same tensor after that; ``close_handle`` forgets one (a peer that went away),
    ``close`` all of them (at shutdown). Thread-safe."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._open: dict[tuple, tuple[torch.Tensor, mmap.mmap | None]] = {}
        self._counters: set[tuple[bytes, int]] = set()  # CUDA ref counts already held

    def __len__(self) -> int:
        with self._lock:
            return len(self._open)

    def open_handle(self, handle: ShareHandle) -> torch.Tensor:
        """The owner's tensor behind ``handle``, shared (writes are seen by both sides).
        ``PeerMemoryError`` when it cannot be opened here."""
        if handle.host != host_id():
            raise PeerMemoryError(f"handle is from host {handle.host}, this is {host_id()}")
        key = _key(handle)
        with self._lock:
            cached = self._open.get(key)
            if cached is not None:
                if handle.cuda is not None:
                    self._drop_extra_count(handle.cuda)
                return cached[0]
            if handle.kind == "cpu":
                mapping = _map_segment(handle.name)
                try:
                    tensor = _tensor_over(mapping, handle.nbytes, _dtype(handle.dtype),
                                          handle.shape)
                except BaseException:
                    _close_mapping(mapping)
                    raise
            else:
                counter = (handle.cuda.ref_counter, handle.cuda.ref_counter_offset)
                if counter in self._counters:
                    # its one count went to a mapping closed since: opening again would give
                    # the count back twice
                    raise PeerMemoryError("this CUDA handle was opened and closed here before; "
                                          "ask the owner for a new one (SharedTensors.share)")
                tensor, mapping = _open_cuda(handle), None
                self._counters.add(counter)
            self._open[key] = (tensor, mapping)
            return tensor

    def close_handle(self, handle: ShareHandle) -> None:
        """Forget ``handle``'s tensor (a no-op if it is not open); its memory is released when
        the caller's views of it are gone too."""
        with self._lock:
            entry = self._open.pop(_key(handle), None)
        if entry is not None and entry[1] is not None:
            _close_mapping(entry[1])

    def close(self) -> None:
        """Forget every opened tensor (see ``close_handle``). Idempotent."""
        with self._lock:
            entries, self._open = list(self._open.values()), {}
        for _, mapping in entries:
            if mapping is not None:
                _close_mapping(mapping)

    def __enter__(self) -> PeerMemory:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _drop_extra_count(self, ipc: CudaIpcHandle) -> None:
        # The memory is mapped already; a second handle for it (a new count from share()) must
        # give its count back, or the owner could never free the allocation.
        counter = (ipc.ref_counter, ipc.ref_counter_offset)
        if counter not in self._counters:
            torch.UntypedStorage._release_ipc_counter(*counter, device=ipc.device)
            self._counters.add(counter)


def _key(handle: ShareHandle) -> tuple:
    if handle.kind == "cpu":
        return ("cpu", handle.name)
    return ("cuda", handle.cuda.memory, handle.cuda.storage_offset_bytes)


def _open_cuda(handle: ShareHandle) -> torch.Tensor:
    ipc = handle.cuda
    if not torch.cuda.is_available():
        raise PeerMemoryError("a CUDA handle needs CUDA in this process")
    local = [i for i in range(torch.cuda.device_count()) if _device_uuid(i) == ipc.device_uuid]
    if not local:
        raise PeerMemoryError(f"GPU {ipc.device_uuid} is not visible in this process")
    device = local[0]
    try:
        with torch.cuda.device(device):  # the event is waited on this device's current stream
            storage = torch.UntypedStorage._new_shared_cuda(
                device, ipc.memory, ipc.storage_nbytes, ipc.storage_offset_bytes,
                ipc.ref_counter, ipc.ref_counter_offset, ipc.event, ipc.event_sync_required)
    except RuntimeError as err:
        raise PeerMemoryError(f"CUDA IPC refused the handle: {err}") from err
    dtype = _dtype(handle.dtype)
    tensor = torch.empty(0, dtype=dtype, device=f"cuda:{device}")
    stride = torch.empty(handle.shape, device="meta").stride()
    return tensor.set_(storage, 0, handle.shape, stride)
