"""Qwen3-Next: ``qwen3_next`` (a flat text config; no wrapper).

| checkpoint tensor                              | our parameter                            |
| ---------------------------------------------- | ---------------------------------------- |
| `mtp.*`, `model.mtp.*`                         | skipped (MTP draft head)                 |
| `…linear_attn.in_proj_qkvz.weight`             | `in_proj_qkv` + `in_proj_z`, regrouped   |
| `…linear_attn.in_proj_ba.weight`               | `in_proj_b` + `in_proj_a`, regrouped     |
| `…mlp.experts.{e}.gate_proj/up_proj/down_proj` | slices of the packed experts             |
| anything else                                  | the parameter of the same name           |
"""

from __future__ import annotations

from common.model.families.family import ModelFamily

MODEL_TYPE = "qwen3_next"

FAMILY = ModelFamily(
    text_model_type=MODEL_TYPE,
    model_module="common.model.families.qwen3_next_model",
    # transformers' Qwen3NextConfig defaults
    defaults=dict(
        vocab_size=151936, hidden_size=2048, intermediate_size=5632, num_hidden_layers=48,
        num_attention_heads=16, num_key_value_heads=2, head_dim=256, rope_theta=10000.0,
        partial_rotary_factor=0.25, linear_conv_kernel_dim=4, linear_key_head_dim=128,
        linear_value_head_dim=128, linear_num_key_heads=16, linear_num_value_heads=32,
        decoder_sparse_step=1, moe_intermediate_size=512, shared_expert_intermediate_size=512,
        num_experts_per_tok=10, num_experts=512, norm_topk_prob=True, rms_norm_eps=1e-6,
        full_attention_interval=4, tie_word_embeddings=False,
    ),
    skipped_prefixes=("mtp.", "model.mtp."),
)
