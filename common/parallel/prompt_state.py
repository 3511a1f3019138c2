"""One request's prompt state (its KV pages and its GDN slot) moved between the ranks of a
tensor-parallel group, so that a handoff carries the full model's state whatever the parallel
sizes of its two ends.

Why: the handoff payload (docs/protocol.md) describes the whole model (every KV head, every
conv channel, every value head's recurrent state), while a rank's pools hold only its own heads
(``common/cache/pools.py``). So a TP prefill worker gathers the ranks' shards of the request to
rank 0 and assembles the full layout there, which its sender reads as it would a TP 1 worker's
pools; a TP decode worker lands the full layout on rank 0 and scatters each rank its part. Rank
0 does all the handoff I/O, the wire format does not change, and prefill TP a pairs with decode
TP b for any a and b. The price is that every byte of the state passes through rank 0 and the
gloo group (docs/tensor_parallel.md).

Layouts are pool-like, so the code that reads and writes pools reads and writes these too:
``kv [L, pages, 2, page, kv_heads, head_dim]`` (the request's pages, in order), ``conv [L, 1,
conv_dim, W]`` and ``ssm [L, 1, HV, V, K]`` (one slot). On the wire between ranks each rank's
part is its three tensors' raw bytes, one after another, so any dtype moves.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from common.parallel.group import TensorParallelGroup
from common.parallel.shard_plan import Ranges, ShardPlan, read_ranges

# the dim each field is split along over the ranks (KV heads, conv channels, value heads)
SPLIT_DIMS = (4, 2, 2)


@dataclass(frozen=True)
class PromptState:
    """One request's state in the pool-like layouts of the module docstring: a rank's part
    of it, or (on rank 0 of a handoff) the full model's."""

    kv: torch.Tensor
    conv: torch.Tensor
    ssm: torch.Tensor

    @property
    def tensors(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return self.kv, self.conv, self.ssm

    @property
    def num_pages(self) -> int:
        return self.kv.shape[1]

    @classmethod
    def zeros_full(cls, plan: ShardPlan, kv_pool, state_pool, num_pages: int, *,
                   with_state: bool = True) -> "PromptState":
        """A zeroed full-model state of ``num_pages`` pages on the CPU, shaped like these
        (sharded) pools but with every head of ``plan``'s model (without ``with_state``, GDN
        state tensors of no slot)."""
        c = plan.config
        kv, conv, ssm = kv_pool.kv, state_pool.conv, state_pool.ssm
        slots = 1 if with_state else 0
        return cls(
            torch.zeros(kv.shape[0], num_pages, *kv.shape[2:4], c.num_key_value_heads,
                        *kv.shape[5:], dtype=kv.dtype),
            torch.zeros(conv.shape[0], slots, c.conv_dim, *conv.shape[3:], dtype=conv.dtype),
            torch.zeros(ssm.shape[0], slots, c.linear_num_value_heads, *ssm.shape[3:],
                        dtype=ssm.dtype))


def state_ranges(plan: ShardPlan) -> tuple[Ranges, Ranges, Ranges]:
    """The ranges of the full ``kv``, ``conv`` and ``ssm`` that ``plan``'s rank holds, along
    :data:`SPLIT_DIMS`: its KV heads (one replicated head when there are fewer than ranks), its
    conv channels (its key heads' q and k, its value heads' v), its value heads."""
    att, gdn = plan.attention, plan.gdn
    return (((att.groups.start, att.groups.stop),), plan.gdn_conv_ranges(),
            ((gdn.heads.start, gdn.heads.stop),))


def group_plans(plan: ShardPlan) -> list[ShardPlan]:
    """Every rank's plan of ``plan``'s group (same model, same expert placement)."""
    return [ShardPlan.for_rank(plan.config, r, plan.world_size,
                               expert_parallel=plan.is_expert_parallel)
            for r in range(plan.world_size)]


def read_from_pools(kv_pool, state_pool, page_ids, slot: int | None) -> PromptState:
    """This rank's part of a request's state, copied out of its pools to the CPU; with
    ``slot`` None its KV pages only (the GDN state tensors then hold no slot)."""
    index = torch.tensor(list(page_ids), dtype=torch.long, device=kv_pool.kv.device)
    slots = slice(0, 0) if slot is None else slice(slot, slot + 1)
    return PromptState(kv_pool.kv[:, index].cpu(),
                       state_pool.conv[:, slots].cpu().clone(),
                       state_pool.ssm[:, slots].cpu().clone())


def write_to_pools(kv_pool, state_pool, page_ids, slot: int, state: PromptState) -> None:
    """Land this rank's part of a request's state in its pools (pages ``page_ids`` in order,
    slot ``slot``)."""
    device = kv_pool.kv.device
    index = torch.tensor(list(page_ids), dtype=torch.long, device=device)
    kv_pool.kv[:, index] = state.kv.to(device)
    state_pool.conv[:, slot:slot + 1] = state.conv.to(device)
    state_pool.ssm[:, slot:slot + 1] = state.ssm.to(device)


def take_part(plan: ShardPlan, full: PromptState) -> PromptState:
    """``plan``'s rank's part of the full state."""
    return PromptState(*(read_ranges(t, dim, ranges).contiguous() for t, dim, ranges
                         in zip(full.tensors, SPLIT_DIMS, state_ranges(plan))))


def assemble(plans: list[ShardPlan], parts: list[PromptState], full: PromptState) -> PromptState:
    """Write every rank's part into ``full`` (zeros of the full shapes) and return it. A head
    that several ranks hold replicated is the same on each of them; the last rank's copy
    stays."""
    for plan, part in zip(plans, parts):
        for dst, src, dim, ranges in zip(full.tensors, part.tensors, SPLIT_DIMS,
                                         state_ranges(plan)):
            at = 0
            for start, stop in ranges:
                dst.narrow(dim, start, stop - start).copy_(src.narrow(dim, at, stop - start))
                at += stop - start
    return full


def pack(state: PromptState) -> torch.Tensor:
    """The three tensors' bytes, one after another (uint8, on the CPU)."""
    return torch.cat([t.contiguous().reshape(-1).view(torch.uint8) for t in state.tensors])


def unpack(buffer: torch.Tensor, like: PromptState) -> PromptState:
    """The inverse of :func:`pack` into tensors shaped and typed like ``like``'s."""
    out, at = [], 0
    for t in like.tensors:
        n = t.numel() * t.element_size()
        piece = buffer[at:at + n]
        if at % t.element_size():  # a view of another dtype must start on its alignment
            piece = piece.clone()
        out.append(piece.view(t.dtype).view(t.shape))
        at += n
    if at != buffer.numel():
        raise ValueError(f"a prompt state of {at} bytes, but {buffer.numel()} arrived")
    return PromptState(*out)


def gather_to_leader(tp: TensorParallelGroup, plan: ShardPlan, local: PromptState,
                     full: PromptState | None = None) -> PromptState | None:
    """Collective: every rank passes its part; rank 0 gets the full state (assembled into
    ``full``, zeros of the full shapes it passes), the others None. The parts are equal in
    size on every rank (each holds as many heads as the next)."""
    mine = pack(local)
    opts = dist.GatherOptions()
    opts.rootRank = 0
    if not tp.is_leader:
        tp.cpu_group.gather([], [mine], opts).wait()
        return None
    parts = [torch.empty_like(mine) for _ in range(tp.world_size)]
    tp.cpu_group.gather([parts], [mine], opts).wait()
    return assemble(group_plans(plan), [unpack(p, local) for p in parts], full)


def scatter_from_leader(tp: TensorParallelGroup, plan: ShardPlan, like: PromptState,
                        full: PromptState | None = None) -> PromptState:
    """Collective: rank 0 passes the full state and every rank gets its part (shaped like
    ``like``, e.g. what :func:`read_from_pools` would give it)."""
    out = torch.empty(sum(t.numel() * t.element_size() for t in like.tensors),
                      dtype=torch.uint8)
    opts = dist.ScatterOptions()
    opts.rootRank = 0
    if tp.is_leader:
        parts = [pack(take_part(p, full)) for p in group_plans(plan)]
        tp.cpu_group.scatter([out], [parts], opts).wait()
    else:
        tp.cpu_group.scatter([out], [], opts).wait()
    return unpack(out, like)


def part_like(kv_pool, state_pool, num_pages: int) -> PromptState:
    """Empty tensors of this rank's part of a ``num_pages``-page state (shapes and dtypes only:
    what a scatter fills)."""
    kv, conv, ssm = kv_pool.kv, state_pool.conv, state_pool.ssm
    return PromptState(torch.empty(kv.shape[0], num_pages, *kv.shape[2:], dtype=kv.dtype),
                       torch.empty(conv.shape[0], 1, *conv.shape[2:], dtype=conv.dtype),
                       torch.empty(ssm.shape[0], 1, *ssm.shape[2:], dtype=ssm.dtype))
