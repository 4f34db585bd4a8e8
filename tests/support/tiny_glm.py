"""Tiny GLM-5.3 (and, for contrast, Qwen3-Next) config.json files for real VllmConfigs.

Shapes are cut down except what recovery cares about: KDA head dim 128, conv width 4,
bounded gate -5, 3 KDA layers + 1 attention layer, one MTP layer. No weights: configs
are built, never loaded.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

LINEAR_HEADS = 4
HEAD_DIM = 128
CONV_WIDTH = 4
NUM_LAYERS = 4


def write_tiny_glm53(directory: Path, **text_overrides: Any) -> Path:
    """Write ``config.json`` of a tiny GLM-5.3 (``Glm5NextForConditionalGeneration``)."""
    text: dict[str, Any] = dict(
        model_type="glm5_next_text", vocab_size=512, hidden_size=256, intermediate_size=256,
        moe_intermediate_size=64, num_hidden_layers=NUM_LAYERS, num_attention_heads=4,
        num_key_value_heads=4, n_shared_experts=1, n_routed_experts=4,
        num_experts_per_tok=2, n_group=1, topk_group=1, kv_lora_rank=64, q_lora_rank=64,
        qk_rope_head_dim=0, v_head_dim=64, qk_nope_head_dim=64, head_dim=64,
        index_topk=64, index_head_dim=64, index_n_heads=2,
        layer_types=["linear_attention"] * 3 + ["indexed_attention"],
        mlp_layer_types=["dense"] + ["sparse"] * 3, indexer_types=["full"] * NUM_LAYERS,
        linear_head_dim=HEAD_DIM, linear_num_heads=LINEAR_HEADS,
        linear_conv_kernel_dim=CONV_WIDTH, linear_lower_bound=-5.0,
        num_nextn_predict_layers=1, max_position_embeddings=2048, pad_token_id=0,
        dtype="bfloat16",
    )
    text.update(text_overrides)
    vision = dict(model_type="glm5_next_vision", depth=1, hidden_size=64, num_heads=2,
                  intermediate_size=64, out_hidden_size=256, projection_intermediate_size=64)
    config = dict(model_type="glm5_next", architectures=["Glm5NextForConditionalGeneration"],
                  text_config=text, vision_config=vision, dtype="bfloat16",
                  tie_word_embeddings=False)
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(config, indent=1))
    return directory


def write_tiny_qwen3_next(directory: Path) -> Path:
    """Write ``config.json`` of a tiny Qwen3-Next (GDN hybrid with MTP): not GLM-5.3."""
    config = dict(
        model_type="qwen3_next", architectures=["Qwen3NextForCausalLM"], vocab_size=1024,
        hidden_size=256, intermediate_size=256, num_hidden_layers=4,
        layer_types=["linear_attention"] * 3 + ["full_attention"], num_attention_heads=4,
        num_key_value_heads=2, head_dim=64, linear_num_key_heads=2, linear_num_value_heads=4,
        linear_key_head_dim=64, linear_value_head_dim=64, linear_conv_kernel_dim=4,
        num_experts=4, num_experts_per_tok=2, moe_intermediate_size=128,
        shared_expert_intermediate_size=128, num_nextn_predict_layers=1,
        max_position_embeddings=2048, dtype="bfloat16",
    )
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(config, indent=1))
    return directory
