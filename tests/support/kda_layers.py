"""vLLM's GLM-5.3 KDA layer built on the CPU, with pages and prompt-row metadata."""

from __future__ import annotations

import itertools
from typing import Any

import torch

from .vllm_configs import on_gpu, with_recovery_mode

_names = itertools.count()


def make_layer(cfg: Any, *, recovery: bool) -> Any:
    """vLLM's ``Glm5NextLinearAttention``, instantiated the way vLLM's model does."""
    from vllm.config import set_current_vllm_config
    from vllm.models.glm5next.common.kda import Glm5NextLinearAttention

    import vllm_recoverssm.vllm_plugin.models.glm5next.model  # noqa: F401  (swaps the layer)

    text = cfg.model_config.hf_text_config
    prefix = f"model.layers.{next(_names)}.linear_attn"
    if not recovery:
        cfg = with_recovery_mode(cfg, "off")
    with set_current_vllm_config(cfg), (on_gpu() if recovery else _Null()):
        layer = Glm5NextLinearAttention(text, cfg, prefix=prefix)
    gen = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for p in layer.parameters():
            p.copy_((torch.randn(p.shape, generator=gen) * 0.3).to(p.dtype))
    return layer


class _Null:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None


def bind_pages(layer: Any, cfg: Any, blocks: int) -> Any:
    """Bind ``blocks`` pages of random conv and state to ``layer``; returns its spec."""
    spec = layer.get_kv_cache_spec(cfg)
    raw = torch.zeros(blocks, 1, 1, spec.page_size_bytes, dtype=torch.int8)
    layer.bind_kv_cache(raw)
    gen = torch.Generator().manual_seed(5)
    conv, state = layer.kv_cache[0], layer.kv_cache[1]
    conv.copy_(torch.randn(conv.shape, generator=gen).to(conv.dtype))
    state.copy_(torch.randn(state.shape, generator=gen) * 0.1)
    return spec


def prompt_meta(qsl: list[int], slots: list[int], has_state: list[bool]) -> Any:
    """vLLM's GDN metadata for a step of prompt rows only (``qsl``: query start offsets)."""
    from vllm.v1.attention.backends.gdn_attn import GDNAttentionMetadata

    t = qsl[-1]
    return GDNAttentionMetadata(
        num_prefills=len(slots), num_prefill_tokens=t, num_decodes=0, num_decode_tokens=0,
        num_spec_decodes=0, num_spec_decode_tokens=0, num_actual_tokens=t,
        has_initial_state=torch.tensor(has_state),
        non_spec_query_start_loc=torch.tensor(qsl, dtype=torch.int32),
        non_spec_state_indices_tensor=torch.tensor(slots, dtype=torch.int32),
    )
