"""A bundle through LMCache's RAM store and back, as a restore reads it."""

from __future__ import annotations

from typing import Any

from vllm_recoverssm.checkpoint import (
    CheckpointConfig,
    CheckpointStore,
    LayoutIdentity,
    RequestCheckpoint,
)


def through_ram_store(checkpoint: RequestCheckpoint, model: str,
                      ram_bytes: int = 64 << 20) -> dict[str, Any]:
    """Store ``checkpoint`` in LMCache's RAM backend, look its tokens up again and return
    the restored layers (asserting the store and the hit)."""
    identity = LayoutIdentity(model=model, revision="x", dtypes={"state": "float32"},
                              layout="vllm-kv-pages", layout_version=1, tp_rank=0, tp_size=1,
                              num_speculative_tokens=3, mode="recovery")
    k = len(checkpoint.tokens)
    with CheckpointStore(CheckpointConfig(backend="ram", ram_bytes=ram_bytes), identity) as store:
        assert store.store(checkpoint).stored
        hit = store.lookup(checkpoint.tokens, min_tokens=k)
    assert hit is not None
    return dict(hit.checkpoint.layers)
