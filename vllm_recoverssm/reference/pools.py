"""Device memory of the runtime: per-layer state pools, record scratch and paged KV.

Every KDA layer has a recurrent-state pool ``[slots, H, V, K]`` (FP32) and a conv pool
``[slots, 3*H*D, Kc-1+S]`` (activation dtype) indexed by the same slot ids, so one slot id
names a request's complete linear state across all layers. Recovery mode adds the
per-token records ``[rows, H, S+1, V]`` (FP32 corrections) and ``[rows, H, S+1, 2K]`` (raw k,
raw g) in a scratch area indexed by the request's row in the decode batch. Attention layers
keep keys and values in pages of ``block_size`` tokens; page 0 is the null page that padding
rows write into and that no request owns.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .model_config import ModelConfig
from .step_inputs import MODES, RECOVERY

NULL_PAGE = 0


@dataclass
class KDALayerPools:
    """One KDA layer's state pool, conv pool and (recovery only) record scratch."""

    state: torch.Tensor
    conv: torch.Tensor
    corrections: torch.Tensor | None
    kg: torch.Tensor | None


@dataclass
class AttentionLayerPools:
    """One attention layer's paged key and value caches ``[pages, block_size, heads, dim]``."""

    keys: torch.Tensor
    values: torch.Tensor


def _positive(name: str, value: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"argument '{name}': expected a positive int, got {value!r}")
    return value


class ModelPools:
    """All state of all layers, allocated once for a runtime.

    ``num_slots`` linear-state slots, ``record_rows`` scratch rows (the most decode rows in
    one step), ``num_pages`` KV pages of ``block_size`` tokens (page 0 is the null page).
    """

    def __init__(
        self,
        config: ModelConfig,
        *,
        mode: str,
        num_spec: int,
        num_slots: int,
        record_rows: int,
        num_pages: int,
        block_size: int,
        device: torch.device | str,
    ) -> None:
        if mode not in MODES:
            raise ValueError(f"argument 'mode': expected one of {MODES}, got {mode!r}")
        if not 1 <= num_spec <= 7:
            raise ValueError(f"argument 'num_spec': expected 1..7, got {num_spec}")
        _positive("num_slots", num_slots)
        _positive("record_rows", record_rows)
        _positive("block_size", block_size)
        if num_pages < 2:
            raise ValueError(
                f"argument 'num_pages': expected >= 2 (page 0 is the null page), got {num_pages}"
            )
        self.config = config
        self.mode = mode
        self.num_spec = num_spec
        self.num_slots = num_slots
        self.record_rows = record_rows
        self.num_pages = num_pages
        self.block_size = block_size
        self.device = torch.device(device)
        act = config.torch_dtype
        H, D, W = config.num_kda_heads, config.kda_head_dim, num_spec + 1
        window = config.conv_kernel - 1 + num_spec
        self.kda: dict[int, KDALayerPools] = {}
        for layer in config.kda_layers:
            recovery = mode == RECOVERY
            self.kda[layer] = KDALayerPools(
                state=torch.zeros(num_slots, H, D, D, dtype=torch.float32, device=self.device),
                conv=torch.zeros(num_slots, config.conv_channels, window, dtype=act,
                                 device=self.device),
                corrections=torch.zeros(record_rows, H, W, D, dtype=torch.float32,
                                        device=self.device) if recovery else None,
                kg=torch.zeros(record_rows, H, W, 2 * D, dtype=act, device=self.device)
                if recovery else None,
            )
        Ha, Da = config.num_attn_heads, config.attn_head_dim
        self.attention: dict[int, AttentionLayerPools] = {
            layer: AttentionLayerPools(
                keys=torch.zeros(num_pages, block_size, Ha, Da, dtype=act, device=self.device),
                values=torch.zeros(num_pages, block_size, Ha, Da, dtype=act,
                                   device=self.device),
            )
            for layer in config.attention_layers
        }

    @property
    def states(self) -> list[torch.Tensor]:
        """Recurrent-state pools of every KDA layer, in layer order."""
        return [p.state for p in self.kda.values()]

    @property
    def convs(self) -> list[torch.Tensor]:
        """Conv pools of every KDA layer, in layer order."""
        return [p.conv for p in self.kda.values()]

    @property
    def corrections(self) -> list[torch.Tensor]:
        """Correction scratch of every KDA layer (recovery mode only)."""
        return [self._records(p)[0] for p in self.kda.values()]

    @property
    def kgs(self) -> list[torch.Tensor]:
        """Raw k / raw g scratch of every KDA layer (recovery mode only)."""
        return [self._records(p)[1] for p in self.kda.values()]

    def _records(self, p: KDALayerPools) -> tuple[torch.Tensor, torch.Tensor]:
        if p.corrections is None or p.kg is None:
            raise ValueError(f"the {self.mode} pools keep no per-token records")
        return p.corrections, p.kg

    @property
    def slot_bytes(self) -> int:
        """Bytes one slot id holds across all KDA layers (recurrent state + conv window)."""
        return sum(
            p.state[0].numel() * p.state.element_size() + p.conv[0].numel() * p.conv.element_size()
            for p in self.kda.values()
        )

    @property
    def total_slot_bytes(self) -> int:
        """Bytes of the whole state and conv pools (every slot, every KDA layer)."""
        return self.num_slots * self.slot_bytes

    @property
    def state_slot_bytes(self) -> int:
        """Recurrent-state bytes of one slot across all KDA layers."""
        return sum(p.state[0].numel() * p.state.element_size() for p in self.kda.values())

    @property
    def conv_slot_bytes(self) -> int:
        """Conv-window bytes of one slot across all KDA layers."""
        return sum(p.conv[0].numel() * p.conv.element_size() for p in self.kda.values())

    @property
    def record_row_bytes(self) -> int:
        """Bytes of one scratch record row across all KDA layers (0 in full-state mode)."""
        total = 0
        for p in self.kda.values():
            if p.corrections is not None and p.kg is not None:
                total += p.corrections[0].numel() * p.corrections.element_size()
                total += p.kg[0].numel() * p.kg.element_size()
        return total

    @property
    def page_bytes(self) -> int:
        """Bytes of one KV page across all attention layers (keys and values)."""
        return sum(
            2 * p.keys[0].numel() * p.keys.element_size() for p in self.attention.values()
        )

    def copy_slot(self, src: int, dst: int) -> None:
        """Copy a slot's recurrent state and conv history (offset 0) to another slot."""
        hist = self.config.conv_kernel - 1
        for p in self.kda.values():
            p.state[dst].copy_(p.state[src])
            p.conv[dst, :, :hist].copy_(p.conv[src, :, :hist])

    def clear_slot(self, slot: int) -> None:
        """Zero a slot's state and conv window (the state before any token)."""
        for p in self.kda.values():
            p.state[slot].zero_()
            p.conv[slot].zero_()
