"""vLLM's own KV-cache layout of a GLM-5.3-Flash-shaped model, built on the CPU.

The tiny GLM-5.3 of :mod:`tests.support.tiny_glm` with GLM-5.3-Flash's kpool indexer
(``index_kpool``): 3 KDA layers, one indexed-attention layer (MLA, the DSA indexer's kpool
keys, the indexer's tail ring) and the MTP layer (the same three). vLLM's real model
classes are built on the meta device (no weights), every layer's KV-cache spec comes from
the layer itself, and vLLM's own planner groups them and allocates CPU tensors.

One stand-in: vLLM's CPU platform has no sparse-attention backend and refuses to pick one
while the MLA layers are built. :func:`sparse_backend_standin` answers that question with
a CUDA backend whose class imports and constructs without CUDA (FlashInfer's SM90 sparse
MLA). The backend decides which kernels would run, not the layer's spec: ``MLAAttention``'s
``get_kv_cache_spec`` reads the layer's head size and cache dtype only. No attention
kernel runs.
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from tests.support.tiny_glm import write_tiny_glm53

KPOOL = 4
"""GLM-5.3-Flash's checkpoints ship ``index_kpool`` 4."""
SPARSE_BACKEND = "vllm.v1.attention.backends.mla.flashinfer_mla_sparse_sm90." \
    "FlashInferMLASparseSM90Backend"
# What vLLM's model classes read that the plain tiny config leaves out.
MODEL_FIELDS: dict[str, Any] = dict(
    index_kpool=KPOOL, mhc=False, mla_use_nope=True, scoring_func="sigmoid",
    topk_method="noaux_tc", indexer_rope_interleave=False, swiglu_limit=10.0,
)


def write_glm53_flash_shaped(directory: Path) -> Path:
    """``config.json`` of the tiny GLM-5.3 with the kpool indexer and an MTP layer."""
    return write_tiny_glm53(directory, **MODEL_FIELDS)


@contextlib.contextmanager
def sparse_backend_standin() -> Iterator[None]:
    """vLLM's CPU platform picks :data:`SPARSE_BACKEND` for sparse MLA (see the module
    docstring); every other choice is its own."""
    from vllm.platforms import current_platform

    cls = type(current_platform)
    original = cls.__dict__["get_attn_backend_cls"]
    pick = original.__get__(None, cls)

    def choose(selected_backend: Any, attn_selector_config: Any,
               num_heads: int | None = None) -> str:
        if attn_selector_config.use_sparse:
            return SPARSE_BACKEND
        return str(pick(selected_backend, attn_selector_config, num_heads))

    cls.get_attn_backend_cls = staticmethod(choose)  # type: ignore[method-assign]
    try:
        yield
    finally:
        cls.get_attn_backend_cls = original  # type: ignore[method-assign]


@dataclass
class BuiltLayout:
    """The meta-device layers, their KV-cache config and CPU tensors, as a worker has them."""

    vllm_config: Any
    layers: dict[str, Any]
    """Every KV-cache layer by name: target model and MTP layer."""
    specs: dict[str, Any]
    kv_cache_config: Any
    tensors: dict[str, torch.Tensor]


def build_layout(vllm_config: Any, memory_bytes: int = 64 << 20) -> BuiltLayout:
    """Build the target and MTP models of ``vllm_config`` (meta device), collect each
    layer's spec, plan the KV cache with vLLM's planner and allocate it on the CPU; the KDA
    layers are bound to their pages."""
    from vllm.config import get_layers_from_vllm_config, set_current_vllm_config
    from vllm.model_executor.layers.attention_layer_base import AttentionLayerBase
    from vllm.model_executor.model_loader.utils import initialize_model
    from vllm.v1.attention.backends.utils import resolve_kv_cache_layout
    from vllm.v1.kv_cache_layout import KVCacheLayout
    from vllm.v1.worker.utils import allocate_kv_cache

    from tests.support.vllm_configs import kv_cache_configs

    cfg = copy.copy(vllm_config)
    compilation = copy.copy(vllm_config.compilation_config)
    compilation.static_forward_context = {}  # this build's layers only
    object.__setattr__(cfg, "compilation_config", compilation)
    with sparse_backend_standin(), set_current_vllm_config(cfg), torch.device("meta"):
        initialize_model(cfg)
        initialize_model(cfg, model_config=cfg.speculative_config.draft_model_config)
    layers = dict(get_layers_from_vllm_config(cfg, AttentionLayerBase))  # type: ignore[type-abstract]
    specs = {name: layer.get_kv_cache_spec(cfg) for name, layer in layers.items()}
    layout = resolve_kv_cache_layout(cfg, [[x.name for x in KVCacheLayout]], list(specs.values()))
    with set_current_vllm_config(cfg):
        kv_config = kv_cache_configs(cfg, [specs], [memory_bytes])[0]
    tensors = allocate_kv_cache(kv_config, torch.device("cpu"), layout)
    for name, layer in layers.items():
        if hasattr(layer, "conv_state_dim_first_view"):
            layer.bind_kv_cache(tensors[name])
    return BuiltLayout(cfg, layers, specs, kv_config, tensors)
