"""Turn the scheduled rows of one step into the flat tensors the model reads."""

from __future__ import annotations

import math
from dataclasses import dataclass
from itertools import accumulate
from typing import cast

import torch

from .pools import NULL_PAGE
from .request import Request
from .step_inputs import FULL_STATE, PackedIndices, Slice, StepInputs, from_packed

INDEX = torch.int32


@dataclass
class PrefillRow:
    """``request.tokens[start:end]`` continued from (and written back to) ``slot``."""

    request: Request
    start: int
    end: int
    slot: int


@dataclass
class DecodeRow:
    """A speculative window: the last sampled token and the drafts.

    ``state`` is the checkpoint slot (recovery) or the ``S+1`` state columns (full state),
    ``conv`` the slot whose conv window the step writes, ``column_row`` the request's
    align-mode state block table (recovery with prefix caching; empty otherwise).
    """

    request: Request
    state: int | list[int]
    conv: int
    column_row: list[int]


def build_step_inputs(
    mode: str,
    decode: list[DecodeRow],
    prefill: list[PrefillRow],
    num_decode_rows: int,
    *,
    num_spec: int,
    block_size: int,
    pages_per_request: int,
    device: torch.device,
    backend: str = "auto",
    fused_rows: int | None = None,
    validate: bool = True,
) -> StepInputs:
    """Decode rows first (padded with null rows up to ``num_decode_rows``), then prefill rows.

    Null rows read and write no state (slot -1), write their keys into the null page and
    attend to nothing real; their outputs are ignored. Block tables are always
    ``pages_per_request`` wide so that every step of a run has the same attention shapes.
    With ``fused_rows`` (recovery, fused commit) decode row ``i`` writes its records to
    scratch row ``fused_rows + i`` and first commits its request's ``pending`` tokens from
    row ``pending_row``. ``validate`` is handed to the ops (see :class:`StepInputs`).
    """
    W, B = num_spec + 1, block_size
    tokens: list[int] = []
    positions: list[int] = []
    rows: list[int] = []
    kv_slots: list[int] = []
    tables: list[list[int]] = []

    def add_row(req: Request | None, toks: list[int], start: int) -> None:
        row = len(tables)
        pages = req.pages if req is not None else []
        tables.append(pages + [NULL_PAGE] * (pages_per_request - len(pages)))
        for j, tok in enumerate(toks):
            pos = start + j
            tokens.append(tok)
            rows.append(row)
            if req is None:
                positions.append(0)
                kv_slots.append(NULL_PAGE * B + j % B)
            else:
                positions.append(pos)
                kv_slots.append(pages[pos // B] * B + pos % B)

    for d in decode:
        r = d.request
        add_row(r, [r.tokens[r.num_computed], *r.drafts], r.num_computed)
    pad = num_decode_rows - len(decode)
    for _ in range(pad):
        add_row(None, [0] * W, 0)
    for p in prefill:
        add_row(p.request, p.request.tokens[p.start:p.end], p.start)

    packer = _Packer()
    add = packer.add
    full = mode == FULL_STATE
    state_idx: list[int] | list[list[int]]
    if full:
        state_idx = [list(d.state) for d in decode if isinstance(d.state, list)]
        state_idx += [[-1] * W] * pad
    else:
        state_idx = [d.state for d in decode if isinstance(d.state, int)] + [-1] * pad
    if len(state_idx) != num_decode_rows:
        raise ValueError(f"argument 'decode': rows do not match mode {mode!r}")
    na = [d.request.num_accepted for d in decode] + [1] * pad
    fused = fused_rows is not None and not full
    if fused:
        assert fused_rows is not None
        # pending counts play num_accepted's part for the conv history's read offset
        na = [max(d.request.pending, 1) for d in decode] + [1] * pad
    add("linear.decode_query_start_loc", [i * W for i in range(num_decode_rows + 1)])
    add("linear.decode_state_indices", state_idx)
    add("linear.decode_conv_indices", [d.conv for d in decode] + [-1] * pad)
    if full:
        add("linear.num_accepted", na)
    if full or fused:
        add("linear.conv_offsets", [n - 1 for n in na])
    add("linear.prefill_query_start_loc", [0, *accumulate(p.end - p.start for p in prefill)])
    add("linear.prefill_state_indices", [p.slot for p in prefill])
    if fused:
        add("linear.record_indices", [(fused_rows or 0) + i for i in range(num_decode_rows)])
        add("linear.prev_lens", [d.request.pending for d in decode] + [0] * pad)
        add("linear.prev_record_indices",
            [max(d.request.pending_row, 0) for d in decode] + [0] * pad)
    add("attention.positions", positions, torch.int64)
    add("attention.row_of_token", rows, torch.int64)
    add("attention.kv_slots", kv_slots, torch.int64)
    add("attention.block_tables", tables, torch.int64)
    add("token_ids", tokens, torch.int64)
    return from_packed(packer.upload(device), mode, num_decode_rows * W, validate=validate,
                       backend=backend)


class _Packer:
    """Flattens a step's index vectors into one host list per dtype (see PackedIndices)."""

    ALIGN = 16  # bytes: each tensor starts where a vectorized kernel load expects it

    def __init__(self) -> None:
        self.dtypes: list[torch.dtype] = [INDEX, torch.int64]
        self.values: list[list[int]] = [[], []]
        self.layout: list[Slice] = []

    def add(self, name: str, values: list[int] | list[list[int]],
            dtype: torch.dtype = INDEX) -> None:
        """Append one tensor (a list, or a list of equal-length lists)."""
        buf = self.dtypes.index(dtype)
        flat = self.values[buf]
        if values and isinstance(values[0], list):
            rows = cast("list[list[int]]", values)
            shape: tuple[int, ...] = (len(rows), len(rows[0]))
            for row in rows:
                flat.extend(row)
        else:
            shape = (len(values),)
            flat.extend(cast("list[int]", values))
        self.layout.append((name, buf, len(flat) - math.prod(shape), shape))
        step = self.ALIGN // dtype.itemsize
        flat.extend([0] * (-len(flat) % step))

    def upload(self, device: torch.device) -> PackedIndices:
        """One tensor per dtype on ``device``."""
        buffers = tuple(torch.tensor(v, dtype=d, device=device)
                        for v, d in zip(self.values, self.dtypes, strict=True))
        return PackedIndices(buffers, tuple(self.layout))
