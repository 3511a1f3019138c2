"""Memory cost of the two ways to make a VERIFY forward's GDN state committable at any prefix.

A VERIFY of ``B`` tokens per request must leave every GDN layer able to end at any of the ``B``
positions. Two schemes (docs/speculative.md):

- snapshot-and-select: the verify kernel writes the recurrent state ``[HV, V, K]`` and the conv
  window ``[conv_dim, W-1]`` after every position; commit copies the chosen one.
- replay (implemented, ``GDNStatePool.verify`` / ``HybridForCausalLM.commit_verified``): the
  verify records each position's pre-conv ``in_proj_qkv`` row ``[conv_dim]`` and raw gate
  projections ``a``, ``b`` ``[HV]``; commit re-runs conv + delta rule over the accepted prefix
  from the untouched pre-verify state.

The functions give the extra bytes per running request on top of its committed state.
"""

from __future__ import annotations


def committed_state_bytes(*, num_gdn_layers: int, num_value_heads: int, key_head_dim: int,
                          value_head_dim: int, conv_dim: int, conv_width: int, io_bytes: int,
                          state_bytes: int, **_) -> int:
    """One GDN slot: ``L * (HV*V*K*state_bytes + conv_dim*(W-1)*io_bytes)``."""
    return num_gdn_layers * (num_value_heads * value_head_dim * key_head_dim * state_bytes
                             + conv_dim * (conv_width - 1) * io_bytes)


def snapshot_bytes_per_request(*, num_gdn_layers: int, num_value_heads: int, key_head_dim: int,
                               value_head_dim: int, conv_dim: int, conv_width: int, block: int,
                               io_bytes: int, state_bytes: int, dedup_conv: bool = False) -> int:
    """``L * B * (HV*V*K*state_bytes + conv_dim*(W-1)*io_bytes)``; with ``dedup_conv`` the B conv
    windows share one ``[conv_dim, B+W-2]`` strip per layer (SGLang's CUDA layout)."""
    ssm = num_gdn_layers * block * num_value_heads * value_head_dim * key_head_dim * state_bytes
    if dedup_conv:
        conv = num_gdn_layers * conv_dim * (block + conv_width - 2) * io_bytes
    else:
        conv = num_gdn_layers * block * conv_dim * (conv_width - 1) * io_bytes
    return ssm + conv


def replay_bytes_per_request(*, num_gdn_layers: int, num_value_heads: int, conv_dim: int,
                             block: int, io_bytes: int, **_) -> int:
    """``L * B * (conv_dim + 2*HV) * io_bytes``: pre-conv rows plus raw ``a``/``b`` per position."""
    return num_gdn_layers * block * (conv_dim + 2 * num_value_heads) * io_bytes
