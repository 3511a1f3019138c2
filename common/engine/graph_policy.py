"""Whether an engine replays its decode (and DFLASH) steps through CUDA graphs, and the graph
runner it decodes with. The backends' own limits come from the model
(``HybridForCausalLM.graph_support``, declared in ``common/ops/graph_capabilities.py``); this
module adds what the engine's settings decide."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import torch

from common.engine.cuda_graph import GraphRunner

if TYPE_CHECKING:  # the engine's own module imports this one
    from common.cache.kv_pool import KVPool
    from common.cache.state_pool import GDNStatePool
    from common.engine.llm_engine import EngineConfig
    from common.model.qwen3_5 import HybridForCausalLM
    from common.parallel.followers import FollowerLink

log = logging.getLogger(__name__)


def graphs_apply(model: HybridForCausalLM, config: EngineConfig, token_cap: int | None) -> bool:
    """Whether decode (and DFLASH) steps go through graph runners; ``token_cap`` is the most
    tokens one captured forward may hold (None: no limit; 0: an op no graph can replay)."""
    graphs = config.cuda_graph
    on_gpu = torch.device(config.device).type == "cuda"
    # a prefill worker never decodes: its requests leave after their first token
    if not graphs.enabled or config.hold_after_prefill or (graphs.capture and not on_gpu):
        return False
    if model.tp.world_size > 1 and graphs.capture and not graphs.tensor_parallel:
        log.warning("CUDA graphs (and overlap scheduling) are off under tensor parallelism "
                    "unless --tp-cuda-graphs asks for them (NCCL inside graphs has not run on "
                    "several GPUs here yet); decode runs eagerly")
        return False
    support = model.graph_support()
    if graphs.capture and token_cap == 0:
        # an op reads the host at any size: no graph can replay it
        log.warning("CUDA graphs are off: %s not capturable; decode runs eagerly",
                    ", ".join(support.not_capturable))
        return False
    if graphs.capture and support.graph_attention is None:
        log.warning("CUDA graphs are off: attention (paged_attention=%s, %s, head_dim %d) has "
                    "no capturable planner; decode runs eagerly", support.attention_backend,
                    model.get_input_embeddings().weight.dtype, model.config.head_dim)
        return False
    return True


def decode_graph_runner(model: HybridForCausalLM, config: EngineConfig, kv_pool: KVPool,
                        state_pool: GDNStatePool, token_cap: int | None,
                        followers: FollowerLink | None = None) -> GraphRunner:
    """The decode graphs: one per batch size up to the running requests (or ``token_cap``);
    ``followers``: rank 0's link to the other ranks of a tensor-parallel model, which replay
    the same graphs."""
    running = config.scheduler.max_running_requests
    sizes = config.cuda_graph.batch_sizes(running if token_cap is None
                                          else min(running, token_cap))
    return GraphRunner(model, kv_pool, state_pool, batch_sizes=sizes,
                       capture=config.cuda_graph.capture, followers=followers)
