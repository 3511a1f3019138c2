"""Qwen3.5 dense: ``qwen3_5_text``, or the vision-language wrapper ``qwen3_5`` whose text config
sits under ``text_config`` (only the text model is served).

| checkpoint tensor                                    | our parameter                          |
| ---------------------------------------------------- | -------------------------------------- |
| `model.visual.*`, `visual.*`, `mtp.*`, `model.mtp.*` | skipped (vision tower, MTP draft head) |
| `model.language_model.X` (wrapper)                   | `model.X`                              |
| anything else                                        | the parameter of the same name         |
"""

from __future__ import annotations

from common.model.families.family import ModelFamily

MODEL_TYPE = "qwen3_5_text"
VISION_LANGUAGE_SKIPPED = ("model.visual.", "visual.", "mtp.", "model.mtp.")
VISION_LANGUAGE_RENAMED = (("model.language_model.", "model."),)

FAMILY = ModelFamily(
    text_model_type=MODEL_TYPE,
    wrapper_model_type="qwen3_5",
    model_module="common.model.families.qwen3_5_model",
    # transformers' Qwen3_5TextConfig defaults
    defaults=dict(
        vocab_size=248320, hidden_size=4096, intermediate_size=12288, num_hidden_layers=32,
        num_attention_heads=16, num_key_value_heads=4, head_dim=256, rope_theta=10000000.0,
        partial_rotary_factor=0.25, linear_conv_kernel_dim=4, linear_key_head_dim=128,
        linear_value_head_dim=128, linear_num_key_heads=16, linear_num_value_heads=32,
        rms_norm_eps=1e-6, full_attention_interval=4, tie_word_embeddings=False,
    ),
    # a dense family: expert fields a config may carry are not served
    fixed=dict(num_experts=0),
    skipped_prefixes=VISION_LANGUAGE_SKIPPED,
    renamed_prefixes=VISION_LANGUAGE_RENAMED,
)
