"""How many KV pages and GDN state slots a worker's memory budget holds (arithmetic only).

The rule of ``--mem-fraction F`` (as vLLM's ``gpu_memory_utilization``): a worker may use
``F x`` the total memory of its device, counting everything it holds there. What does not grow
with the pools (weights, CUDA graphs, peak activations, workspaces: ``fixed_bytes``, measured at
start-up) and an allowance for what torch does not see (the CUDA context, kernels' code:
``reserve_bytes``) come off first. The GDN state slots come next, as many as the scheduler can run
at once (``max_running_requests + 1``: nothing here keeps a state for a request that is not
running, as SGLang sizes its Mamba cache without a radix cache); every byte left is KV pages.

Workers that share a device each take their own fraction of its total (``flashsplit up`` splits
its ``--mem-fraction`` evenly between the workers of one device), so that their sum, not each one,
stays under 1. On the CPU the device is the host's physical memory.

Explicit ``--num-pages`` / ``--num-slots`` win over the budget; a budget that they overrun is
reported (``PoolSizing.over_budget_bytes``), not enforced.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

# the pools without --mem-fraction (and without --num-pages / --num-slots)
DEFAULT_NUM_PAGES = 2048
DEFAULT_NUM_SLOTS = 65

_GIB = 1 << 30
_MIB = 1 << 20


class SizingError(ValueError):
    """Pools that the flags ask for cannot be made; the message says what to change."""


def format_bytes(n: int) -> str:
    """``1.5 GiB``, ``12.0 MiB`` or ``512 B``: a size for a person to read."""
    if abs(n) >= _GIB:
        return f"{n / _GIB:.2f} GiB"
    if abs(n) >= _MIB:
        return f"{n / _MIB:.1f} MiB"
    if abs(n) >= 1024:
        return f"{n / 1024:.1f} KiB"
    return f"{n} B"


@dataclass(frozen=True)
class PoolCosts:
    """Bytes one KV page and one GDN state slot cost, each everywhere it is held.

    Attributes:
        page_bytes: one page of every full-attention layer (K and V), of the DFLASH draft's
            context when there is a draft, and of every per-page index buffer.
        slot_bytes: one slot's conv and recurrent state of every GDN layer, and its per-slot
            buffers.
        page_tensor_bytes: one page of the largest single pool tensor indexed by page (the KV
            pool, or the draft's), for a worker that copies its pools once at start-up.
        slot_tensor_bytes: the same for slots (the conv or the recurrent state).
    """

    page_bytes: int
    slot_bytes: int
    page_tensor_bytes: int = 0
    slot_tensor_bytes: int = 0

    def __post_init__(self) -> None:
        if self.page_bytes < 1 or self.slot_bytes < 1:
            raise ValueError(f"a page and a slot cost at least a byte, got {self.page_bytes}, "
                             f"{self.slot_bytes}")


@dataclass(frozen=True)
class MemoryFigures:
    """What start-up measured on a worker's device, in bytes.

    Attributes:
        device: the device, as the worker names it (``cuda:0``, ``cpu``).
        total_bytes: the device's memory (on the CPU: physical memory).
        free_bytes: free on the device now, other processes' use taken out; None when unknown.
        fixed_bytes: this worker's use that does not grow with the pools.
        reserve_bytes: set aside for what the measurement cannot see.
    """

    device: str
    total_bytes: int
    free_bytes: int | None
    fixed_bytes: int
    reserve_bytes: int = 0


@dataclass(frozen=True)
class PoolRequest:
    """What the worker's flags ask for.

    Attributes:
        mem_fraction: ``--mem-fraction`` (None: fixed sizes).
        num_pages, num_slots: explicit ``--num-pages`` / ``--num-slots`` (None: sized).
        default_slots: slots when sized, ``max_running_requests + 1`` (scratch included).
        min_pages: the fewest pages worth starting with (scratch included).
        copied_at_start: the pools are copied once after they are made (a prefill worker
            moving them into shareable memory): the largest pool tensor exists twice for a
            moment, and the budget must hold that too.
    """

    mem_fraction: float | None = None
    num_pages: int | None = None
    num_slots: int | None = None
    default_slots: int = DEFAULT_NUM_SLOTS
    min_pages: int = 2
    copied_at_start: bool = False

    def __post_init__(self) -> None:
        f = self.mem_fraction
        if f is not None and not 0.0 < f <= 1.0:
            raise SizingError(f"--mem-fraction must be in (0, 1], got {f}")
        for name in ("num_pages", "num_slots"):
            value = getattr(self, name)
            if value is not None and value < 2:
                raise SizingError(f"--{name.replace('_', '-')} must be at least 2 (entry 0 is "
                                  f"scratch), got {value}")
        if self.default_slots < 2 or self.min_pages < 2:
            raise ValueError("default_slots and min_pages must be at least 2")


@dataclass(frozen=True)
class PoolSizing:
    """The pools a worker makes, and the figures they were chosen from."""

    num_pages: int
    num_slots: int
    costs: PoolCosts
    request: PoolRequest
    figures: MemoryFigures | None = None

    @property
    def pool_bytes(self) -> int:
        return self.num_pages * self.costs.page_bytes + self.num_slots * self.costs.slot_bytes

    @property
    def copy_bytes(self) -> int:
        """The largest pool tensor, when the pools are copied at start-up (else 0)."""
        if not self.request.copied_at_start:
            return 0
        return max(self.num_pages * self.costs.page_tensor_bytes,
                   self.num_slots * self.costs.slot_tensor_bytes)

    @property
    def budget_bytes(self) -> int | None:
        if self.figures is None or self.request.mem_fraction is None:
            return None
        return int(self.request.mem_fraction * self.figures.total_bytes)

    @property
    def over_budget_bytes(self) -> int:
        """How far the worker's expected peak is above its budget (0: within it, or none)."""
        budget = self.budget_bytes
        if budget is None:
            return 0
        f = self.figures
        peak = f.fixed_bytes + f.reserve_bytes + self.pool_bytes + self.copy_bytes
        return max(0, peak - budget)

    def describe(self) -> str:
        """One line for the start-up log: what was chosen, and from what."""
        c = self.costs
        pages = (f"{self.num_pages} KV pages x {format_bytes(c.page_bytes)} = "
                 f"{format_bytes(self.num_pages * c.page_bytes)}")
        slots = (f"{self.num_slots} GDN state slots x {format_bytes(c.slot_bytes)} = "
                 f"{format_bytes(self.num_slots * c.slot_bytes)}")
        how = []
        if self.request.num_pages is not None or self.request.num_slots is not None:
            given = [f"--{n.replace('_', '-')}" for n in ("num_pages", "num_slots")
                     if getattr(self.request, n) is not None]
            how.append(f"{' and '.join(given)} given")
        line = f"pools: {pages}, {slots} (scratch included)"
        f = self.figures
        if f is None or self.budget_bytes is None:
            return line + (f"; {how[0]}" if how else "; fixed sizes (no --mem-fraction)")
        line += (f"; budget {format_bytes(self.budget_bytes)} = --mem-fraction "
                 f"{self.request.mem_fraction:g} of {format_bytes(f.total_bytes)} on {f.device}, "
                 f"less {format_bytes(f.fixed_bytes)} held besides the pools (weights, graphs, "
                 f"activations)")
        if f.reserve_bytes:
            line += f" and {format_bytes(f.reserve_bytes)} set aside"
        if self.copy_bytes:
            line += f", and {format_bytes(self.copy_bytes)} for the start-up copy of the pools"
        if f.free_bytes is not None:
            line += f"; {format_bytes(f.free_bytes)} free on the device before the pools"
        return line + (f"; {how[0]}" if how else "")


def fixed_pools(costs: PoolCosts, request: PoolRequest) -> PoolSizing:
    """Pools of the given (or default) sizes, with no budget."""
    return PoolSizing(request.num_pages or DEFAULT_NUM_PAGES,
                      request.num_slots or DEFAULT_NUM_SLOTS, costs, request)


def size_pools(costs: PoolCosts, figures: MemoryFigures, request: PoolRequest) -> PoolSizing:
    """The pools that fit ``request.mem_fraction`` of ``figures.total_bytes``.

    Raises SizingError, saying what to change, when the budget cannot hold ``min_pages`` pages
    beside the slots, or when the pools would not fit in the memory free on the device now
    (another process holds it).
    """
    if request.mem_fraction is None:
        raise ValueError("size_pools needs a mem_fraction (fixed_pools makes fixed sizes)")
    slots = request.num_slots or request.default_slots
    budget = int(request.mem_fraction * figures.total_bytes)
    room = budget - figures.fixed_bytes - figures.reserve_bytes
    if request.num_pages is not None:
        pages = request.num_pages
    else:
        pages = _pages_for_room(room, slots, costs, request.copied_at_start)
        if pages < request.min_pages:
            raise SizingError(_too_small(costs, figures, request, slots, pages, budget, room))
    sizing = PoolSizing(pages, slots, costs, request, figures)
    if figures.free_bytes is not None and sizing.pool_bytes + sizing.copy_bytes \
            > figures.free_bytes:
        raise SizingError(
            f"the pools ({format_bytes(sizing.pool_bytes)}"
            + (f", and {format_bytes(sizing.copy_bytes)} to copy them" if sizing.copy_bytes
               else "")
            + f") do not fit in the {format_bytes(figures.free_bytes)} free on "
            f"{figures.device}: other processes use it. Lower --mem-fraction (workers sharing "
            f"a device must add up to at most 1), or give --num-pages / --num-slots")
    return sizing


def _pages_for_room(room: int, slots: int, costs: PoolCosts, copied: bool) -> int:
    """The most pages with ``slots`` slots in ``room`` bytes (and the start-up copy)."""
    left = room - slots * costs.slot_bytes
    if not copied:
        return max(0, left // costs.page_bytes)
    # the copy is the larger of a page-indexed and a slot-indexed tensor: both must fit
    by_pages = left // (costs.page_bytes + costs.page_tensor_bytes)
    by_slots = (left - slots * costs.slot_tensor_bytes) // costs.page_bytes
    return max(0, min(by_pages, by_slots))


def _too_small(costs: PoolCosts, figures: MemoryFigures, request: PoolRequest, slots: int,
               pages: int, budget: int, room: int) -> str:
    need = (figures.fixed_bytes + figures.reserve_bytes + slots * costs.slot_bytes
            + request.min_pages * costs.page_bytes)
    if request.copied_at_start:
        need += max(request.min_pages * costs.page_tensor_bytes,
                    slots * costs.slot_tensor_bytes)
    fraction = math.ceil(need / figures.total_bytes * 1000) / 1000  # rounded up: enough
    advice = (f"raise --mem-fraction to at least {fraction:.3f}" if fraction <= 1.0
              else "the device is too small for this model with these settings")
    return (f"--mem-fraction {request.mem_fraction:g} gives {format_bytes(budget)} of "
            f"{format_bytes(figures.total_bytes)} on {figures.device}; the weights, graphs and "
            f"activations take {format_bytes(figures.fixed_bytes)} and "
            f"{format_bytes(figures.reserve_bytes)} is set aside, leaving "
            f"{format_bytes(max(room, 0))}; {slots} GDN state slots take "
            f"{format_bytes(slots * costs.slot_bytes)}, which leaves room for {pages} KV pages, "
            f"fewer than the {request.min_pages} one prefill chunk needs. {advice[0].upper()}"
            f"{advice[1:]}, or lower --max-running-requests (or --num-slots)")
