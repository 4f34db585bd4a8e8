"""A tiny GLM-5.3 that vLLM's CPU engine can serve (every layer KDA, dense MLPs), and a
tiny DFlash draft model for it.

GLM-5.3's attention layers (MLA with the sparse DSA indexer) and its MTP layer (MLA) have
no kernels on vLLM's CPU platform, and a hybrid page there cannot align to CPU MLA's
16-token blocks, so the CPU model is text-only and all-KDA. Everything recovery touches
keeps GLM-5.3's real shape: 128-dim KDA heads, the bounded gate (-5), conv width 4, the
merged q|k|v short conv and gated output norm. Weights come from ``--load-format
recoverssm_random`` (seeded), so the directory holds only ``config.json``.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

ARCHITECTURE = "Glm5NextForCausalLM"


def tiny_glm53_config(*, num_layers: int = 3, linear_heads: int = 4, vocab_size: int = 512,
                      hidden_size: int = 256) -> dict[str, Any]:
    """The ``config.json`` contents of the tiny all-KDA GLM-5.3."""
    for name, value, low in (("num_layers", num_layers, 1), ("linear_heads", linear_heads, 1),
                             ("vocab_size", vocab_size, 16), ("hidden_size", hidden_size, 16)):
        if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= 1 << 16:
            raise ValueError(f"{name}: expected an integer in {low}..65536, got {value!r}")
    layers = num_layers
    return dict(
        model_type="glm5_next_text", architectures=[ARCHITECTURE], vocab_size=vocab_size,
        hidden_size=hidden_size, intermediate_size=hidden_size, moe_intermediate_size=64,
        num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=4,
        n_shared_experts=1, n_routed_experts=4, num_experts_per_tok=2, n_group=1,
        topk_group=1, kv_lora_rank=64, q_lora_rank=64, qk_rope_head_dim=0, v_head_dim=64,
        qk_nope_head_dim=64, head_dim=64, index_topk=64, index_head_dim=64, index_n_heads=2,
        layer_types=["linear_attention"] * layers, mlp_layer_types=["dense"] * layers,
        indexer_types=["full"] * layers, linear_head_dim=128, linear_num_heads=linear_heads,
        linear_conv_kernel_dim=4, linear_lower_bound=-5.0, num_nextn_predict_layers=0,
        max_position_embeddings=4096, pad_token_id=0, dtype="bfloat16",
        tie_word_embeddings=False, mhc=False, mla_use_nope=True, scoring_func="sigmoid",
        topk_method="noaux_tc", indexer_rope_interleave=False, swiglu_limit=10.0,
    )


def write_tiny_glm53(directory: Path, **overrides: Any) -> Path:
    """Write the tiny model's ``config.json`` into ``directory`` (created) and return it."""
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(tiny_glm53_config(**overrides), indent=1))
    return directory


def tiny_dflash_config(target: dict[str, Any], *, num_layers: int = 1) -> dict[str, Any]:
    """``config.json`` of a tiny DFlash draft (vLLM's Qwen3-based ``DFlashDraftModel``) for
    the tiny GLM-5.3 ``target``: it reads the target's hidden states of every layer."""
    hidden = int(target["hidden_size"])
    return dict(
        architectures=["DFlashDraftModel"], model_type="qwen3", hidden_size=hidden,
        intermediate_size=hidden, num_hidden_layers=num_layers, num_attention_heads=4,
        num_key_value_heads=2, head_dim=hidden // 4, vocab_size=int(target["vocab_size"]),
        max_position_embeddings=int(target["max_position_embeddings"]), rms_norm_eps=1e-6,
        rope_theta=10000.0, tie_word_embeddings=False, torch_dtype="bfloat16",
        dflash_config={"target_layer_ids": list(range(int(target["num_hidden_layers"]))),
                       "mask_token_id": int(target["vocab_size"]) - 1},
    )


def write_tiny_dflash(directory: Path, target: dict[str, Any] | None = None) -> Path:
    """Write the tiny DFlash draft's ``config.json`` into ``directory`` and return it."""
    directory.mkdir(parents=True, exist_ok=True)
    config = tiny_dflash_config(tiny_glm53_config() if target is None else target)
    (directory / "config.json").write_text(json.dumps(config, indent=1))
    return directory
