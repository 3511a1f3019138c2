"""The prefill worker's pools in memory a decode worker on the same host can open (the
``device`` transport): CUDA IPC on a GPU, POSIX shared memory on the CPU.

The pools are moved once, at start-up, into memory that ``SharedTensors`` owns; each decode
address then gets handles of its own (a CUDA handle carries one reference count per peer
process), made once and sent in the header of every handoff to it.
"""

from __future__ import annotations

import msgpack

from common.cache.shared_memory import SharedTensors
from common.engine.llm_engine import LLMEngine

POOL_NAMES = ("kv", "conv", "ssm", "draft_kv")


class SharedPools:
    """Owns the shareable copies of ``engine``'s pools (``close`` unlinks them)."""

    def __init__(self, engine: LLMEngine) -> None:
        self._shared = SharedTensors()
        self._handles: dict[str, bytes] = {}
        e = engine
        e.kv_pool.kv = self._move(e.kv_pool.kv)
        e.state_pool.conv = self._move(e.state_pool.conv)
        e.state_pool.ssm = self._move(e.state_pool.ssm)
        self._tensors = {"kv": e.kv_pool.kv, "conv": e.state_pool.conv,
                         "ssm": e.state_pool.ssm}
        if e.speculator is not None:
            draft = e.speculator.draft_pool
            draft.kv = self._move(draft.kv)
            self._tensors["draft_kv"] = draft.kv

    def _move(self, tensor):
        shared, _ = self._shared.allocate(tensor.shape, tensor.dtype, tensor.device, True)
        shared.copy_(tensor)
        return shared

    def handles_for(self, address: str) -> bytes:
        """msgpack ``{pool name: handle bytes}`` for the decode worker at ``address``."""
        packed = self._handles.get(address)
        if packed is None:
            packed = msgpack.packb({name: self._shared.share(t).to_bytes()
                                    for name, t in self._tensors.items()}, use_bin_type=True)
            self._handles[address] = packed
        return packed

    def close(self) -> None:
        self._shared.close()
