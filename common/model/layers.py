"""The parts of a hybrid decoder layer: token mixers (GDN, gated attention) and MLPs.

Parameters are allocated uninitialised (``torch.empty``) because the loader or the built-in
model's generator fills every one of them; random init would only cost time. All math goes
through the :class:`~common.model.kernels.Kernels` chosen when the model was built.

Under tensor parallelism each layer holds its rank's shard (sized by the model's
:class:`~common.parallel.shard_plan.ShardPlan`): the projections into heads and MLP columns are
split by output rows, the projections out of them by input columns, and the one all-reduce of a
block sums the ranks' partial outputs. At world size 1 the shard is the whole layer and the
all-reduce returns its input.
"""

from __future__ import annotations

from collections.abc import Callable

from dataclasses import dataclass

import torch
from torch import nn

from common.cache.kv_pool import KVPool
from common.cache.state_pool import GDNStatePool, VerifyBuffers
from common.config import ModelConfig
from common.model.forward_batch import ForwardBatch, ForwardMode
from common.model.kernels import Kernels
from common.parallel.group import TensorParallelGroup
from common.parallel.shard_plan import ShardPlan


def _param(*shape: int, dtype: torch.dtype) -> nn.Parameter:
    return nn.Parameter(torch.empty(*shape, dtype=dtype), requires_grad=False)


@dataclass
class ForwardContext:
    """Everything a layer reads besides its input: the batch, the pools and the kernels."""

    batch: ForwardBatch
    kv_pool: KVPool | None
    state_pool: GDNStatePool | None
    kernels: Kernels
    inv_freq: torch.Tensor
    verify: VerifyBuffers | None = None  # where a VERIFY forward records its GDN inputs
    # called with each layer's index once its work is queued (a prefill worker records a CUDA
    # event there, so its handoff reads each layer as soon as it has run)
    after_layer: Callable[[int], None] | None = None


class RMSNorm(nn.Module):
    """Zero-centred RMSNorm: ``x̂ · (1 + w)`` (every norm of the model except GDN's output norm)."""

    def __init__(self, dim: int, eps: float, dtype: torch.dtype) -> None:
        super().__init__()
        self.eps = eps
        self.weight = _param(dim, dtype=dtype)

    def forward(self, x: torch.Tensor, kernels: Kernels) -> torch.Tensor:
        return kernels.rms_norm(x=x, weight=self.weight, eps=self.eps, zero_centered=True)

    def add_forward(self, x: torch.Tensor, residual: torch.Tensor,
                    kernels: Kernels) -> tuple[torch.Tensor, torch.Tensor]:
        """``(norm(x + residual), x + residual)`` in one kernel."""
        return kernels.add_rms_norm(x=x, residual=residual, weight=self.weight, eps=self.eps,
                                    zero_centered=True)


class GatedRMSNorm(nn.Module):
    """GDN output norm: plain-weight RMSNorm, then times ``silu(z)``."""

    def __init__(self, dim: int, eps: float, dtype: torch.dtype) -> None:
        super().__init__()
        self.eps = eps
        self.weight = _param(dim, dtype=dtype)


class Conv1d(nn.Module):
    """Holds the depthwise conv weight under the checkpoint's name ``conv1d.weight`` [D, 1, W]."""

    def __init__(self, channels: int, width: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.weight = _param(channels, 1, width, dtype=dtype)


class Linear(nn.Module):
    """Bias-free projection whose weight keeps the checkpoint's ``[out, in]`` name and shape."""

    def __init__(self, in_features: int, out_features: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.weight = _param(out_features, in_features, dtype=dtype)

    def forward(self, x: torch.Tensor, kernels: Kernels) -> torch.Tensor:
        return kernels.linear(x=x, weight=self.weight)


class FusedProjection:
    """One weight tensor whose consecutive row blocks are the weights of several Linears with the
    same input, so one GEMM computes all their outputs (at batch 1, several small GEMVs cost a
    launch each and read their weights less efficiently than one).

    The Linears keep their Parameters and names (the loader and ``state_dict`` see no change):
    each weight is rebound to a view of the fused tensor, so loading into it fills the fused
    tensor. Moving the module afterwards (``.to()``) moves the weights apart; :meth:`weight`
    then fuses them again.
    """

    def __init__(self, *linears: Linear) -> None:
        self.linears = linears
        self.sizes = [lin.weight.shape[0] for lin in linears]
        self._fused = self._fuse()

    def _fuse(self) -> torch.Tensor:
        fused = torch.cat([lin.weight.data for lin in self.linears], dim=0)
        start = 0
        for lin, n in zip(self.linears, self.sizes):
            lin.weight.data = fused[start:start + n]
            start += n
        return fused

    def weight(self) -> torch.Tensor:
        if self._fused.data_ptr() != self.linears[0].weight.data_ptr():
            self._fused = self._fuse()
            if self._fused.is_cuda:
                # a PDL GEMV reads its weight before waiting for the kernel launched before it
                # (common/ops/pdl.py), which here is the concatenation: let that finish first.
                # Once per move; under graph capture this raises instead of racing each replay.
                torch.cuda.current_stream(self._fused.device).synchronize()
        return self._fused

    def __call__(self, x: torch.Tensor, kernels: Kernels) -> tuple[torch.Tensor, ...]:
        """The Linears' outputs, in order (column views of one GEMM's output)."""
        return torch.split(kernels.linear(x=x, weight=self.weight()), self.sizes, dim=-1)


class GatedDeltaNet(nn.Module):
    """Gated DeltaNet token mixer; its cache is one GDN state slot per request.

    Sharded by value heads (``plan.gdn``): a rank holds its value heads, the key heads they
    read and the conv channels of both, so the conv, the delta rule and the gated norm run on
    local heads only; ``out_proj`` gives a partial sum that one all-reduce completes."""

    def __init__(self, config: ModelConfig, layer_id: int, dtype: torch.dtype, *,
                 plan: ShardPlan, tp: TensorParallelGroup) -> None:
        super().__init__()
        c = config
        self.layer_id = layer_id
        self.tp = tp
        self.num_k_heads, self.num_v_heads = plan.gdn.num_groups, plan.gdn.num_heads
        self.head_k_dim, self.head_v_dim = c.linear_key_head_dim, c.linear_value_head_dim
        self.key_dim, self.value_dim = plan.gdn_key_dim, plan.gdn_value_dim
        conv_dim = plan.gdn_conv_dim
        self.in_proj_qkv = Linear(c.hidden_size, conv_dim, dtype)
        self.in_proj_z = Linear(c.hidden_size, self.value_dim, dtype)
        self.in_proj_b = Linear(c.hidden_size, self.num_v_heads, dtype)
        self.in_proj_a = Linear(c.hidden_size, self.num_v_heads, dtype)
        self.conv1d = Conv1d(conv_dim, c.linear_conv_kernel_dim, dtype)
        # NOTE: A_log stays fp32 whatever the model dtype: exp(A_log) in half precision can
        # overflow and the decay must be exact enough to compound over long prompts.
        self.A_log = _param(self.num_v_heads, dtype=torch.float32)
        self.dt_bias = _param(self.num_v_heads, dtype=dtype)
        self.norm = GatedRMSNorm(c.linear_value_head_dim, c.rms_norm_eps, dtype)
        self.out_proj = Linear(self.value_dim, c.hidden_size, dtype)
        self.in_proj = FusedProjection(self.in_proj_qkv, self.in_proj_z, self.in_proj_b,
                                       self.in_proj_a)

    def forward(self, x: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        kn, batch, pool = ctx.kernels, ctx.batch, ctx.state_pool
        num_tokens = x.shape[0]
        layer = pool.layer_index(self.layer_id)
        slots = batch.state_slots
        # mixed_qkv [T, conv_dim] (channels q|k|v), z [T, value_dim], b and a [T, HV]: column
        # views of one output, so their rows are strided (every kernel here accepts that)
        mixed_qkv, z, b, a = self.in_proj(x, kn)
        z = z.view(num_tokens, self.num_v_heads, self.head_v_dim)
        if batch.mode == ForwardMode.DECODE:
            o = self._decode_step(kn, mixed_qkv, a, b, conv_pool=pool.conv[layer],
                                  ssm_pool=pool.ssm[layer], slots=slots)
        elif batch.mode == ForwardMode.VERIFY:
            # the state stays as committed; these inputs let commit_verified replay a prefix
            ctx.verify.store(layer, qkv=mixed_qkv, a=a, b=b)
            o = kn.gdn_verify(mixed_qkv=mixed_qkv, a=a, b=b, cu_seqlens=batch.cu_seqlens,
                              conv_pool=pool.conv[layer], conv_weight=self.conv1d.weight.squeeze(1),
                              ssm_pool=pool.ssm[layer], slots=slots, A_log=self.A_log,
                              dt_bias=self.dt_bias, num_k_heads=self.num_k_heads,
                              num_v_heads=self.num_v_heads)
        else:
            o, new_conv, final_state = self._extend(
                kn, mixed_qkv, a, b, cu_seqlens=batch.cu_seqlens,
                conv_state=pool.conv[layer, slots], ssm_state=pool.ssm[layer, slots])
            pool.conv[layer, slots] = new_conv.to(pool.conv.dtype)
            pool.ssm[layer, slots] = final_state.to(pool.ssm.dtype)

        # [T, HV, V] as they are: z's rows are strided, and flattening it would copy it
        o = kn.gated_rms_norm(x=o.to(x.dtype), gate=z, weight=self.norm.weight,
                              eps=self.norm.eps)
        return self.tp.all_reduce(self.out_proj(o.reshape(num_tokens, self.value_dim), kn))

    def _heads(self, mixed_qkv: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """q, k [T, HK, K] and v [T, HV, V] from the conv output."""
        num_tokens = mixed_qkv.shape[0]
        q, k, v = torch.split(mixed_qkv, [self.key_dim, self.key_dim, self.value_dim], dim=-1)
        return (q.reshape(num_tokens, self.num_k_heads, self.head_k_dim),
                k.reshape(num_tokens, self.num_k_heads, self.head_k_dim),
                v.reshape(num_tokens, self.num_v_heads, self.head_v_dim))

    def _decode_step(self, kn: Kernels, mixed_qkv: torch.Tensor, a: torch.Tensor,
                     b: torch.Tensor, *, conv_pool: torch.Tensor, ssm_pool: torch.Tensor,
                     slots: torch.Tensor) -> torch.Tensor:
        """One token per request; conv window and state are read and written in the pool rows
        ``slots`` (no gather or scatter). Returns o [N, HV, V]."""
        mixed_qkv = kn.conv1d_update_in_place(x=mixed_qkv, conv_pool=conv_pool, slots=slots,
                                              weight=self.conv1d.weight.squeeze(1),
                                              activation="silu")
        q, k, v = self._heads(mixed_qkv)
        # the raw gate projections: the decode op forms g and beta itself
        return kn.gdn_decode_in_place(q=q, k=k, v=v, a=a, b=b, A_log=self.A_log,
                                      dt_bias=self.dt_bias, ssm_pool=ssm_pool, slots=slots,
                                      use_qk_l2norm=True)

    def _extend(self, kn: Kernels, mixed_qkv: torch.Tensor, a: torch.Tensor, b: torch.Tensor, *,
                cu_seqlens: torch.Tensor, conv_state: torch.Tensor, ssm_state: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Conv, gates and chunked delta rule over packed sequences from the given states.

        Args:
            mixed_qkv: [T, conv_dim] pre-conv rows. a, b: [T, HV] gate projections.
            conv_state: [N, conv_dim, W-1]. ssm_state: [N, HV, V, K] (pool layout).

        Returns:
            o [T, HV, V], the new conv state [N, conv_dim, W-1] and the new ssm state
            [N, HV, V, K] (pool layout).
        """
        mixed_qkv, new_conv = kn.causal_conv1d_prefill(
            x=mixed_qkv, weight=self.conv1d.weight.squeeze(1), cu_seqlens=cu_seqlens,
            initial_state=conv_state, activation="silu")
        q, k, v = self._heads(mixed_qkv)
        g, beta = kn.gdn_gating(A_log=self.A_log, a=a, dt_bias=self.dt_bias, b=b)
        # pool layout [HV, V, K] -> the ops' K-major [HV, K, V]
        o, final_state = kn.chunk_gated_delta_rule(q=q, k=k, v=v, g=g, beta=beta,
                                                   cu_seqlens=cu_seqlens,
                                                   initial_state=ssm_state.transpose(-1, -2),
                                                   use_qk_l2norm=True)
        return o, new_conv, final_state.transpose(-1, -2)


class GatedAttention(nn.Module):
    """Full attention with q/k norm, partial NeoX RoPE, GQA and a sigmoid output gate.

    Sharded by query heads (``plan.attention``): a rank holds its query heads and the KV heads
    they read (split, or one replicated when there are fewer KV heads than ranks), so its KV
    pool holds only those; ``o_proj`` gives a partial sum that one all-reduce completes."""

    def __init__(self, config: ModelConfig, layer_id: int, dtype: torch.dtype, *,
                 plan: ShardPlan, tp: TensorParallelGroup) -> None:
        super().__init__()
        c = config
        self.layer_id = layer_id
        self.tp = tp
        self.num_heads, self.num_kv_heads, self.head_dim = (
            plan.attention.num_heads, plan.attention.num_groups, c.head_dim)
        self.scale = c.head_dim ** -0.5
        # q_proj rows are laid out per head as [q_h | gate_h]
        self.q_proj = Linear(c.hidden_size, self.num_heads * c.head_dim * 2, dtype)
        self.k_proj = Linear(c.hidden_size, self.num_kv_heads * c.head_dim, dtype)
        self.v_proj = Linear(c.hidden_size, self.num_kv_heads * c.head_dim, dtype)
        self.o_proj = Linear(self.num_heads * c.head_dim, c.hidden_size, dtype)
        self.q_norm = RMSNorm(c.head_dim, c.rms_norm_eps, dtype)
        self.k_norm = RMSNorm(c.head_dim, c.rms_norm_eps, dtype)
        self.qkv_proj = FusedProjection(self.q_proj, self.k_proj, self.v_proj)

    def forward(self, x: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        kn, batch = ctx.kernels, ctx.batch
        num_tokens = x.shape[0]
        qg, k, v = self.qkv_proj(x, kn)
        qg = qg.view(num_tokens, self.num_heads, 2 * self.head_dim)
        q, gate = qg[..., :self.head_dim], qg[..., self.head_dim:]
        # q/k norms, RoPE and the K/V store in one op. VERIFY writes all k tokens too: KV past
        # a request's committed length is never read (queries see positions < prefix + extend
        # only) and the next forward overwrites it.
        q, _ = kn.qk_norm_rope_store(
            q=q, k=k.view(num_tokens, self.num_kv_heads, self.head_dim),
            v=v.view(num_tokens, self.num_kv_heads, self.head_dim), q_weight=self.q_norm.weight,
            k_weight=self.k_norm.weight, eps=self.q_norm.eps, positions=batch.positions,
            inv_freq=ctx.inv_freq, kv=ctx.kv_pool.layer_kv(self.layer_id),
            loc=batch.out_cache_loc)
        k_cache, v_cache = ctx.kv_pool.layer_cache(self.layer_id)
        if batch.attention is not None:
            o = batch.attention.run(q, k_cache, v_cache)
        else:
            o = kn.paged_attention(q=q, k_cache=k_cache, v_cache=v_cache,
                                   page_table=batch.page_table, prefix_lens=batch.prefix_lens,
                                   extend_lens=batch.extend_lens, scale=self.scale)
        o = kn.sigmoid_gate_mul(x=o.view(num_tokens, self.num_heads, self.head_dim), gate=gate)
        return self.tp.all_reduce(self.o_proj(o, kn))


class DenseMLP(nn.Module):
    """SwiGLU: ``down(silu(gate(x)) * up(x))``, gate and up as one GEMM.

    ``intermediate`` is this rank's columns; with ``tp`` the partial ``down`` outputs are
    summed over the group (gate and up column-parallel, down row-parallel)."""

    def __init__(self, hidden: int, intermediate: int, dtype: torch.dtype, *,
                 tp: TensorParallelGroup | None = None) -> None:
        super().__init__()
        self.tp = tp
        self.gate_proj = Linear(hidden, intermediate, dtype)
        self.up_proj = Linear(hidden, intermediate, dtype)
        self.down_proj = Linear(intermediate, hidden, dtype)
        self.gate_up_proj = FusedProjection(self.gate_proj, self.up_proj)

    def forward(self, x: torch.Tensor, kernels: Kernels) -> torch.Tensor:
        gate_up = kernels.linear(x=x, weight=self.gate_up_proj.weight())  # [T, 2I]: gate | up
        out = self.down_proj(kernels.silu_and_mul(x=gate_up), kernels)
        return out if self.tp is None else self.tp.all_reduce(out)


class PackedExperts(nn.Module):
    """Routed experts stored packed, whatever the checkpoint's storage."""

    def __init__(self, num_experts: int, hidden: int, intermediate: int,
                 dtype: torch.dtype) -> None:
        super().__init__()
        self.gate_up_proj = _param(num_experts, 2 * intermediate, hidden, dtype=dtype)
        self.down_proj = _param(num_experts, hidden, intermediate, dtype=dtype)


class SparseMoE(nn.Module):
    """Softmax top-k routed experts plus a sigmoid-gated shared expert.

    Sharded inside each expert (``plan.moe``, ``plan.shared_expert``): every rank holds every
    expert's columns of its part of the intermediate size; or, expert-parallel, whole experts
    ``plan.experts``. Either way every rank holds the whole router, so routing is the same
    computation on every rank, and the block's output (routed plus shared, each a partial sum)
    is completed by one all-reduce."""

    def __init__(self, config: ModelConfig, dtype: torch.dtype, *, plan: ShardPlan,
                 tp: TensorParallelGroup) -> None:
        super().__init__()
        c = config
        self.tp = tp
        self.top_k = c.num_experts_per_tok
        self.norm_topk_prob = c.norm_topk_prob
        self.gate = Linear(c.hidden_size, c.num_experts, dtype)
        self.experts = PackedExperts(len(plan.experts), c.hidden_size, len(plan.moe), dtype)
        # only an expert-parallel shard passes the offset, so every other call is unchanged
        self.expert_offset = ({"expert_offset": plan.experts.start}
                              if plan.is_expert_parallel else {})
        self.has_shared_expert = c.shared_expert_intermediate_size > 0
        if self.has_shared_expert:
            # no all-reduce of its own: its partial sum joins the block's one
            self.shared_expert = DenseMLP(c.hidden_size, len(plan.shared_expert), dtype)
            self.shared_expert_gate = Linear(c.hidden_size, 1, dtype)

    def forward(self, x: torch.Tensor, kernels: Kernels) -> torch.Tensor:
        shared = {}
        if self.has_shared_expert:
            s = self.shared_expert
            shared = dict(shared_gate_proj=s.gate_proj.weight, shared_up_proj=s.up_proj.weight,
                          shared_down_proj=s.down_proj.weight,
                          shared_expert_gate=self.shared_expert_gate.weight)
        return self.tp.all_reduce(kernels.sparse_moe(
            x=x, router_weight=self.gate.weight, experts_gate_up=self.experts.gate_up_proj,
            experts_down=self.experts.down_proj, top_k=self.top_k,
            norm_topk_prob=self.norm_topk_prob, **shared, **self.expert_offset))
