"""The checkpoint connector on GLM-5.3-Flash's real KV-cache layout, as vLLM builds it.

vLLM's own model classes (3 KDA layers, an indexed-attention layer, the MTP layer) give
every layer's spec and vLLM's planner groups and allocates them
(:mod:`tests.support.glm53_layout`): KDA pages, MLA blocks, the DSA indexer's kpool keys
(``tokens_per_state`` > 1) and the indexer's tail ring (``CircularBufferSpec``, one block
per request). The attention kernels never run: the CPU has none.
"""

from __future__ import annotations

import copy
import dataclasses
from typing import Any

import pytest
import torch

from tests.support.bundles import through_ram_store
from tests.support.glm53_layout import KPOOL, BuiltLayout, build_layout, write_glm53_flash_shaped
from tests.support.vllm_configs import MTP3
from vllm_recoverssm.checkpoint import RequestCheckpoint


@pytest.fixture(scope="module")
def built(build_config: Any, distributed: None,
          tmp_path_factory: pytest.TempPathFactory) -> BuiltLayout:
    model = write_glm53_flash_shaped(tmp_path_factory.mktemp("glm53-flash-shaped"))
    return build_layout(build_config(*MTP3, model=model))


def _kinds(built: BuiltLayout) -> dict[str, list[str]]:
    out: dict[str, list[str]] = {}
    for group in built.kv_cache_config.kv_cache_groups:
        out.setdefault(type(group.kv_cache_spec).__name__, []).extend(group.layer_names)
    return out


def test_vllm_builds_every_group_the_real_model_has(built: BuiltLayout) -> None:
    kinds = _kinds(built)
    assert set(kinds) == {"MambaSpec", "MLAAttentionSpec", "CircularBufferSpec"}
    assert len(kinds["MambaSpec"]) == 3
    # the target's attention layer and the MTP layer (vLLM names it model.layers.4)
    rings = sorted(kinds["CircularBufferSpec"])
    assert [n.rsplit(".", 1)[-1] for n in rings] == ["tail_cache", "tail_cache"]
    assert any(n.startswith("model.layers.4.") for n in rings)
    per_state = {n: built.specs[n].tokens_per_state for n in kinds["MLAAttentionSpec"]}
    assert sorted(per_state.values()) == [1, 1, KPOOL, KPOOL]  # MLA KV, indexer keys


def _fill(built: BuiltLayout) -> None:
    gen = torch.Generator().manual_seed(3)
    for name, layer in built.layers.items():
        views = layer.kv_cache if hasattr(layer, "conv_state_dim_first_view") \
            else [built.tensors[name]]
        for t in views:
            t.copy_(torch.randint(0, 100, t.shape, generator=gen).to(t.dtype)
                    if not t.dtype.is_floating_point else
                    torch.randn(t.shape, generator=gen).to(t.dtype))


def _ids(built: BuiltLayout, kda: int, ring: int, blocks: list[int]) -> tuple[tuple[int, ...], ...]:
    from vllm_recoverssm.vllm_plugin import compat

    out = []
    for group in built.kv_cache_config.kv_cache_groups:
        spec = group.kv_cache_spec
        if compat.is_circular_buffer_spec(spec):
            out.append((ring,))
        elif compat.is_mamba_spec(spec):
            out.append((kda,))
        else:
            out.append(tuple(blocks))
    return tuple(out)


def test_a_bundle_carries_every_group_through_lmcache_into_other_blocks(
    built: BuiltLayout,
) -> None:
    from vllm_recoverssm.vllm_plugin.distributed.kv_connector.pages import (
        RING,
        BundleMismatch,
        KdaSource,
        PageLayout,
    )

    _fill(built)
    pages = PageLayout(built.kv_cache_config, built.tensors, built.layers)
    kinds = _kinds(built)
    assert {r.name for r in pages.rings} == set(kinds["CircularBufferSpec"])
    assert {a.name for a in pages.attention} == set(kinds["MLAAttentionSpec"])
    assert {k.name for k in pages.kda} == set(kinds["MambaSpec"])
    block = min(a.block_size for a in pages.attention)
    k = block + 3  # two blocks of the smallest block size, the last one partly filled
    src = _ids(built, kda=7, ring=9, blocks=[3, 5])
    source = KdaSource({g: (7, 0, 7) for g in pages.kda_groups}, pages.ring_blocks(src))
    state = pages.read_kda(source)
    attention = pages.read_attention(src, k)
    layers = {**state, **{n: {"kv": t} for n, t in attention.items()}}
    assert set(layers) == set(built.layers)  # every KV-cache layer of the model
    checkpoint = RequestCheckpoint(tokens=tuple(range(1, k + 1)), layers=layers,
                                   logits=torch.zeros(4), boundary="prompt")
    restored = through_ram_store(checkpoint, "glm53-flash-shaped", ram_bytes=256 << 20)
    pages.check(restored, k)
    before = {n: t.clone() for n, t in built.tensors.items() if n in attention}
    dst = _ids(built, kda=11, ring=12, blocks=[20, 21])
    pages.kda_destination_check(dst)
    pages.write(restored, dst, k, local_tokens=0)
    for ring in pages.rings:
        assert torch.equal(ring.tensor[12], ring.tensor[9]), ring.name
    for kda in pages.kda:
        assert torch.equal(kda.state_view()[11], kda.state_view()[7]), kda.name
    for att in pages.attention:
        n = -(-k // att.block_size)
        for s, d in list(zip((3, 5), (20, 21), strict=True))[:n]:
            assert torch.equal(att.tensor[d], before[att.name][s]), att.name
    # a bundle without the ring, or a ring of another size, is never written
    ring_name = pages.rings[0].name
    with pytest.raises(BundleMismatch, match="layers differ"):
        pages.check({n: t for n, t in restored.items() if n != ring_name}, k)
    short = {**restored, ring_name: {RING: restored[ring_name][RING][..., :-1, :]}}
    with pytest.raises(BundleMismatch, match=ring_name):
        pages.check(short, k)
    with pytest.raises(BundleMismatch, match="no ring block"):
        pages.kda_destination_check(_ids(built, kda=11, ring=0, blocks=[20, 21]))


def test_a_group_the_connector_cannot_carry_is_named_at_start_up(built: BuiltLayout) -> None:
    from vllm.v1.kv_cache_interface import SlidingWindowSpec

    from vllm_recoverssm.vllm_plugin.distributed.kv_connector.pages import (
        LayoutError,
        PageLayout,
    )

    config = copy.copy(built.kv_cache_config)
    groups = list(config.kv_cache_groups)
    index = next(i for i, g in enumerate(groups)
                 if type(g.kv_cache_spec).__name__ == "CircularBufferSpec")
    ring = groups[index].kv_cache_spec
    window = SlidingWindowSpec(block_size=ring.block_size, num_kv_heads=ring.num_kv_heads,
                               head_size=ring.head_size, dtype=ring.dtype, sliding_window=64)
    groups[index] = dataclasses.replace(groups[index], kv_cache_spec=window)
    object.__setattr__(config, "kv_cache_groups", groups)
    name = groups[index].layer_names[0]
    with pytest.raises(LayoutError, match=rf"group {index} \(SlidingWindowSpec, layers "
                                          rf"{name}"):
        PageLayout(config, built.tensors, built.layers)


def test_no_bundle_is_taken_inside_a_chunk_with_a_tail_ring(built: BuiltLayout) -> None:
    """A tap inside a prompt chunk reads the KDA state at the tap, but the ring already
    holds the whole chunk's keys: such a bundle would restore the wrong open pool, so the
    worker refuses it by name (and plans no tap for it)."""
    from types import SimpleNamespace

    from vllm_recoverssm.vllm_plugin.distributed.kv_connector.keys import bundle_key
    from vllm_recoverssm.vllm_plugin.distributed.kv_connector.metadata import Capture
    from vllm_recoverssm.vllm_plugin.distributed.kv_connector.pages import PageLayout
    from vllm_recoverssm.vllm_plugin.distributed.kv_connector.worker import WorkerSide

    worker = WorkerSide.__new__(WorkerSide)  # only the layout and this step's block ids
    worker.layout = PageLayout(built.kv_cache_config, built.tensors, built.layers)
    ids = _ids(built, kda=7, ring=9, blocks=[3, 5])
    worker._meta = SimpleNamespace(block_ids={"r": ids})
    inside = Capture(req_id="r", key=bundle_key(list(range(1, 21))), kind="prompt",
                     offset=12, chunk_len=16)
    with pytest.raises(ValueError, match="tail ring"):
        worker._capture(inside, {})
