"""The DFLASH draft model (z-lab format): context KV from the target's captured hidden states,
and one non-autoregressive forward per block that proposes B-1 tokens.

Flow per request (docs/speculative.md): every committed token's target hidden states (captured
at ``config.target_layer_ids``) go through :meth:`DFlashDraftModel.extend_context` once, which
writes that token's K/V of every draft layer into a :class:`DraftKVPool` at the token's KV slot
(the draft pool shares the target pool's page ids). :meth:`DFlashDraftModel.propose` then runs
the block ``[last committed token, MASK x (B-1)]`` at positions ``start .. start+B-1`` over that
context and returns logits for block rows 1..B-1. The draft has no embedding or head: both are
the target's, passed in by reference.
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from common.cache.kv_pool import KVPool
from common.model.builtin import TINY_DRAFT_CONFIG, TINY_NAME, fill_draft_deterministic
from common.model.dflash_config import DFlashConfig
from common.model.kernels import Kernels
from common.model.layers import DenseMLP, Linear, _param
from common.model.loader import WeightLoadError, _checkpoint_files, _iter_tensors
from common.model.qwen3_5 import HybridForCausalLM
from common.model.registry import resolve_draft
from common.ops.rope.reference import rope_inv_freq


class DraftKVPool:
    """Context K/V of the draft layers: ``[L_draft, num_pages, 2, page_size, kv_heads, hd]``.

    It has no allocator: a token's draft K/V lives at the same page and offset as its target KV,
    so the target pool's page ids (and their lifetime) cover both. Page 0 is scratch.
    """

    def __init__(self, *, num_layers: int, num_pages: int, page_size: int, num_kv_heads: int,
                 head_dim: int, dtype: torch.dtype, device: torch.device | str = "cpu") -> None:
        if page_size < 1 or num_pages < 2:
            raise ValueError("a draft KV pool needs page_size >= 1 and num_pages >= 2")
        self.page_size, self.num_pages = page_size, num_pages
        self.kv = torch.zeros(num_layers, num_pages, 2, page_size, num_kv_heads, head_dim,
                              dtype=dtype, device=device)

    @classmethod
    def like(cls, kv_pool: KVPool, config: DFlashConfig, *,
             dtype: torch.dtype | None = None) -> "DraftKVPool":
        """A draft pool with the pages (count and size) of the target's ``kv_pool``."""
        return cls(num_layers=config.num_hidden_layers, num_pages=kv_pool.num_pages,
                   page_size=kv_pool.page_size, num_kv_heads=config.num_key_value_heads,
                   head_dim=config.head_dim, dtype=dtype or kv_pool.kv.dtype,
                   device=kv_pool.kv.device)

    def bytes_per_token(self) -> int:
        return self.kv[:, 0, :, 0].numel() * self.kv.element_size()

    def layer_cache(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of draft layer ``layer``, each ``[num_pages, page_size, kv_heads, hd]``."""
        return self.kv[layer, :, 0], self.kv[layer, :, 1]


class PlainRMSNorm(nn.Module):
    """Qwen3's RMSNorm ``x̂ · w`` (not the zero-centred ``1 + w`` of the Qwen3.5 target)."""

    def __init__(self, dim: int, eps: float, dtype: torch.dtype) -> None:
        super().__init__()
        self.eps = eps
        self.weight = _param(dim, dtype=dtype)
        self.register_buffer("unit", torch.ones(dim, dtype=dtype), persistent=False)

    def forward(self, x: torch.Tensor, kernels: Kernels) -> torch.Tensor:
        # Qwen3RMSNorm rounds x̂ to the input dtype before the weight multiply (the rms_norm op
        # multiplies in fp32 first); normalising with a unit weight keeps its rounding in bf16
        # and is exact in fp32.
        return self.weight * kernels.rms_norm(x=x, weight=self.unit, eps=self.eps,
                                              zero_centered=False)


class BiasLinear(Linear):
    """Projection with the checkpoint's optional bias (``attention_bias``)."""

    def __init__(self, in_features: int, out_features: int, dtype: torch.dtype,
                 bias: bool) -> None:
        super().__init__(in_features, out_features, dtype)
        self.bias = _param(out_features, dtype=dtype) if bias else None

    def forward(self, x: torch.Tensor, kernels: Kernels) -> torch.Tensor:
        if self.bias is None:
            return kernels.linear(x=x, weight=self.weight)
        return F.linear(x, self.weight, self.bias)  # the bias added before the one rounding


class DraftAttention(nn.Module):
    """Qwen3 attention whose keys are the context KV (cached) plus the block's own (not cached)."""

    def __init__(self, config: DFlashConfig, layer: int, dtype: torch.dtype) -> None:
        super().__init__()
        c = config
        self.heads, self.kv_heads, self.head_dim = (
            c.num_attention_heads, c.num_key_value_heads, c.head_dim)
        self.causal, self.window = c.layer_is_causal(layer), c.layer_window(layer)
        bias = c.attention_bias
        self.q_proj = BiasLinear(c.hidden_size, self.heads * self.head_dim, dtype, bias)
        self.k_proj = BiasLinear(c.hidden_size, self.kv_heads * self.head_dim, dtype, bias)
        self.v_proj = BiasLinear(c.hidden_size, self.kv_heads * self.head_dim, dtype, bias)
        self.o_proj = BiasLinear(self.heads * self.head_dim, c.hidden_size, dtype, bias)
        self.q_norm = PlainRMSNorm(self.head_dim, c.rms_norm_eps, dtype)
        self.k_norm = PlainRMSNorm(self.head_dim, c.rms_norm_eps, dtype)

    def key_value(self, x: torch.Tensor, positions: torch.Tensor, kn: Kernels,
                  inv_freq: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """K (k_norm, RoPE at ``positions``) and V, each ``[T, kv_heads, hd]``, of ``x`` [T, H]."""
        t = x.shape[0]
        k = self.k_norm(self.k_proj(x, kn).view(t, self.kv_heads, self.head_dim), kn)
        v = self.v_proj(x, kn).view(t, self.kv_heads, self.head_dim)
        _, k = kn.apply_rope(q=k, k=k, positions=positions, inv_freq=inv_freq)
        return k, v

    def forward(self, x: torch.Tensor, positions: torch.Tensor, *, num_blocks: int,
                kv: tuple[torch.Tensor, torch.Tensor], page_table: torch.Tensor,
                context_lens: torch.Tensor, start_positions: torch.Tensor, kn: Kernels,
                inv_freq: torch.Tensor) -> torch.Tensor:
        t = x.shape[0]
        b = t // num_blocks
        q = self.q_norm(self.q_proj(x, kn).view(t, self.heads, self.head_dim), kn)
        k = self.k_norm(self.k_proj(x, kn).view(t, self.kv_heads, self.head_dim), kn)
        v = self.v_proj(x, kn).view(t, self.kv_heads, self.head_dim)
        q, k = kn.apply_rope(q=q, k=k, positions=positions, inv_freq=inv_freq)
        o = kn.draft_block_attention(
            q=q.view(num_blocks, b, self.heads, self.head_dim),
            block_k=k.view(num_blocks, b, self.kv_heads, self.head_dim),
            block_v=v.view(num_blocks, b, self.kv_heads, self.head_dim),
            k_cache=kv[0], v_cache=kv[1], page_table=page_table, context_lens=context_lens,
            start_positions=start_positions, scale=self.head_dim ** -0.5, causal=self.causal,
            sliding_window=self.window)
        return self.o_proj(o.reshape(t, self.heads * self.head_dim), kn)


class DraftDecoderLayer(nn.Module):
    def __init__(self, config: DFlashConfig, layer: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.self_attn = DraftAttention(config, layer, dtype)
        self.mlp = DenseMLP(config.hidden_size, config.intermediate_size, dtype)
        self.input_layernorm = PlainRMSNorm(config.hidden_size, config.rms_norm_eps, dtype)
        self.post_attention_layernorm = PlainRMSNorm(config.hidden_size, config.rms_norm_eps,
                                                     dtype)

    def forward(self, x: torch.Tensor, positions: torch.Tensor, kn: Kernels,
                **attn) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x, kn), positions, kn=kn, **attn)
        return x + self.mlp(self.post_attention_layernorm(x, kn), kn)


class DFlashDraftModel(nn.Module):
    """The draft layers plus ``fc`` / ``hidden_norm`` (context fusion) and the final ``norm``.

    Parameter names are the z-lab checkpoint's (``layers.{i}.self_attn.q_proj.weight``,
    ``fc.weight [H, K*H]``, ``hidden_norm.weight``, ``norm.weight``, ...).
    """

    def __init__(self, config: DFlashConfig, *, dtype: torch.dtype,
                 kernels: Kernels | None = None) -> None:
        super().__init__()
        c = config
        self.config, self.dtype = c, dtype
        self.kernels = kernels or Kernels.select()
        self.layers = nn.ModuleList(DraftDecoderLayer(c, i, dtype)
                                    for i in range(c.num_hidden_layers))
        self.fc = Linear(c.num_context_features * c.hidden_size, c.hidden_size, dtype)
        self.hidden_norm = PlainRMSNorm(c.hidden_size, c.rms_norm_eps, dtype)
        self.norm = PlainRMSNorm(c.hidden_size, c.rms_norm_eps, dtype)
        # full rotary over head_dim with the draft's own theta (text positions only)
        self.register_buffer("inv_freq", rope_inv_freq(rotary_dim=c.head_dim, theta=c.rope_theta),
                             persistent=False)

    @torch.inference_mode()
    def extend_context(self, aux_hidden: torch.Tensor, positions: torch.Tensor,
                       out_cache_loc: torch.Tensor, pool: DraftKVPool) -> None:
        """Write the draft context K/V of T newly committed tokens into ``pool``.

        Args:
            aux_hidden: [T, K*H] the target's captured hidden states of those tokens
                (``ModelOutput.aux_hidden_states`` rows, capture ids = ``target_layer_ids``).
            positions: [T] their absolute positions.
            out_cache_loc: [T] their flat KV slots (the same slots as in the target's pool).
        """
        c, kn = self.config, self.kernels
        if aux_hidden is None:
            raise ValueError("aux_hidden is None: call target.set_dflash_layers_to_capture("
                             "draft.config.target_layer_ids) before running the target")
        width = c.num_context_features * c.hidden_size
        if aux_hidden.dim() != 2 or aux_hidden.shape[1] != width:
            raise ValueError(f"aux_hidden must be [T, {width}] (K={c.num_context_features} "
                             f"captured layers x H={c.hidden_size}), got {tuple(aux_hidden.shape)}")
        t = aux_hidden.shape[0]
        if positions.shape != (t,) or out_cache_loc.shape != (t,):
            raise ValueError(f"positions and out_cache_loc must be [{t}], got "
                             f"{tuple(positions.shape)} and {tuple(out_cache_loc.shape)}")
        ctx = self.hidden_norm(self.fc(aux_hidden.to(self.dtype), kn), kn)
        for i, layer in enumerate(self.layers):
            k, v = layer.self_attn.key_value(ctx, positions, kn, self.inv_freq)
            kn.store_paged_kv(kv=pool.kv[i], loc=out_cache_loc, k=k, v=v)

    @torch.inference_mode()
    def propose(self, *, block_ids: torch.Tensor, start_positions, page_table: torch.Tensor,
                pool: DraftKVPool, embed: torch.Tensor, lm_head: torch.Tensor,
                context_lens=None) -> torch.Tensor:
        """Logits of the B-1 proposals of N blocks; greedy proposals are their argmax.

        Args:
            block_ids: [N, B] ``[last committed token, mask_token_id x (B-1)]`` per request.
            start_positions: N ints (list or tensor; a tensor on the model's device is never
                read on the host, so the call can be captured): position of block[0] = tokens whose
                draft context is known.
            page_table: [N, max_pages] the requests' pages (the target's page ids).
            pool: the draft KV pool holding the context.
            embed: [V, H] the target's input embedding weight; lm_head: [V, H] its output weight.
            context_lens: N ints, context tokens to attend to (default: start_positions).

        Returns:
            [N, B-1, V] fp32 logits for block rows 1..B-1 (the block's K/V is not kept).
        """
        c, kn = self.config, self.kernels
        if block_ids.dim() != 2 or block_ids.shape[1] < 2:
            raise ValueError(f"block_ids must be [N, B] with B >= 2, got {tuple(block_ids.shape)}")
        n, b = block_ids.shape
        device = block_ids.device
        starts = _lengths(start_positions, device)
        ctx_lens = starts if context_lens is None else _lengths(context_lens, device)
        if starts.shape != (n,) or ctx_lens.shape != (n,):
            raise ValueError(f"start_positions and context_lens need {n} entries, got "
                             f"{tuple(starts.shape)} and {tuple(ctx_lens.shape)}")
        positions = (starts[:, None] + torch.arange(b, device=device)).reshape(-1)
        x = F.embedding(block_ids.reshape(-1), embed)
        if c.input_embedding_scale != 1.0:
            x = x * c.input_embedding_scale
        x = x.to(self.dtype)
        for i, layer in enumerate(self.layers):
            x = layer(x, positions, kn, num_blocks=n, kv=pool.layer_cache(i),
                      page_table=page_table, context_lens=ctx_lens, start_positions=starts,
                      inv_freq=self.inv_freq)
        hidden = self.norm(x.view(n, b, -1)[:, 1:], kn)
        return self.compute_logits(hidden, lm_head)

    def compute_logits(self, hidden: torch.Tensor, lm_head: torch.Tensor) -> torch.Tensor:
        """Target head, then the config's optional output multiplier and softcap; fp32."""
        c = self.config
        logits = self.kernels.linear(x=hidden, weight=lm_head).float()
        if c.output_multiplier != 1.0:
            logits = logits * c.output_multiplier
        if c.final_logit_softcapping:
            cap = c.final_logit_softcapping
            logits = torch.tanh(logits / cap) * cap
        return logits


def _lengths(values, device: torch.device) -> torch.Tensor:
    """Per-request lengths as an int64 tensor on ``device`` (a tensor already there is used as
    is, without reading it on the host)."""
    if torch.is_tensor(values):
        return values.to(device=device, dtype=torch.int64)
    return torch.tensor([int(v) for v in values], dtype=torch.int64, device=device)


def load_draft_weights(model: DFlashDraftModel, checkpoint_dir: str | Path) -> None:
    """Copy a z-lab draft checkpoint into ``model``; WeightLoadError names the tensor at fault.

    Tensor names map 1:1 to parameters (a leading ``model.`` is accepted too).
    """
    c = model.config
    params = dict(model.named_parameters())
    loaded: set[str] = set()
    with torch.no_grad():
        for raw, read in _iter_tensors(_checkpoint_files(Path(checkpoint_dir))):
            name = raw[len("model."):] if raw.startswith("model.") else raw
            param = params.get(name)
            if param is None:
                raise WeightLoadError(f"unexpected checkpoint tensor {raw!r}: the draft has no "
                                      "such parameter")
            if name in loaded:
                raise WeightLoadError(f"duplicate checkpoint tensor {raw!r}")
            tensor = read()
            if name == "fc.weight" and tensor.dim() == 2 and tensor.shape[0] == c.hidden_size \
                    and tensor.shape[1] != param.shape[1]:
                raise WeightLoadError(
                    f"checkpoint tensor {raw!r} is {list(tensor.shape)}: its width "
                    f"{tensor.shape[1]} is not K*H = {c.num_context_features}*{c.hidden_size} = "
                    f"{param.shape[1]} (K = number of target_layer_ids)")
            if tuple(tensor.shape) != tuple(param.shape):
                raise WeightLoadError(f"checkpoint tensor {raw!r} has shape {list(tensor.shape)}"
                                      f", expected {list(param.shape)}")
            param.copy_(tensor.to(param.dtype))
            loaded.add(name)
    missing = sorted(set(params) - loaded)
    if missing:
        raise WeightLoadError(f"parameters not found in the draft checkpoint {checkpoint_dir}: "
                              f"{missing}")


def load_draft(name_or_path: str, target: HybridForCausalLM, *, dtype: torch.dtype | None = None,
               kernels: Kernels | None = None) -> DFlashDraftModel:
    """Build the draft for ``target``: the built-in ``"tiny"`` (pairs with the tiny target), a
    built-in trained checkpoint's draft by its name (``common/model/registry.py``), or a z-lab
    checkpoint directory. Built on the target's device, in ``dtype`` (default: the
    target's). The caller turns on the capture it needs:
    ``target.set_dflash_layers_to_capture(draft.config.target_layer_ids)``.
    """
    name_or_path = resolve_draft(name_or_path)
    if name_or_path == TINY_NAME:
        config = DFlashConfig.from_dict(dict(TINY_DRAFT_CONFIG), target=target.config)
    elif Path(name_or_path).is_dir():
        config = DFlashConfig.from_pretrained(name_or_path, target=target.config)
    else:
        raise FileNotFoundError(f"draft {name_or_path!r} is neither 'tiny' nor a directory")
    with torch.device(target.inv_freq.device):
        model = DFlashDraftModel(config, dtype=dtype or target.dtype,
                                 kernels=kernels or target.kernels)
    if name_or_path == TINY_NAME:
        fill_draft_deterministic(model.named_parameters())
    else:
        load_draft_weights(model, name_or_path)
    return model.eval()
