"""Between vLLM's KV-cache pages and a bundle's tensors, for every KV-cache group.

* **KDA groups** (vLLM ``MambaSpec``; the plugin's GLM-5.3 KDA layers): per layer the conv
  history ``[C, Kc-1]`` (dim-first, at zero speculative offset) and the FP32 recurrent state
  ``[h, V, K]``, read and written through the layer's own typed views of its page. Which
  block and offset hold the state is the caller's choice (:class:`KdaSource`): under
  recovery the committed block at offset 0; under full state the accepted column
  ``num_sampled - 1`` and the conv window at that offset (capture before compaction),
  counted from the request's first block, or in align mode from the block vLLM keeps the
  running state in. A restore writes the state at zero offset into the request's first
  block (align mode: the block of the bundle's last token), where vLLM's next row reads it.
* **Attention groups** (``AttentionSpec``: full attention, MLA, the DSA indexer's keys
  with ``tokens_per_state`` tokens per entry, MTP): the KV of the prefix as whole blocks
  ``[ceil(k / B), ...]`` of the block-major tensor vLLM hands ``register_kv_caches``. A
  restore writes the blocks past vLLM's own (block-aligned) prefix-cache hit; positions
  past ``k`` in the last block are recomputed before any read.
* **Ring groups** (``CircularBufferSpec``: GLM-5.3's indexer tail cache): the request's one
  block, holding the raw keys of the pool still being compressed at ``pos % ring``. It is
  state updated in place, like a KDA page, so it is read with the KDA pages (at the same
  moment: before a step for a chunk's first token, at the step that reaches a request's
  end) and always restored, past any local hit. vLLM sizes the ring to hold the open pool
  and one step's drafts (``ring >= kpool + S``), so the keys written for drafts at positions
  ``>= k`` never overwrite the open pool's before ``k``; a capture inside a chunk would,
  so none is planned while a ring group exists (:attr:`PageLayout.ring_groups`).

Any other group kind (sliding windows, cross attention, HiSparse, ...) is refused when the
connector starts. Nothing here moves a byte before the whole bundle has been checked
against the destination (:meth:`PageLayout.check`).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from ... import compat
from .metadata import BlockIds

CONV, STATE, KV, RING = "conv", "state", "kv", "ring"


class LayoutError(ValueError):
    """The deployment has a KV-cache group the connector cannot checkpoint."""


class BundleMismatch(ValueError):
    """A bundle does not fit this deployment's pages; it is never written."""


@dataclass(frozen=True)
class KdaLayer:
    """One KDA layer: its name, group and the layer object that owns the page views."""

    name: str
    group: int
    layer: Any

    def conv_view(self) -> torch.Tensor:
        """The conv state ``[slots, C, W]`` (dim-first whatever vLLM's layout)."""
        return self.layer.conv_state_dim_first_view(self.layer.kv_cache[0])  # type: ignore[no-any-return]

    def state_view(self) -> torch.Tensor:
        """The recurrent state ``[slots, h, V, K]``."""
        return self.layer.kv_cache[1]  # type: ignore[no-any-return]

    @property
    def history(self) -> int:
        """Conv history columns a checkpoint holds (``Kc - 1``)."""
        return int(self.layer.merged_conv_weight().shape[1]) - 1


@dataclass(frozen=True)
class AttentionLayer:
    """One attention layer: its block-major KV tensor and block size."""

    name: str
    group: int
    tensor: torch.Tensor
    block_size: int


@dataclass(frozen=True)
class KdaSource:
    """Where a request's state is: conv window in ``conv_slot`` at ``conv_offset``, the
    recurrent state in ``state_slot``; ``per_group`` gives both per KDA group."""

    per_group: Mapping[int, tuple[int, int, int]]
    """group -> (conv slot, conv offset, state slot)."""
    rings: Mapping[int, int] = dataclasses.field(default_factory=dict)
    """ring group -> the request's ring block."""


class PageLayout:
    """The deployment's KV-cache groups, resolved to layers and tensors."""

    def __init__(self, kv_cache_config: Any, kv_caches: Mapping[str, torch.Tensor],
                 layers: Mapping[str, Any]) -> None:
        self.kda: list[KdaLayer] = []
        self.attention: list[AttentionLayer] = []
        self.rings: list[AttentionLayer] = []
        self.kda_groups: list[int] = []
        self.attention_groups: list[int] = []
        self.ring_groups: list[int] = []
        for g, group in enumerate(kv_cache_config.kv_cache_groups):
            spec = group.kv_cache_spec
            if all(compat.is_circular_buffer_spec(s) for s in compat.group_specs(spec)):
                self.ring_groups.append(g)
                self.rings += _block_major(g, group.layer_names, spec, kv_caches)
            elif compat.is_mamba_spec(spec):
                self.kda_groups.append(g)
                for name in group.layer_names:
                    layer = layers.get(name)
                    if layer is None or not hasattr(layer, "conv_state_dim_first_view"):
                        raise LayoutError(
                            f"layer {name} keeps a recurrent state the connector cannot "
                            f"read ({type(layer).__name__}); RecoverSSMCheckpointConnector "
                            "checkpoints the plugin's GLM-5.3 KDA layers only")
                    self.kda.append(KdaLayer(name, g, layer))
            elif all(compat.is_attention_spec(s) and _plain_attention(s)
                     for s in compat.group_specs(spec)):
                self.attention_groups.append(g)
                self.attention += _block_major(g, group.layer_names, spec, kv_caches)
            else:
                raise LayoutError(
                    f"KV-cache group {g} ({type(spec).__name__}, layers "
                    f"{', '.join(list(group.layer_names)[:2])}) cannot be checkpointed at "
                    "request boundaries (sliding-window, chunked-local, cross-attention and "
                    "host-resident groups are not supported)")
        if not self.kda:
            raise LayoutError("the model has no KDA layer to checkpoint")

    @property
    def layer_groups(self) -> dict[str, int]:
        """KDA layer name -> its group index."""
        return {layer.name: layer.group for layer in self.kda}

    # -- capture ----------------------------------------------------------------------------
    def read_kda(self, source: KdaSource) -> dict[str, dict[str, torch.Tensor]]:
        """Every KDA layer's conv history and state from ``source``, and every ring layer's
        block (CPU copies): the state a request's pages hold in place."""
        out: dict[str, dict[str, torch.Tensor]] = {}
        for ring in self.rings:
            block = source.rings.get(ring.group, 0)
            if block == 0:
                raise BundleMismatch(f"{ring.name}: the request holds no ring block")
            out[ring.name] = {RING: ring.tensor[block].to("cpu", copy=True)}
        for layer in self.kda:
            conv_slot, offset, state_slot = source.per_group[layer.group]
            h = layer.history
            out[layer.name] = {
                CONV: layer.conv_view()[conv_slot, :, offset:offset + h].to("cpu", copy=True),
                STATE: layer.state_view()[state_slot].to("cpu", copy=True),
            }
        return out

    def read_attention(self, block_ids: BlockIds, num_tokens: int) -> dict[str, torch.Tensor]:
        """Every attention layer's KV blocks of the first ``num_tokens`` tokens (CPU)."""
        out: dict[str, torch.Tensor] = {}
        for layer in self.attention:
            ids = list(block_ids[layer.group][: math.ceil(num_tokens / layer.block_size)])
            if len(ids) * layer.block_size < num_tokens or 0 in ids:
                raise BundleMismatch(
                    f"{layer.name}: the request holds no blocks for {num_tokens} tokens")
            index = torch.tensor(ids, dtype=torch.long, device=layer.tensor.device)
            out[layer.name] = layer.tensor.index_select(0, index).to("cpu", copy=True)
        return out

    # -- restore ----------------------------------------------------------------------------
    def check(self, layers: Mapping[str, Mapping[str, torch.Tensor]], num_tokens: int) -> None:
        """Raise :class:`BundleMismatch` unless ``layers`` fit these pages exactly."""
        expected = ({layer.name for layer in self.kda} | {layer.name for layer in self.attention}
                    | {ring.name for ring in self.rings})
        if set(layers) != expected:
            missing = sorted(expected - set(layers))[:3]
            extra = sorted(set(layers) - expected)[:3]
            raise BundleMismatch(f"layers differ (missing {missing}, unexpected {extra})")
        for layer in self.kda:
            tensors = layers[layer.name]
            if set(tensors) != {CONV, STATE}:
                raise BundleMismatch(f"{layer.name}: tensors {sorted(tensors)}, expected "
                                     f"{[CONV, STATE]}")
            conv, state = self.conv_and_state_like(layer)
            _same(layer.name, tensors, CONV, conv)
            _same(layer.name, tensors, STATE, state)
        for att in self.attention:
            blocks = math.ceil(num_tokens / att.block_size)
            want = (blocks, *att.tensor.shape[1:])
            if set(layers[att.name]) != {KV}:
                raise BundleMismatch(f"{att.name}: tensors {sorted(layers[att.name])}, "
                                     f"expected {[KV]}")
            _same(att.name, layers[att.name], KV, torch.empty(0, dtype=att.tensor.dtype), want)
        for ring in self.rings:
            if set(layers[ring.name]) != {RING}:
                raise BundleMismatch(f"{ring.name}: tensors {sorted(layers[ring.name])}, "
                                     f"expected {[RING]}")
            _same(ring.name, layers[ring.name], RING, torch.empty(0, dtype=ring.tensor.dtype),
                  tuple(ring.tensor.shape[1:]))

    def conv_and_state_like(self, layer: KdaLayer) -> tuple[torch.Tensor, torch.Tensor]:
        """Zero-size stand-ins carrying the shapes and dtypes a layer's bundle tensors have."""
        conv, state = layer.conv_view(), layer.state_view()
        return (torch.empty((conv.shape[1], layer.history), dtype=conv.dtype, device="meta"),
                torch.empty(tuple(state.shape[1:]), dtype=state.dtype, device="meta"))

    def write(self, layers: Mapping[str, Mapping[str, torch.Tensor]], block_ids: BlockIds,
              num_tokens: int, local_tokens: int, state_column: int = 0) -> None:
        """Write a checked bundle into a request's blocks (after :meth:`check`); the KDA
        state goes into block ``state_column`` of each KDA group (align mode: the block
        of the bundle's last token, where vLLM looks for the running state)."""
        for layer in self.kda:
            slot = int(block_ids[layer.group][state_column])
            if slot == 0:
                raise BundleMismatch(f"{layer.name}: the request has no state block")
            tensors = layers[layer.name]
            conv, state = layer.conv_view(), layer.state_view()
            conv[slot, :, :layer.history] = tensors[CONV].to(conv.device)
            state[slot] = tensors[STATE].to(state.device)
        for ring in self.rings:
            ring.tensor[_ring_block(ring, block_ids)] = layers[ring.name][RING].to(
                ring.tensor.device)
        for att in self.attention:
            first = local_tokens // att.block_size
            blocks = math.ceil(num_tokens / att.block_size)
            ids = list(block_ids[att.group][first:blocks])
            if len(ids) != blocks - first or 0 in ids:
                raise BundleMismatch(f"{att.name}: the request holds no blocks to restore into")
            index = torch.tensor(ids, dtype=torch.long, device=att.tensor.device)
            att.tensor.index_copy_(0, index, layers[att.name][KV][first:blocks].to(
                att.tensor.device))

    def kda_destination_check(self, block_ids: BlockIds, state_column: int = 0) -> None:
        """Raise unless every KDA group has a state block (at ``state_column``) and every
        ring group its block to restore into."""
        for g in self.kda_groups:
            ids = block_ids[g]
            if len(ids) <= state_column or int(ids[state_column]) == 0:
                raise BundleMismatch(f"KV-cache group {g}: the request has no state block "
                                     f"at column {state_column}")
        for ring in self.rings:
            _ring_block(ring, block_ids)

    def ring_blocks(self, block_ids: BlockIds) -> dict[int, int]:
        """Ring group -> the request's ring block (0 where it holds none)."""
        return {g: int(block_ids[g][0]) if len(block_ids[g]) else 0
                for g in self.ring_groups}


def _block_major(group: int, names: Sequence[str], spec: Any,
                 kv_caches: Mapping[str, torch.Tensor]) -> list[AttentionLayer]:
    """The layers of an attention or ring group, each with its block-major KV tensor."""
    block = int(compat.group_specs(spec)[0].block_size)
    out = []
    for name in names:
        if name not in kv_caches:
            raise LayoutError(f"attention layer {name} has no KV tensor")
        out.append(AttentionLayer(name, group, kv_caches[name], block))
    return out


def _ring_block(ring: AttentionLayer, block_ids: BlockIds) -> int:
    ids = block_ids[ring.group]
    if len(ids) != 1 or int(ids[0]) == 0:
        raise BundleMismatch(f"{ring.name}: the request holds no ring block ({list(ids)})")
    return int(ids[0])


def _plain_attention(spec: Any) -> bool:
    # Full attention and MLA keep every token's KV in position-indexed blocks; windows,
    # chunked-local, cross-attention and host-resident specs do not.
    name = type(spec).__name__
    return name in ("FullAttentionSpec", "MLAAttentionSpec", "SinkFullAttentionSpec")


def _same(layer: str, tensors: Mapping[str, torch.Tensor], name: str, like: torch.Tensor,
          shape: tuple[int, ...] | None = None) -> None:
    t = tensors.get(name)
    if t is None:
        raise BundleMismatch(f"{layer}: no {name!r} tensor")
    want = tuple(like.shape) if shape is None else shape
    if t.dtype != like.dtype or tuple(t.shape) != want:
        raise BundleMismatch(
            f"{layer}.{name}: {t.dtype} {list(t.shape)} does not fit {like.dtype} {list(want)}")
