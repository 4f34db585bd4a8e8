"""Memory planner: per-layer pages, per-request reserve and what fits a memory budget.

For a model, TP size, S, cache mode, dtypes, ``max_num_seqs`` and an optional per-GPU
budget, :func:`plan` reports for each layout (:mod:`.layout`): the page bytes of one
linear layer, the per-request reserve over all linear layers, the scratch area, the
saving against full states (MiB and %), how much every cached/exported page grows,
how many max-length requests fit the budget and the longest context one request can
reach. All sizes are per GPU.

The budget (``gpu_memory_gib``) is what the KV cache and the recurrent states may use on
one GPU -- what vLLM gets from ``--kv-cache-memory-bytes`` or from
``--gpu-memory-utilization`` after the weights and activations -- not the whole GPU.
A request of ``n`` tokens costs its linear-state reserve, the attention layers' KV for
``n`` tokens (MLA latent + sparse-indexer entries, or GQA K/V) and a small fixed
per-request part (the DSA indexer's tail ring); with scratch records the scratch area
(``max_num_seqs`` rows) is taken off the budget first. Not modelled: attention block
rounding, hybrid page padding (``page_size_padded``), and CUDA-graph or activation
memory.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from ..config.models import ModelSpec
from .layout import (
    DTYPE_BYTES,
    LAYOUT_NAMES,
    CacheMode,
    LayoutName,
    build_layout,
    linear_layer_dims,
    record_tensors,
)

MIB = 1 << 20
GIB = 1 << 30

LAYOUT_TITLES: dict[LayoutName, str] = {
    "full": "full states",
    "recovery_in_page": "recovery, records in page",
    "recovery_scratch": "recovery, records in scratch",
}


class PlanConfig(BaseModel):
    """What the planner is asked about."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    model: ModelSpec
    tp: int = Field(default=1, ge=1)
    num_spec: int = Field(default=3, ge=0, le=15)
    cache_mode: CacheMode = "none"
    block_size: int | None = Field(default=None, ge=1)
    activation_dtype: Literal["bfloat16", "float16", "float32"] | None = None
    state_dtype: Literal["auto", "float32", "float16", "bfloat16"] = "auto"
    kv_cache_dtype: Literal["auto", "fp8"] = "auto"
    max_num_seqs: int = Field(default=256, ge=1)
    max_model_len: int | None = Field(default=None, ge=1)
    gpu_memory_gib: float | None = Field(default=None, gt=0)
    prefill_checkpoint_blocks: int = Field(default=0, ge=0, le=1)
    fused_commit: bool = False
    """The commit fused into the next verify: scratch records live one step longer, so
    the scratch has two rows per running request (the vLLM plugin's
    ``recoverssm_commit`` ``auto``, its default, or ``fused``, where it applies)."""

    @model_validator(mode="after")
    def _align(self) -> PlanConfig:
        if self.cache_mode == "align":
            if self.block_size is None:
                raise ValueError("cache_mode 'align' needs a block_size (--block-size)")
            if self.block_size < self.num_spec + 1:
                raise ValueError(
                    f"block_size {self.block_size} is smaller than S+1 = {self.num_spec + 1};"
                    " align mode needs one speculative window to fit a block"
                )
        elif self.prefill_checkpoint_blocks:
            raise ValueError("prefill_checkpoint_blocks applies only to cache_mode 'align'")
        return self

    @property
    def activation(self) -> str:
        return self.activation_dtype or self.model.dtype

    @property
    def resolved_state_dtype(self) -> str:
        """``auto`` is FP32 for KDA (``kda_state_dtype``, mamba_utils.py) and the
        activation dtype for GDN (``_mamba_state_dtype``, mamba_utils.py)."""
        if self.state_dtype != "auto":
            return self.state_dtype
        return "float32" if self.model.kind == "kda" else self.activation

    @property
    def context_len(self) -> int:
        return self.max_model_len or self.model.max_model_len


class LayoutPlan(BaseModel):
    """One layout's figures."""

    name: LayoutName
    title: str
    page_bytes: int
    blocks_per_request: int
    reserve_bytes_per_layer: int
    reserve_bytes_per_request: int  # pages over all linear layers
    scratch_row_bytes: int  # one request's records, all layers (0 unless scratch)
    scratch_bytes: int  # the whole scratch area at max_num_seqs, all layers
    state_bytes_per_request: int  # reserve + own scratch row
    total_bytes_at_max_num_seqs: int
    saving_bytes: int  # per request, vs full states
    saving_mib: float
    saving_pct: float
    page_growth_pct: float  # page vs the full-state page (cached / exported pages)
    requests_fit: int | None = None
    longest_context: int | None = None


class Plan(BaseModel):
    """The planner's answer."""

    model: str
    architecture: str
    kind: str
    tp: int
    num_spec: int
    cache_mode: CacheMode
    block_size: int | None
    prefill_checkpoint_blocks: int
    activation_dtype: str
    state_dtype: str
    kv_cache_dtype: str
    max_num_seqs: int
    fused_commit: bool = False
    max_model_len: int
    gpu_memory_gib: float | None
    num_linear_layers: int
    num_attention_layers: int
    num_draft_attention_layers: int
    local_heads: int
    head_dim: int
    conv_channels: int
    conv_bytes: int
    state_bytes: int
    record_bytes: int
    attention_bytes_per_token: float
    attention_fixed_bytes_per_request: int
    layouts: list[LayoutPlan]
    notes: list[str] = Field(default_factory=list)

    def layout(self, name: LayoutName) -> LayoutPlan:
        """The figures of one layout."""
        for lp in self.layouts:
            if lp.name == name:
                return lp
        raise KeyError(name)


def attention_bytes(spec: ModelSpec, tp: int, num_tokens: int, kv_bytes: int,
                    num_layers: int) -> int:
    """KV bytes of ``num_tokens`` tokens in ``num_layers`` attention layers on one GPU."""
    a = spec.attention
    if a is None or num_layers == 0 or num_tokens <= 0:
        return 0
    per_layer = num_tokens * a.bytes_per_token(tp, kv_bytes)
    per_layer += -(-num_tokens // a.index_kpool) * a.indexer_bytes_per_state()
    return num_layers * per_layer


def _longest(avail: int, spec: ModelSpec, tp: int, kv_bytes: int, layers: int) -> int | None:
    """Largest n with attention_bytes(n) <= avail (None: attention costs nothing)."""
    if avail < 0:
        return 0
    if attention_bytes(spec, tp, 1 << 40, kv_bytes, layers) == 0:
        return None
    lo, hi = 0, 1
    while attention_bytes(spec, tp, hi, kv_bytes, layers) <= avail:
        lo, hi = hi, hi * 2
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if attention_bytes(spec, tp, mid, kv_bytes, layers) <= avail:
            lo = mid
        else:
            hi = mid
    return lo


def plan(config: PlanConfig) -> Plan:
    """Compute every figure of :class:`Plan` for ``config``."""
    spec = config.model
    tp, S = config.tp, config.num_spec
    act_b = DTYPE_BYTES[config.activation]
    state_b = DTYPE_BYTES[config.resolved_state_dtype]
    kv_b = act_b if config.kv_cache_dtype == "auto" else 1
    dims = linear_layer_dims(spec, tp)
    L = spec.num_linear_layers
    n_seqs = config.max_num_seqs
    layouts = {
        n: build_layout(spec, n, tp=tp, num_spec=S, cache_mode=config.cache_mode,
                        activation_bytes=act_b, state_bytes=state_b,
                        prefill_checkpoint_blocks=config.prefill_checkpoint_blocks)
        for n in LAYOUT_NAMES
    }
    full = layouts["full"]
    conv_b, st_b = (t.nbytes for t in full.page_tensors)
    rec_b = sum(t.nbytes for t in record_tensors(dims, S, act_b))

    draft_layers = spec.num_mtp_layers if S > 0 else 0
    attn_layers = spec.num_attention_layers + draft_layers
    attn_fixed = 0
    if spec.attention is not None:
        attn_fixed = attn_layers * spec.attention.tail_ring_bytes(S)
    per_token = attention_bytes(spec, tp, 1 << 20, kv_b, attn_layers) / (1 << 20)
    ctx = config.context_len
    attn_max = attention_bytes(spec, tp, ctx, kv_b, attn_layers) + attn_fixed

    full_req = L * full.reserve_bytes_per_request
    budget = None if config.gpu_memory_gib is None else int(config.gpu_memory_gib * GIB)
    plans: list[LayoutPlan] = []
    for name, lay in layouts.items():
        reserve = L * lay.reserve_bytes_per_request
        rows = 2 if config.fused_commit else 1
        row = rows * L * lay.scratch_row_bytes
        scratch = L * lay.scratch_bytes(rows * n_seqs)
        per_req = reserve + row
        saving = full_req - per_req
        fit = longest = None
        if budget is not None:
            avail = budget - scratch
            fit = max(0, avail // (reserve + attn_max)) if avail > 0 else 0
            longest = _longest(avail - reserve - attn_fixed, spec, tp, kv_b, attn_layers)
        plans.append(LayoutPlan(
            name=name, title=LAYOUT_TITLES[name], page_bytes=lay.page_bytes,
            blocks_per_request=lay.blocks_per_request,
            reserve_bytes_per_layer=lay.reserve_bytes_per_request,
            reserve_bytes_per_request=reserve, scratch_row_bytes=row, scratch_bytes=scratch,
            state_bytes_per_request=per_req,
            total_bytes_at_max_num_seqs=n_seqs * reserve + scratch,
            saving_bytes=saving, saving_mib=saving / MIB,
            saving_pct=100.0 * saving / full_req if full_req else 0.0,
            page_growth_pct=100.0 * (lay.page_bytes - full.page_bytes) / full.page_bytes,
            requests_fit=fit, longest_context=longest,
        ))

    notes = [f"{spec.name}: {spec.source}" if spec.source else spec.name]
    if config.resolved_state_dtype != "float32":
        notes.append(f"recurrent state is {config.resolved_state_dtype}; recovery needs "
                     "float32 (recovery rows are shown for comparison only)")
    if draft_layers:
        notes.append(f"attention includes {draft_layers} MTP draft layer(s)")
    if config.cache_mode == "align":
        notes.append("align mode: records in page also widen every cached prefix block "
                     "and every exported page; records in scratch do not")
    if budget is not None:
        notes.append("requests_fit counts max-length requests; at most max_num_seqs "
                     f"({n_seqs}) run at once")
    return Plan(
        model=spec.name, architecture=spec.architecture, kind=spec.kind, tp=tp, num_spec=S,
        cache_mode=config.cache_mode, block_size=config.block_size,
        prefill_checkpoint_blocks=config.prefill_checkpoint_blocks,
        activation_dtype=config.activation, state_dtype=config.resolved_state_dtype,
        kv_cache_dtype=config.kv_cache_dtype, max_num_seqs=n_seqs,
        fused_commit=config.fused_commit, max_model_len=ctx,
        gpu_memory_gib=config.gpu_memory_gib, num_linear_layers=L,
        num_attention_layers=spec.num_attention_layers,
        num_draft_attention_layers=draft_layers, local_heads=dims.heads,
        head_dim=dims.head_dim, conv_channels=dims.conv_channels, conv_bytes=conv_b,
        state_bytes=st_b, record_bytes=rec_b, attention_bytes_per_token=per_token,
        attention_fixed_bytes_per_request=attn_fixed, layouts=plans, notes=notes,
    )


def _mib(b: float) -> str:
    return f"{b / MIB:,.1f} MiB"


def format_plan(p: Plan) -> str:
    """A readable table of a :class:`Plan`."""
    head = (f"{p.model} ({p.architecture}, {p.kind.upper()}), TP {p.tp}, S = {p.num_spec}, "
            f"cache mode {p.cache_mode}"
            + (f" (block size {p.block_size}" + (", prefill checkpoint block"
                                                  if p.prefill_checkpoint_blocks else "")
               + ")" if p.cache_mode == "align" else ""))
    lines = [
        head,
        f"activations {p.activation_dtype}, state {p.state_dtype}, KV cache "
        f"{p.kv_cache_dtype}, max_num_seqs {p.max_num_seqs}, max_model_len "
        f"{p.max_model_len:,}",
        f"{p.num_linear_layers} linear layers: {p.local_heads} heads x {p.head_dim} per GPU, "
        f"{p.conv_channels} conv channels; {p.num_attention_layers} attention layers"
        + (f" + {p.num_draft_attention_layers} MTP" if p.num_draft_attention_layers else ""),
        "",
        f"per layer: conv {p.conv_bytes:,} B + state {p.state_bytes:,} B; records "
        f"{p.record_bytes:,} B (S+1 = {p.num_spec + 1} tokens)",
        "",
    ]
    cols = ["layout", "page B", "blocks", "per request", "scratch", "saving", "page +"]
    rows = [[lp.title, f"{lp.page_bytes:,}", str(lp.blocks_per_request),
             _mib(lp.state_bytes_per_request),
             _mib(lp.scratch_bytes) if lp.scratch_bytes else "-",
             "-" if lp.name == "full" else f"{lp.saving_mib:,.1f} MiB ({lp.saving_pct:.1f}%)",
             "-" if lp.name == "full" else f"{lp.page_growth_pct:.1f}%"]
            for lp in p.layouts]
    if p.gpu_memory_gib is not None:
        cols += ["fit", "longest context"]
        for r, lp in zip(rows, p.layouts, strict=True):
            r.append(f"{lp.requests_fit:,}")
            if lp.longest_context is None:
                r.append("unbounded")
            else:
                over = " (> max_model_len)" if lp.longest_context > p.max_model_len else ""
                r.append(f"{lp.longest_context:,}{over}")
    widths = [max(len(c), *(len(r[i]) for r in rows)) for i, c in enumerate(cols)]

    def fmt(cells: list[str]) -> str:
        return "  ".join(c.ljust(w) if i == 0 else c.rjust(w)
                         for i, (c, w) in enumerate(zip(cells, widths, strict=True)))

    lines.append(fmt(cols))
    lines.append("  ".join("-" * w for w in widths))
    lines += [fmt(r) for r in rows]
    lines.append("")
    row_note = ("its 2 scratch rows (fused commit)" if p.fused_commit else "its scratch row")
    scratch_rows = (2 if p.fused_commit else 1) * p.max_num_seqs
    lines.append(f"per request = {p.num_linear_layers} layers x blocks x page (+ {row_note}); "
                 f"scratch = {scratch_rows} rows; at max_num_seqs: "
                 + ", ".join(f"{lp.name} {_mib(lp.total_bytes_at_max_num_seqs)}"
                             for lp in p.layouts))
    lines.append(f"attention KV: {p.attention_bytes_per_token:,.2f} B per token"
                 + (f" + {p.attention_fixed_bytes_per_request:,} B per request"
                    if p.attention_fixed_bytes_per_request else ""))
    if p.gpu_memory_gib is None:
        lines.append("(give --gpu-memory GiB to see how many requests fit and the longest "
                     "context)")
    else:
        lines.append(f"budget {p.gpu_memory_gib:g} GiB per GPU for KV cache and states")
    lines += [f"note: {n}" for n in p.notes]
    return "\n".join(lines)
