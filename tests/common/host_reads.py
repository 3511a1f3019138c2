"""A check that code reads no device value on the host and makes no data-dependent shape: what a
CUDA graph cannot replay. It runs on CPU tensors too, by watching the aten ops dispatched."""

from __future__ import annotations

from torch.utils._python_dispatch import TorchDispatchMode

# ops (or overloads, "op.overload") that read a value back to the host, or whose output shape
# depends on the data
HOST_READS = {"_local_scalar_dense", "item", "nonzero", "_unique", "_unique2", "unique_dim",
              "unique_consecutive", "masked_select", "repeat_interleave.Tensor", "bincount",
              "_assert_async"}


class HostReadWatch(TorchDispatchMode):
    """Records every dispatched op in :data:`HOST_READS` (``seen``)."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.__name__  # "op.overload"
        if name in HOST_READS or name.split(".")[0] in HOST_READS:
            self.seen.append(name)
        return func(*args, **(kwargs or {}))
