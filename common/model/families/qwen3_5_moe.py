"""Qwen3.5 mixture of experts: ``qwen3_5_moe_text``, or the vision-language wrapper
``qwen3_5_moe`` whose text config sits under ``text_config`` (only the text model is served).

| checkpoint tensor                                    | our parameter                          |
| ---------------------------------------------------- | -------------------------------------- |
| `model.visual.*`, `visual.*`, `mtp.*`, `model.mtp.*` | skipped (vision tower, MTP draft head) |
| `model.language_model.X` (wrapper)                   | `model.X`, then the rules below        |
| `…mlp.experts.{e}.gate_proj.weight` [I, H]           | `…mlp.experts.gate_up_proj[e, :I]`     |
| `…mlp.experts.{e}.up_proj.weight` [I, H]             | `…mlp.experts.gate_up_proj[e, I:]`     |
| `…mlp.experts.{e}.down_proj.weight` [H, I]           | `…mlp.experts.down_proj[e]`            |
| anything else (incl. packed experts [E, 2I, H])      | the parameter of the same name         |
"""

from __future__ import annotations

from common.model.families.family import ModelFamily
from common.model.families.qwen3_5 import VISION_LANGUAGE_RENAMED, VISION_LANGUAGE_SKIPPED

MODEL_TYPE = "qwen3_5_moe_text"

FAMILY = ModelFamily(
    text_model_type=MODEL_TYPE,
    wrapper_model_type="qwen3_5_moe",
    model_module="common.model.families.qwen3_5_moe_model",
    # transformers' Qwen3_5MoeTextConfig defaults
    defaults=dict(
        vocab_size=248320, hidden_size=2048, num_hidden_layers=40, num_attention_heads=16,
        num_key_value_heads=2, head_dim=256, rope_theta=10000000.0, partial_rotary_factor=0.25,
        linear_conv_kernel_dim=4, linear_key_head_dim=128, linear_value_head_dim=128,
        linear_num_key_heads=16, linear_num_value_heads=32, moe_intermediate_size=512,
        shared_expert_intermediate_size=512, num_experts_per_tok=8, num_experts=256,
        rms_norm_eps=1e-6, full_attention_interval=4, tie_word_embeddings=False,
    ),
    # Qwen3.5-MoE dropped these fields: every layer is sparse and the top-k weights are always
    # renormalised, whatever an older config still says
    fixed=dict(norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=()),
    skipped_prefixes=VISION_LANGUAGE_SKIPPED,
    renamed_prefixes=VISION_LANGUAGE_RENAMED,
)
