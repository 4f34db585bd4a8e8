"""The layout identity of a vLLM deployment's checkpoint bundles, per tensor-parallel rank.

A bundle holds raw bytes of vLLM's own pages; they mean something only for the exact
deployment that wrote them. The identity is a pure function of the engine configuration
and the KV-cache layout vLLM resolved, so the scheduler (which never reads bundles) and
every worker compute the same identity for each rank: the scheduler needs it to find a
restarted disk store's bundles, the workers to key their own.

It covers the model (path or name, a digest of its HF config, of the weights' revision and
load format), the dtypes of every tensor kind, the page layout (a digest of every KV-cache
group's spec and layer names, vLLM's minor version), the rank and size of tensor
parallelism, the number of speculative tokens and the mode (recovery or full state).
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

import torch

from ....checkpoint import LayoutIdentity
from ....config.state_mode import StateMode
from ... import compat

LAYOUT = "vllm-kv-pages"
LAYOUT_VERSION = 1


def _digest(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()[:32]


def _dtype_name(dtype: object) -> str:
    if isinstance(dtype, torch.dtype):
        return str(dtype).removeprefix("torch.")
    return str(dtype)


def _groups_digest(kv_cache_config: Any) -> str:
    # vLLM's specs are frozen dataclasses: their repr names every field that decides the
    # page layout (shapes, dtypes, block and page sizes, speculative blocks).
    parts = [
        f"{list(g.layer_names)!r}|{g.kv_cache_spec!r}" for g in kv_cache_config.kv_cache_groups
    ]
    return _digest("\n".join(parts) + f"\nlayout={kv_cache_config.kv_cache_layout}")


def _weights_digest(vllm_config: Any) -> str:
    mc, lc = vllm_config.model_config, vllm_config.load_config
    hf = mc.hf_config.to_json_string(use_diff=False) if hasattr(mc.hf_config, "to_json_string") \
        else repr(mc.hf_config)
    loader = json.dumps(lc.model_loader_extra_config or {}, sort_keys=True, default=str)
    return _digest(f"{hf}|{lc.load_format}|{loader}|{mc.quantization}")


def _kda_dtypes(kv_cache_config: Any) -> dict[str, str]:
    out: dict[str, str] = {}
    for group in kv_cache_config.kv_cache_groups:
        for spec in compat.group_specs(group.kv_cache_spec):
            if compat.is_mamba_spec(spec):
                out.setdefault("conv", _dtype_name(spec.dtypes[0]))
                out.setdefault("state", _dtype_name(spec.dtypes[1]))
            elif compat.is_attention_spec(spec):
                out.setdefault("kv", _dtype_name(spec.dtype))
    return out


def layout_identity(vllm_config: Any, kv_cache_config: Any, tp_rank: int, tp_size: int,
                    recovery: bool) -> LayoutIdentity:
    """The identity of rank ``tp_rank``'s bundles for this deployment."""
    mc = vllm_config.model_config
    major, minor = compat.parse_version(compat.vllm_version())
    dtypes = {"activation": _dtype_name(mc.dtype), "logits": "float32",
              **_kda_dtypes(kv_cache_config)}
    return LayoutIdentity(
        model=str(mc.model)[-256:],
        revision=str(mc.revision or "unset")[:256],
        dtypes=dtypes,
        layout=LAYOUT,
        layout_version=LAYOUT_VERSION,
        tp_rank=tp_rank,
        tp_size=tp_size,
        num_speculative_tokens=int(vllm_config.num_speculative_tokens or 0),
        mode=StateMode.of(recovery).value,
        extra={
            "vllm": f"{major}.{minor}",
            "kv_groups": _groups_digest(kv_cache_config),
            "weights": _weights_digest(vllm_config),
            "vocab": int(mc.get_vocab_size()),
        },
    )
