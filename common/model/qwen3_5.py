"""The hybrid decoder (GDN + gated full attention) and the causal-LM wrapper around it.

``HybridModel`` (the body) owns the embedding, the layers and the final norm; the wrapper
``HybridForCausalLM`` owns ``lm_head`` and the logits. Each model family subclasses the wrapper
(``common/model/families/``: ``Qwen3_5ForCausalLM``, ``Qwen3_5MoeForCausalLM``,
``Qwen3NextForCausalLM``). Every hook the runtime needs is on the wrapper and delegates to the
body, so code that holds a wrapper never reaches inside it.

A model built with a :class:`~common.parallel.group.TensorParallelGroup` of N ranks holds its
rank's shard (``shard_plan``, docs/tensor_parallel.md); its logits are the full vocabulary's on
every rank. Built without one it is the whole model, computed as before.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from common.cache.kv_pool import KVPool
from common.cache.state_pool import GDNStatePool
from common.config import FULL_ATTENTION, ModelConfig
from common.model.forward_batch import ForwardBatch, ForwardMode
from common.model.kernels import MODEL_OPS, Kernels
from common.ops.graph_capabilities import GraphSupport
from common.ops.rope.reference import rope_inv_freq
from common.model.layers import (DenseMLP, ForwardContext, GatedAttention, GatedDeltaNet,
                                 RMSNorm, SparseMoE, _param)
from common.parallel.group import TensorParallelGroup
from common.parallel.shard_plan import ShardPlan
from common.parallel.vocab_embedding import VocabParallelEmbedding


@dataclass
class ModelOutput:
    """Logits ``[M, V]`` (fp32) at the batch's ``logits_positions`` (all T tokens for VERIFY);
    when DFLASH capture is on, ``aux_hidden_states`` ``[T, len(layers) * H]``: the captured
    layers' outputs for every new token, concatenated in the order the layers were given."""

    logits: torch.Tensor
    aux_hidden_states: torch.Tensor | None = None


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer_id: int, dtype: torch.dtype, *,
                 plan: ShardPlan, tp: TensorParallelGroup) -> None:
        super().__init__()
        self.is_full_attention = config.layer_types[layer_id] == FULL_ATTENTION
        if self.is_full_attention:
            self.self_attn = GatedAttention(config, layer_id, dtype, plan=plan, tp=tp)
        else:
            self.linear_attn = GatedDeltaNet(config, layer_id, dtype, plan=plan, tp=tp)
        if config.is_moe_layer(layer_id):
            self.mlp = SparseMoE(config, dtype, plan=plan, tp=tp)
        else:
            self.mlp = DenseMLP(config.hidden_size, len(plan.mlp), dtype, tp=tp)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None,
                ctx: ForwardContext) -> tuple[torch.Tensor, torch.Tensor]:
        """The layer's update and the residual stream, kept apart so that each residual add
        is fused with the norm after it: ``residual + x`` is this layer's input (``x`` alone
        for the first layer, ``residual`` None), and the layer's output is ``out + residual``
        of what it returns."""
        kn = ctx.kernels
        if residual is None:
            h, residual = self.input_layernorm(x, kn), x
        else:
            h, residual = self.input_layernorm.add_forward(x, residual, kn)
        mixer = self.self_attn if self.is_full_attention else self.linear_attn
        h, residual = self.post_attention_layernorm.add_forward(mixer(h, ctx), residual, kn)
        return self.mlp(h, kn), residual


class HybridModel(nn.Module):
    """The body: embedding, decoder layers, final norm."""

    def __init__(self, config: ModelConfig, dtype: torch.dtype, *, plan: ShardPlan,
                 tp: TensorParallelGroup) -> None:
        super().__init__()
        self.config = config
        self.embed_tokens = VocabParallelEmbedding(plan.vocab, config.hidden_size, dtype, tp)
        self.layers = nn.ModuleList(DecoderLayer(config, i, dtype, plan=plan, tp=tp)
                                    for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype)
        self.capture_layer_ids: tuple[int, ...] = ()
        self._stacked_key: tuple | None = None  # see _stacked_gdn_params
        self._stacked: tuple[torch.Tensor, ...] = ()

    def set_dflash_layers_to_capture(self, layer_ids) -> None:
        if layer_ids is None:
            raise ValueError("set_dflash_layers_to_capture needs a list of target layer ids, "
                             "got None")
        ids = tuple(int(i) for i in layer_ids)
        bad = [i for i in ids if not 0 <= i < len(self.layers)]
        if bad:
            raise ValueError(f"layer ids {bad} are outside 0..{len(self.layers) - 1}")
        self.capture_layer_ids = ids

    def forward(self, ctx: ForwardContext) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Returns the last layer's output ``[T, H]`` (before the final norm, which
        ``compute_logits`` applies to the selected rows) and the captured layer outputs."""
        x, residual = self.embed_tokens(ctx.batch.input_ids), None
        captured = {}
        wanted = set(self.capture_layer_ids)
        for i, layer in enumerate(self.layers):
            x, residual = layer(x, residual, ctx)
            if i in wanted:
                captured[i] = x + residual
            if ctx.after_layer is not None:
                ctx.after_layer(i)
        x = x + residual
        aux = (torch.cat([captured[i] for i in self.capture_layer_ids], dim=-1)
               if self.capture_layer_ids else None)
        return x, aux

    def commit_verified(self, batch: ForwardBatch, accepted_lens: list[int] | torch.Tensor, *,
                        state_pool: GDNStatePool, kernels: Kernels) -> None:
        """Replay every GDN layer's accepted verify inputs into the slots, all layers in one
        ``gdn_commit_in_place`` call (see the wrapper)."""
        buffers = state_pool.verify
        if buffers is None:
            raise ValueError("commit without a pending VERIFY forward (no verify buffers)")
        accepted = buffers.accepted_lengths(batch, accepted_lens)
        mixers = [layer.linear_attn for layer in self.layers if not layer.is_full_attention]
        if tuple(m.layer_id for m in mixers) != state_pool.layer_ids:
            raise ValueError(f"state pool layers {state_pool.layer_ids} are not this model's "
                             "GDN layers")
        conv_weight, A_log, dt_bias = self._stacked_gdn_params(mixers)
        kernels.gdn_commit_in_place(
            qkv=buffers.qkv, a=buffers.a, b=buffers.b, block=buffers.tokens, accepted=accepted,
            conv_pool=state_pool.conv, conv_weight=conv_weight, ssm_pool=state_pool.ssm,
            slots=batch.state_slots, A_log=A_log, dt_bias=dt_bias,
            num_k_heads=mixers[0].num_k_heads, num_v_heads=mixers[0].num_v_heads)
        buffers.finish()

    def _stacked_gdn_params(self, mixers) -> tuple[torch.Tensor, ...]:
        """The GDN layers' conv weights [L, conv_dim, W], A_log and dt_bias [L, HV], stacked
        once (the commit takes all layers at once); stacked again if a weight was replaced or
        written in place since."""
        sources = [t for m in mixers for t in (m.conv1d.weight, m.A_log, m.dt_bias)]
        key = tuple((t.data_ptr(), t._version) for t in sources)
        if self._stacked_key != key:
            self._stacked = (torch.stack([m.conv1d.weight.detach().squeeze(1) for m in mixers]),
                             torch.stack([m.A_log.detach() for m in mixers]),
                             torch.stack([m.dt_bias.detach() for m in mixers]))
            self._stacked_key = key
        return self._stacked


class HybridForCausalLM(nn.Module):
    """Wrapper: owns ``lm_head`` and turns the body's hidden states into logits.

    A family's subclass names the one ``ModelConfig.model_type`` it serves in ``model_types``.

    ``tp``: the tensor-parallel group this rank belongs to (None: world size 1); the model then
    holds ``shard_plan``'s part of every weight. ``expert_parallel``: its routed experts are
    placed whole on the ranks instead of split inside each (the reference MoE op only). Raises
    ShardingError when the group's size does not divide what it must.
    """

    model_types: tuple[str, ...] = ()

    def __init__(self, config: ModelConfig, *, dtype: torch.dtype | None = None,
                 kernels: Kernels | None = None, tp: TensorParallelGroup | None = None,
                 expert_parallel: bool = False) -> None:
        super().__init__()
        if config.model_type not in self.model_types:
            raise ValueError(f"{type(self).__name__} serves {self.model_types}, "
                             f"not {config.model_type!r}")
        dtype = dtype or getattr(torch, config.dtype)
        self.config = config
        self.dtype = dtype
        self.kernels = kernels or Kernels.select()
        self.tp = tp or TensorParallelGroup.single()
        self.shard_plan = ShardPlan.for_rank(config, self.tp.rank, self.tp.world_size,
                                             expert_parallel=expert_parallel)
        self.model = HybridModel(config, dtype, plan=self.shard_plan, tp=self.tp)
        # tied checkpoints have no head of their own: get_output_weight() returns the embedding
        if not config.tie_word_embeddings:
            self.lm_head = nn.Module()
            self.lm_head.weight = _param(len(self.shard_plan.vocab), config.hidden_size,
                                         dtype=dtype)
        self.register_buffer(
            "inv_freq", rope_inv_freq(rotary_dim=config.rotary_dim, theta=config.rope_theta),
            persistent=False)

    # hooks the runtime uses; each delegates to the body
    def set_dflash_layers_to_capture(self, layer_ids) -> None:
        """Make every forward also return the outputs of ``layer_ids`` (DFLASH context)."""
        self.model.set_dflash_layers_to_capture(layer_ids)

    @property
    def capture_layer_ids(self) -> tuple[int, ...]:
        return self.model.capture_layer_ids

    def graph_support(self) -> GraphSupport:
        """What CUDA graphs may do with this model's forwards, as the backends of the ops they
        call declare (asked again each time: a model's kernels may be swapped)."""
        cfg = self.config
        has_moe = any(cfg.is_moe_layer(i) for i in range(cfg.num_hidden_layers))
        # a model without an MoE layer never calls sparse_moe, whatever backend it holds
        return self.kernels.graph_support((op for op in MODEL_OPS
                                           if op != "sparse_moe" or has_moe),
                                          self.get_input_embeddings().weight.dtype,
                                          cfg.head_dim)

    def get_input_embeddings(self) -> nn.Embedding:
        return self.model.embed_tokens

    def get_output_weight(self) -> torch.Tensor:
        return self.model.embed_tokens.weight if self.config.tie_word_embeddings \
            else self.lm_head.weight

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Final norm and head for already-selected hidden states ``[M, H]`` -> fp32 ``[M, V]``
        (the full vocabulary: a sharded head's rows are gathered, which needs no reduction)."""
        hidden = self.model.norm(hidden, self.kernels)
        logits = self.kernels.linear(x=hidden, weight=self.get_output_weight()).float()
        return self.tp.all_gather_last_dim(logits)

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch, *, kv_pool: KVPool | None,
                state_pool: GDNStatePool | None,
                after_layer: Callable[[int], None] | None = None) -> ModelOutput:
        """``after_layer(i)``: called once layer ``i``'s work is queued (``ForwardContext``)."""
        verify = None
        if batch.mode == ForwardMode.VERIFY and state_pool is not None:
            verify = state_pool.begin_verify(batch)
        ctx = ForwardContext(batch=batch, kv_pool=kv_pool, state_pool=state_pool,
                             kernels=self.kernels, inv_freq=self.inv_freq, verify=verify,
                             after_layer=after_layer)
        hidden, aux = self.model(ctx)
        logits = self.compute_logits(hidden[batch.logits_positions])
        return ModelOutput(logits=logits, aux_hidden_states=aux)

    @torch.inference_mode()
    def commit_verified(self, batch: ForwardBatch, accepted_lens, *,
                        state_pool: GDNStatePool) -> None:
        """Make each request's GDN slot hold the state after its first ``accepted_lens[r]``
        tokens of the latest VERIFY forward (``batch`` must be that forward's batch).

        ``accepted_lens``: N ints (list or tensor), each in ``1..extend_lens[r]``; a tensor on
        the state pool's device is used without being read on the host (see
        ``VerifyBuffers.accepted_lengths``). Full-attention KV needs nothing: the tokens past the
        new length are simply never read again.
        """
        self.model.commit_verified(batch, accepted_lens, state_pool=state_pool,
                                   kernels=self.kernels)
