"""The DFLASH draft's training forward and loss: many blocks of a batch of sequences in one
differentiable pass over the parameters of a :class:`common.model.dflash.DFlashDraftModel`
(whose own ``extend_context`` / ``propose`` are inference code over a paged pool).

For sequences ``tokens`` [S, T] with the target's captured hidden states ``aux`` [S, T, K*H]
and anchor positions ``anchors`` [S, A] (each in ``1 .. T-B``):

- the context features ``hidden_norm(fc(aux))`` at positions ``0 .. T-1`` are projected into
  every draft layer's keys and values (k_norm, RoPE at the token's position), as
  ``extend_context`` does for committed tokens;
- block j of sequence s is ``[tokens[s, a], MASK x (B-1)]`` at positions ``a .. a+B-1``
  (``a = anchors[s, j]``), the block ``propose`` runs once ``a`` tokens are committed;
- a block's queries see the context keys at positions below ``a`` (the anchor token's own
  hidden state is not context yet at inference) and every key of their own block, never another
  block's; per draft layer, causal layers also drop keys past the query's position and sliding
  layers those outside the window, as at inference;
- the loss is the target head's cross-entropy on block rows ``1 .. B-1`` against
  ``tokens[s, a+k]``, row k weighted by ``exp(-(k-1)/gamma)`` (later rows matter less: a
  draft token only counts if every one before it was accepted).

With ``labels`` [S, T] (which tokens are training labels: a regenerated line's prompt is not),
anchors are drawn from the positions whose next token is a label, and rows whose token is not
one weigh nothing.

The recipe (anchors, mask, decay) is SpecForge's DFLASH training objective
(/work/shared/reference/dflash.md, "Training here").
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from common.model.dflash import DFlashDraftModel, PlainRMSNorm


@dataclass(frozen=True)
class BlockLoss:
    """``loss``: the weighted cross-entropy (differentiable); ``accuracy``: top-1 agreement on
    rows 1..B-1; ``accept_length``: mean 1 + leading agreeing rows per block (the accept
    length a verifier whose choices were the labels would give)."""

    loss: torch.Tensor
    accuracy: torch.Tensor
    accept_length: torch.Tensor


def sample_anchors(num_sequences: int, seq_len: int, block_size: int, num_anchors: int, *,
                   generator: torch.Generator, device: torch.device | str = "cpu",
                   labels: torch.Tensor | None = None) -> torch.Tensor:
    """[S, A] distinct sorted anchors per sequence, uniform over ``1 .. seq_len - block_size``
    (A = ``num_anchors`` or every position when there are fewer).

    With ``labels`` ([S, seq_len] bool), positions whose next token is a label come first: a
    sequence with fewer of them than A also gets others, which ``block_loss`` weighs 0.
    """
    span = seq_len - block_size
    if span < 1:
        raise ValueError(f"sequences of {seq_len} tokens leave no room for a block of "
                         f"{block_size} after a context token: use seq_len > block_size")
    count = min(num_anchors, span)
    scores = torch.rand(num_sequences, span, generator=generator)
    if labels is not None:
        # anchor a (1..span) predicts token a+1 first; scores lie in [0, 1), so 1 sorts last
        scores = torch.where(labels[:, 2:span + 2].cpu(), scores, 1.0)
    order = scores.argsort(dim=1)
    return (order[:, :count] + 1).sort(dim=1).values.to(device)


def block_mask(anchors: torch.Tensor, seq_len: int, block_size: int, *, causal: bool,
               window: int | None) -> torch.Tensor:
    """Keys each block query may see: bool ``[S, 1, A*B, T + A*B]`` (keys: context, then the
    blocks in anchor order)."""
    s, a = anchors.shape
    b, device = block_size, anchors.device
    offsets = torch.arange(b, device=device)
    q_pos = (anchors[:, :, None] + offsets).reshape(s, a * b)
    q_block = torch.arange(a, device=device).repeat_interleave(b)
    ctx_pos = torch.arange(seq_len, device=device)
    sees_ctx = ctx_pos[None, None, :] < anchors.repeat_interleave(b, dim=1)[:, :, None]
    sees_block = (q_block[:, None] == q_block[None, :]).expand(s, a * b, a * b)
    visible = torch.cat([sees_ctx, sees_block], dim=-1)
    k_pos = torch.cat([ctx_pos.expand(s, seq_len), q_pos], dim=-1)
    ahead = q_pos[:, :, None] - k_pos[:, None, :]  # query position minus key position
    if causal:
        visible &= ahead >= 0
    if window is not None:
        visible &= ahead < window
        if not causal:
            visible &= -ahead < window
    return visible[:, None]


def _norm(norm: PlainRMSNorm, x: torch.Tensor) -> torch.Tensor:
    """Qwen3's RMSNorm, rounded as the inference path rounds it (x̂ in x's dtype, then · w)."""
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + norm.eps)
    return norm.weight * h.to(x.dtype)


def _proj(linear, x: torch.Tensor) -> torch.Tensor:
    return F.linear(x, linear.weight, getattr(linear, "bias", None))


def _rope_tables(positions: torch.Tensor, inv_freq: torch.Tensor
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    freqs = positions.float()[..., None] * inv_freq.float()
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos()[:, :, None], emb.sin()[:, :, None]  # broadcast over heads


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos.to(x.dtype) + rotated * sin.to(x.dtype)


def block_hidden(draft: DFlashDraftModel, aux: torch.Tensor, tokens: torch.Tensor,
                 anchors: torch.Tensor, embed: torch.Tensor) -> torch.Tensor:
    """The draft's final-norm output for every block: ``[S, A, B, H]``."""
    c = draft.config
    s, t = tokens.shape
    a, b = anchors.shape[1], c.block_size
    if aux.shape[:2] != (s, t) or aux.shape[2] != c.num_context_features * c.hidden_size:
        raise ValueError(f"aux must be [{s}, {t}, {c.num_context_features * c.hidden_size}] "
                         f"for tokens {tuple(tokens.shape)}, got {tuple(aux.shape)}")
    device = tokens.device
    ids = torch.full((s, a, b), c.mask_token_id, dtype=torch.long, device=device)
    ids[:, :, 0] = tokens.gather(1, anchors)
    x = F.embedding(ids.view(s, a * b), embed)
    if c.input_embedding_scale != 1.0:
        x = x * c.input_embedding_scale
    x = x.to(draft.dtype)
    ctx = _norm(draft.hidden_norm, F.linear(aux.to(draft.dtype), draft.fc.weight))
    q_pos = (anchors[:, :, None] + torch.arange(b, device=device)).view(s, a * b)
    k_pos = torch.cat([torch.arange(t, device=device).expand(s, t), q_pos], dim=1)
    cos_q, sin_q = _rope_tables(q_pos, draft.inv_freq)
    cos_k, sin_k = _rope_tables(k_pos, draft.inv_freq)
    masks: dict[tuple, torch.Tensor] = {}
    heads, kv_heads, hd = c.num_attention_heads, c.num_key_value_heads, c.head_dim
    for i, layer in enumerate(draft.layers):
        attn = layer.self_attn
        rule = (c.layer_is_causal(i), c.layer_window(i))
        if rule not in masks:
            masks[rule] = block_mask(anchors, t, b, causal=rule[0], window=rule[1])
        h = _norm(layer.input_layernorm, x)
        both = torch.cat([ctx, h], dim=1)  # keys and values: context, then blocks
        q = _rotate(_norm(attn.q_norm, _proj(attn.q_proj, h).view(s, a * b, heads, hd)),
                    cos_q, sin_q)
        k = _rotate(_norm(attn.k_norm, _proj(attn.k_proj, both).view(s, t + a * b, kv_heads,
                                                                      hd)), cos_k, sin_k)
        v = _proj(attn.v_proj, both).view(s, t + a * b, kv_heads, hd)
        group = heads // kv_heads
        o = F.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2).repeat_interleave(group, dim=1),
            v.transpose(1, 2).repeat_interleave(group, dim=1), attn_mask=masks[rule],
            scale=hd ** -0.5)
        x = x + _proj(attn.o_proj, o.transpose(1, 2).reshape(s, a * b, heads * hd))
        m = _norm(layer.post_attention_layernorm, x)
        mlp = layer.mlp
        x = x + F.linear(F.silu(F.linear(m, mlp.gate_proj.weight))
                         * F.linear(m, mlp.up_proj.weight), mlp.down_proj.weight)
    return _norm(draft.norm, x).view(s, a, b, -1)


def block_logits(draft: DFlashDraftModel, hidden: torch.Tensor,
                 lm_head: torch.Tensor) -> torch.Tensor:
    """fp32 logits of draft hidden states through the target head, with the config's output
    multiplier and softcap (as ``DFlashDraftModel.compute_logits``)."""
    c = draft.config
    logits = F.linear(hidden, lm_head).float()
    if c.output_multiplier != 1.0:
        logits = logits * c.output_multiplier
    if c.final_logit_softcapping:
        logits = torch.tanh(logits / c.final_logit_softcapping) * c.final_logit_softcapping
    return logits


def row_weights(block_size: int, loss_decay_gamma: float | None,
                device: torch.device | str = "cpu") -> torch.Tensor:
    """[B-1] loss weights of block rows 1..B-1: ``exp(-(k-1)/gamma)``, or 1 without gamma."""
    if not loss_decay_gamma:
        return torch.ones(block_size - 1, device=device)
    return torch.exp(-torch.arange(block_size - 1, device=device).float() / loss_decay_gamma)


def accept_runs(correct: torch.Tensor) -> torch.Tensor:
    """``correct`` [..., B-1] bool (row k right and on a label) -> accept lengths [...]:
    1 + the leading run of True."""
    return 1 + correct.long().cumprod(-1).sum(-1)


def block_loss(draft: DFlashDraftModel, aux: torch.Tensor, tokens: torch.Tensor,
               anchors: torch.Tensor, *, embed: torch.Tensor, lm_head: torch.Tensor,
               loss_decay_gamma: float | None, labels: torch.Tensor | None = None) -> BlockLoss:
    """The training objective of one batch (see the module docstring)."""
    b = draft.config.block_size
    s, a = anchors.shape
    hidden = block_hidden(draft, aux, tokens, anchors, embed)[:, :, 1:]
    logits = block_logits(draft, hidden, lm_head)  # [S, A, B-1, V]
    rows = torch.arange(1, b, device=tokens.device)
    at = (anchors[:, :, None] + rows).view(s, -1)
    targets = tokens.gather(1, at).view(s, a, b - 1)
    ce = F.cross_entropy(logits.flatten(0, 2), targets.flatten(), reduction="none")
    weights = row_weights(b, loss_decay_gamma, tokens.device)
    correct = logits.argmax(-1) == targets
    counted = torch.ones_like(correct) if labels is None \
        else labels.to(tokens.device).gather(1, at).view(s, a, b - 1)
    w = weights * counted
    # an anchor none of whose rows count (fewer label positions than anchors) adds nothing
    loss = (ce.view(s, a, b - 1) * w).sum() / w.sum().clamp_min(1e-6)
    with torch.no_grad():
        blocks = counted[:, :, 0]
        accuracy = (correct & counted).sum() / counted.sum().clamp_min(1)
        run = accept_runs(correct & counted).float() - 1  # the accepted draft rows
        accept = 1.0 + (run * blocks).sum() / blocks.sum().clamp_min(1)
    return BlockLoss(loss=loss, accuracy=accuracy, accept_length=accept)
