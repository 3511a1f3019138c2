"""What an in-process engine is built with: its pools, scheduler, device, graphs and the
speculation policy (``common/engine/llm_engine.py`` runs it)."""

from __future__ import annotations

from dataclasses import dataclass, field

from common.cache.pools import CacheConfig
from common.engine.cuda_graph import CudaGraphConfig
from common.engine.scheduler import SchedulerConfig


@dataclass(frozen=True)
class EngineConfig:
    """An engine's settings; the pool sizes in ``cache`` are used as given (a worker's
    ``--mem-fraction`` sizes them first, ``common/engine/pool_sizing.py``)."""

    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    device: str = "cpu"
    # prefill workers: after its first token a request leaves the batch but keeps its cache
    # until release(), so its state can be handed to a decode worker
    hold_after_prefill: bool = False
    cuda_graph: CudaGraphConfig = field(default_factory=CudaGraphConfig)
    # launch decode step n+1 before reading step n's tokens (docs/cuda_graphs.md); needs the
    # decode graph runner, so it has no effect where graphs are off
    overlap_schedule: bool = True
    # torch's intra-op CPU threads on the thread that steps the engine (None: leave torch's
    # setting); see ``common.engine.loop.serial_main_thread``
    cpu_threads: int | None = None
    # with a draft: a request that leaves speculation to the engine (``speculative`` None)
    # decodes without it when it arrives while this many requests are already here (running
    # or waiting), since a large batch's verify costs more than speculation gives back
    # (docs/speculative.md); None: always speculate. Requests that ask for it get it.
    speculative_disable_by_batch_size: int | None = None

    def __post_init__(self) -> None:
        n = self.speculative_disable_by_batch_size
        if n is not None and n < 1:
            raise ValueError(f"speculative_disable_by_batch_size must be at least 1, got {n}")
