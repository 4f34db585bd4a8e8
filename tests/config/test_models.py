"""Model specs: the built-ins, Hugging Face config.json loading and its errors."""

from __future__ import annotations

import json

import pydantic
import pytest

from vllm_recoverssm.config.models import (
    BUILTIN_MODELS,
    GLM_5_3,
    KIMI_LINEAR,
    QWEN3_NEXT_80B_A3B,
    AttentionSpec,
    ModelConfigError,
    ModelSpec,
    get_model_spec,
    load_hf_config,
    model_spec_from_hf_config,
)

# Trimmed public configs (only the fields the planner reads, plus a few it ignores).
GLM_CONFIG = {
    "architectures": ["Glm5NextForConditionalGeneration"],
    "model_type": "glm5_next",
    "torch_dtype": "bfloat16",
    "text_config": {
        "model_type": "glm5_next_text", "hidden_size": 4096, "num_hidden_layers": 45,
        "linear_num_heads": 64, "linear_head_dim": 128, "linear_conv_kernel_dim": 4,
        "linear_lower_bound": -5.0, "kv_lora_rank": 512, "qk_rope_head_dim": 0,
        "index_head_dim": 128, "index_kpool": 16, "index_topk": 2048,
        "num_nextn_predict_layers": 1, "max_position_embeddings": 1048576,
    },
}
KIMI_CONFIG = {
    "architectures": ["KimiLinearForCausalLM"], "model_type": "kimi_linear",
    "dtype": "bfloat16", "hidden_size": 2304, "num_hidden_layers": 27,
    "kv_lora_rank": 512, "qk_rope_head_dim": 64, "num_nextn_predict_layers": 0,
    "model_max_length": 1048576,
    "linear_attn_config": {
        "full_attn_layers": [4, 8, 12, 16, 20, 24, 27], "head_dim": 128,
        "kda_layers": [1, 2, 3, 5, 6, 7, 9, 10, 11, 13, 14, 15, 17, 18, 19, 21, 22, 23, 25,
                       26],
        "num_heads": 32, "short_conv_kernel_size": 4,
    },
}
QWEN_CONFIG = {
    "architectures": ["Qwen3NextForCausalLM"], "model_type": "qwen3_next",
    "torch_dtype": "bfloat16", "num_hidden_layers": 48, "full_attention_interval": 4,
    "linear_num_value_heads": 32, "linear_value_head_dim": 128, "linear_num_key_heads": 16,
    "linear_key_head_dim": 128, "linear_conv_kernel_dim": 4, "num_key_value_heads": 2,
    "head_dim": 256, "mtp_num_hidden_layers": 1, "max_position_embeddings": 262144,
}

DIMS = ("kind", "num_layers", "num_linear_layers", "num_attention_layers",
        "linear_num_heads", "linear_head_dim", "linear_num_k_heads", "linear_k_head_dim",
        "conv_kernel", "lower_bound", "attention", "num_mtp_layers", "max_model_len",
        "dtype", "architecture")


def dims(m):
    return {k: getattr(m, k) for k in DIMS}


def write(tmp_path, data, name="config.json"):
    p = tmp_path / name
    p.write_text(json.dumps(data) if not isinstance(data, str) else data)
    return p


def test_builtins():
    assert set(BUILTIN_MODELS) == {"glm-5.3", "kimi-linear", "qwen3-next-80b-a3b"}
    g = GLM_5_3
    assert (g.num_layers, g.num_linear_layers, g.num_attention_layers) == (45, 34, 11)
    assert (g.linear_num_heads, g.linear_head_dim, g.conv_kernel, g.lower_bound) == \
        (64, 128, 4, -5.0)
    assert g.attention is not None and g.attention.kv_lora_rank == 512
    assert g.conv_channels == 3 * 64 * 128
    assert QWEN3_NEXT_80B_A3B.conv_channels == 2 * 16 * 128 + 32 * 128
    for m in BUILTIN_MODELS.values():
        assert m.source


@pytest.mark.parametrize("name, want", [("glm-5.3", GLM_5_3), ("GLM5.3", GLM_5_3),
                                        ("kimi_linear", KIMI_LINEAR),
                                        ("qwen3-next", QWEN3_NEXT_80B_A3B)])
def test_get_model_spec(name, want):
    assert get_model_spec(name) is want


def test_unknown_model():
    with pytest.raises(ValueError, match="unknown model 'llama'.*glm-5.3"):
        get_model_spec("llama")


@pytest.mark.parametrize("data, builtin", [(GLM_CONFIG, GLM_5_3), (KIMI_CONFIG, KIMI_LINEAR),
                                           (QWEN_CONFIG, QWEN3_NEXT_80B_A3B)])
def test_public_configs_give_the_builtins(tmp_path, data, builtin):
    spec = load_hf_config(write(tmp_path, data))
    assert dims(spec) == dims(builtin)
    # a directory holding config.json works too
    assert dims(load_hf_config(tmp_path)) == dims(builtin)


def test_glm_variants():
    # GLM-5.3 causal-LM config at the top level, with the training-time dict and
    # explicit layer lists (as the released checkpoints carry them)
    data = {**GLM_CONFIG["text_config"], "architectures": ["Glm5NextForCausalLM"],
            "linear_attn_config": {"num_heads": 32, "head_dim": 128,
                                   "short_conv_kernel_size": 4, "gate_lower_bound": -5.0,
                                   "kda_layers": [0, 1, 2, 4], "full_attn_layers": [3]},
            "num_hidden_layers": 5}
    spec = model_spec_from_hf_config(data)
    assert (spec.num_linear_layers, spec.num_attention_layers, spec.linear_num_heads) == \
        (4, 1, 32)
    types = ["linear_attention", "indexed_attention", "linear_attention", "full_attention"]
    spec = model_spec_from_hf_config({"architectures": ["Glm5NextForCausalLM"],
                                      "num_hidden_layers": 4, "layer_types": types})
    assert (spec.num_linear_layers, spec.num_attention_layers) == (2, 2)
    assert spec.lower_bound == -5.0 and spec.dtype == "bfloat16"


@pytest.mark.parametrize(
    "content, match",
    [
        ("{", "not valid JSON.*line 1"),
        ("[1, 2]", "expected a JSON object"),
        ({}, "'architectures' is missing"),
        ({"architectures": "Glm5NextForCausalLM"}, "'architectures' must be a list"),
        ({"architectures": ["LlamaForCausalLM"]}, "'architectures' is 'LlamaForCausalLM'"),
        ({"architectures": ["Glm5NextForCausalLM"]}, "'num_hidden_layers' is missing"),
        ({"architectures": ["Glm5NextForCausalLM"], "num_hidden_layers": "45"},
         "'num_hidden_layers' must be an integer"),
        ({"architectures": ["Glm5NextForCausalLM"], "num_hidden_layers": 0},
         "'num_hidden_layers' must be >= 1"),
        ({"architectures": ["Glm5NextForCausalLM"], "num_hidden_layers": 4,
          "layer_types": ["linear_attention"]}, "'layer_types' has 1 entries"),
        ({"architectures": ["Glm5NextForCausalLM"], "num_hidden_layers": 4,
          "linear_num_heads": True}, "'linear_num_heads' must be an integer"),
        ({"architectures": ["Glm5NextForCausalLM"], "num_hidden_layers": 4,
          "torch_dtype": "int8"}, "'torch_dtype'"),
        ({"architectures": ["Glm5NextForCausalLM"], "num_hidden_layers": 4,
          "linear_lower_bound": "low"}, "'linear_lower_bound' must be a number"),
        ({"architectures": ["Glm5NextForCausalLM"], "num_hidden_layers": 4,
          "linear_attn_config": [1]}, "'linear_attn_config' must be an object"),
        ({**KIMI_CONFIG, "linear_attn_config": {"num_heads": 32, "head_dim": 128}},
         "'linear_attn_config.kda_layers' is missing"),
        ({**KIMI_CONFIG, "linear_attn_config": {**KIMI_CONFIG["linear_attn_config"],
                                                "kda_layers": [1, "2"]}},
         "'linear_attn_config.kda_layers' must be a list of integers"),
        ({**KIMI_CONFIG, "num_hidden_layers": 30}, "lists 20 KDA \\+ 7 full-attention"),
        ({**KIMI_CONFIG, "linear_attn_config": {**KIMI_CONFIG["linear_attn_config"],
                                                "head_dim": None}},
         "'linear_attn_config.head_dim' is missing"),
        ({k: v for k, v in KIMI_CONFIG.items() if k != "kv_lora_rank"},
         "'kv_lora_rank' is missing"),
        ({k: v for k, v in QWEN_CONFIG.items() if k != "linear_num_key_heads"},
         "'linear_num_key_heads' is missing"),
        ({**QWEN_CONFIG, "head_dim": -1}, "'head_dim' must be >= 1"),
        ({**QWEN_CONFIG, "text_config": [1]}, "'text_config' must be an object"),
    ],
)
def test_malformed_or_incomplete(tmp_path, content, match):
    p = write(tmp_path, content)
    with pytest.raises(ModelConfigError, match=match) as ei:
        load_hf_config(p)
    msg = str(ei.value)
    assert str(p) in msg and "\n" not in msg
    assert isinstance(ei.value, ValueError)


def test_missing_and_unreadable(tmp_path):
    with pytest.raises(ModelConfigError, match="no such file"):
        load_hf_config(tmp_path / "nope.json")
    with pytest.raises(ModelConfigError, match="no such file"):
        load_hf_config(tmp_path)  # a directory without config.json
    p = tmp_path / "bin.json"
    p.write_bytes(b"\xff\xfe\x00garbage")
    with pytest.raises(ModelConfigError, match="cannot read|not valid JSON"):
        load_hf_config(p)


def test_inconsistent_spec_is_a_validation_error():
    with pytest.raises(pydantic.ValidationError, match="must equal num_layers"):
        ModelSpec(name="x", architecture="A", kind="kda", num_layers=3, num_linear_layers=1,
                  num_attention_layers=1, linear_num_heads=1, linear_head_dim=8,
                  linear_num_k_heads=1, linear_k_head_dim=8, conv_kernel=4,
                  max_model_len=16)
    with pytest.raises(pydantic.ValidationError, match="attention spec"):
        ModelSpec(name="x", architecture="A", kind="kda", num_layers=2, num_linear_layers=1,
                  num_attention_layers=1, linear_num_heads=1, linear_head_dim=8,
                  linear_num_k_heads=1, linear_k_head_dim=8, conv_kernel=4,
                  max_model_len=16)
    with pytest.raises(pydantic.ValidationError, match="same key and value"):
        ModelSpec(name="x", architecture="A", kind="kda", num_layers=1, num_linear_layers=1,
                  num_attention_layers=0, linear_num_heads=2, linear_head_dim=8,
                  linear_num_k_heads=1, linear_k_head_dim=8, conv_kernel=4,
                  max_model_len=16)
    with pytest.raises(pydantic.ValidationError, match="GQA"):
        AttentionSpec(kind="gqa")
    with pytest.raises(pydantic.ValidationError, match="MLA"):
        AttentionSpec(kind="mla")


def test_attention_bytes():
    glm = GLM_5_3.attention
    assert glm is not None
    assert glm.bytes_per_token(tp=2, kv_bytes=2) == 512 * 2  # latent, same on every rank
    assert glm.indexer_bytes_per_state() == 128 + 4
    # kpool 16, S=3: span 19 -> 2 pools -> ring 32 slots of K and gate score (bf16)
    assert glm.tail_ring_bytes(3) == 32 * 2 * 128 * 2
    assert glm.tail_ring_bytes(0) == 16 * 2 * 128 * 2
    q = QWEN3_NEXT_80B_A3B.attention
    assert q is not None
    assert q.bytes_per_token(tp=1, kv_bytes=2) == 2 * 2 * 256 * 2
    assert q.bytes_per_token(tp=8, kv_bytes=2) == 2 * 1 * 256 * 2  # replicated KV head
    assert q.tail_ring_bytes(3) == 0 and q.indexer_bytes_per_state() == 0
