"""Commit plans: what commit and conv compaction do for each request row after a step.

Both builders return a :class:`vllm_recoverssm.ops.CommitPlan` of int32 tensors on the
device of their inputs; a negative slot is the null slot (no work / no boundary).

``num_accepted`` follows vLLM 0.32's convention (``num_sampled``): the number of tokens
of the step's window whose updates are kept, i.e. accepted drafts + 1 (the first,
non-draft token). ``commit_len = clamp(num_accepted, 0, query_len)``, as in vLLM's
``_prepare_commit_plan_kernel`` (``vllm/models/kimi_k3/nvidia/ops/recoverssm.py``).

Non-align mode (:func:`build_commit_plan`): the checkpoint is updated in place, so the
final slot is the source slot and there are no boundaries.

Align mode (:func:`build_align_commit_plan`; prefix caching keeps a state block every
``B`` tokens, ``block_table[req, j]`` holding the state after token ``(j+1)*B``, and
``B >= S+1``). With ``nc`` = tokens whose state was committed before this step and
``n`` = commit_len:

* source slot   ``block_table[req, max(nc-1, 0) // B]`` -- the block of the last
  committed token; this is the running-state column vLLM's
  ``_postprocess_recoverssm_align_kernel`` leaves after the previous step
  (``vllm/v1/worker/gpu/model_states/recoverssm.py``);
* final slot    ``block_table[req, max(nc+n-1, 0) // B]``;
* boundary      when ``nc + n >= next = (nc // B + 1) * B``: slot
  ``block_table[req, next // B - 1]`` (= column ``nc // B``) receives the state after
  ``next - nc`` tokens (the boundary replay length, 1..n). Since ``n <= query_len <=
  S+1 <= B``, at most one boundary is crossed per step.

Edge cases (all follow from the formulas; the tests pin them down):

* ``nc == 0`` (nothing committed yet, e.g. a fresh request's first window): the source is
  column 0 (vLLM clamps ``nc-1`` at 0), which must hold the initial state; the step
  crosses the first boundary only when ``n == B`` (possible only if ``B == S+1``).
* ``nc`` a multiple of ``B`` (the previous step ended exactly on a boundary): the source
  is the completed block ``nc//B - 1``, which stays untouched (it is a cached prefix
  block); for ``n >= 1`` the final slot is the next column ``nc//B``.
* ``nc + n`` exactly on a boundary: the boundary slot equals the final slot and the
  boundary length equals ``n``; both writes store the same state (vLLM does the same).
* ``n == 0`` (nothing accepted, or an empty row): the final slot is the source slot and no
  boundary is crossed, so commit leaves the state where it is. (vLLM writes a null final
  slot for such rows; the effect is the same: nothing moves.)
* a null (negative) source slot makes the whole row null: commit_len 0, no final slot,
  no boundary.

:func:`build_align_commit_plan` is vectorised torch code that runs unchanged on CPU and
CUDA tensors; :func:`reference_align_commit_plan` is the plain-Python per-row version the
tests compare it with.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from ..ops.plan import CommitPlan
from ..ops.validation import INDEX_DTYPES, check_tensor

NULL = -1


def _check_int(name: str, value: object, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"argument '{name}': expected an int, got {type(value).__name__}")
    if value < minimum:
        raise ValueError(f"argument '{name}': expected >= {minimum}, got {value}")
    return value


def _check_rows(
    name: str, t: object, n: int | None, device: torch.device | None
) -> torch.Tensor:
    tensor = check_tensor(name, t, dtypes=INDEX_DTYPES, device=device)
    if tensor.dim() != 1 or (n is not None and tensor.shape[0] != n):
        want = "[N]" if n is None else f"[{n}]"
        raise ValueError(
            f"argument '{name}': expected shape {want} (one value per request row), got "
            f"{list(tensor.shape)}"
        )
    return tensor


def _check_nonneg(name: str, t: torch.Tensor) -> None:
    if t.numel() and int(t.min().item()) < 0:
        raise ValueError(f"argument '{name}': expected values >= 0, got {t.tolist()}")


def _check_query_lens(query_lens: torch.Tensor, num_spec: int | None) -> None:
    _check_nonneg("query_lens", query_lens)
    if num_spec is not None and query_lens.numel():
        longest = int(query_lens.max().item())
        if longest > num_spec + 1:
            raise ValueError(
                f"argument 'query_lens': a row has {longest} tokens, expected at most "
                f"{num_spec + 1} (S+1 with num_spec={num_spec})"
            )


def query_lens_from_start_loc(query_start_loc: torch.Tensor) -> torch.Tensor:
    """Per-row token counts ``qsl[i+1] - qsl[i]`` from a ``[N+1]`` query_start_loc."""
    qsl = check_tensor("query_start_loc", query_start_loc, dtypes=INDEX_DTYPES)
    if qsl.dim() != 1 or qsl.shape[0] < 1:
        raise ValueError(
            f"argument 'query_start_loc': expected shape [N+1], got {list(qsl.shape)}"
        )
    return qsl[1:] - qsl[:-1]


def build_commit_plan(
    state_indices: torch.Tensor,
    num_accepted: torch.Tensor,
    query_lens: torch.Tensor,
    *,
    num_spec: int | None = None,
    validate: bool = True,
) -> CommitPlan:
    """Non-align commit plan: update each checkpoint in place.

    ``state_indices`` ``[N]`` (negative = null row), ``num_accepted`` ``[N]`` (accepted
    drafts + 1; negative counts as 0), ``query_lens`` ``[N]`` (tokens of the row this
    step). Returns ``commit_len = clamp(num_accepted, 0, query_len)`` (0 for null rows),
    ``final_indices`` equal to the source slot (null rows stay null) and no boundaries.
    ``num_spec``, when given, also checks ``query_len <= S+1``. ``validate=False`` skips
    the checks that read device values.
    """
    si = _check_rows("state_indices", state_indices, None, None)
    n = si.shape[0]
    na = _check_rows("num_accepted", num_accepted, n, si.device)
    ql = _check_rows("query_lens", query_lens, n, si.device)
    if num_spec is not None:
        _check_int("num_spec", num_spec, 0)
    if validate:
        _check_query_lens(ql, num_spec)
    valid = si >= 0
    clen = torch.minimum(na.to(torch.int64).clamp(min=0), ql.to(torch.int64).clamp(min=0))
    if num_spec is not None:
        clen = clen.clamp(max=num_spec + 1)
    src = torch.where(valid, si.to(torch.int64), NULL)
    clen = torch.where(valid, clen, 0)
    return CommitPlan(
        state_indices=src.to(torch.int32).contiguous(),
        commit_lens=clen.to(torch.int32).contiguous(),
        final_indices=src.to(torch.int32).contiguous(),
    )


def align_source_columns(num_computed: torch.Tensor, block_size: int) -> torch.Tensor:
    """Block-table column of each row's running state: ``max(nc - 1, 0) // B`` (int64)."""
    nc = _check_rows("num_computed", num_computed, None, None)
    _check_int("block_size", block_size, 1)
    return (nc.to(torch.int64) - 1).clamp(min=0) // block_size


def build_align_commit_plan(
    block_table: torch.Tensor,
    num_computed: torch.Tensor,
    query_lens: torch.Tensor,
    num_accepted: torch.Tensor,
    block_size: int,
    *,
    num_spec: int | None = None,
    validate: bool = True,
) -> CommitPlan:
    """Align-mode (prefix caching) commit plan; see the module docstring for the rules.

    ``block_table`` ``[N, W]`` holds slot ids (negative = null), ``num_computed`` ``[N]``
    the tokens committed before this step, ``query_lens`` ``[N]`` the tokens of the row
    this step, ``num_accepted`` ``[N]`` accepted drafts + 1, ``block_size`` the state
    block size ``B``. Every row must satisfy ``query_len <= B`` (``B >= S+1``).

    With ``validate=True`` (the default) the checks that read device values also run: no
    negative counts, and every column a live row needs lies inside the block table and
    holds a slot. With ``validate=False`` columns past the table are clamped to its last
    column, as vLLM's kernel does, and null entries propagate as null slots.
    """
    bt = check_tensor("block_table", block_table, dtypes=INDEX_DTYPES)
    if bt.dim() != 2:
        raise ValueError(
            f"argument 'block_table': expected shape [N, max_blocks], got {list(bt.shape)}"
        )
    n, width = bt.shape
    dev = bt.device
    nc_t = _check_rows("num_computed", num_computed, n, dev)
    ql_t = _check_rows("query_lens", query_lens, n, dev)
    na_t = _check_rows("num_accepted", num_accepted, n, dev)
    B = _check_int("block_size", block_size, 1)
    if num_spec is not None:
        _check_int("num_spec", num_spec, 0)
        if B < num_spec + 1:
            raise ValueError(
                f"argument 'block_size': align mode needs block_size >= S+1 = "
                f"{num_spec + 1} so that one step crosses at most one boundary, got {B}"
            )
    if n and width < 1:
        raise ValueError("argument 'block_table': expected at least one column, got 0")
    if validate:
        _check_nonneg("num_computed", nc_t)
        _check_query_lens(ql_t, num_spec)
        if ql_t.numel() and int(ql_t.max().item()) > B:
            raise ValueError(
                f"argument 'query_lens': a row has {int(ql_t.max().item())} tokens but "
                f"block_size is {B}; align mode needs block_size >= S+1 >= query_len"
            )
    if n == 0:
        empty = torch.empty(0, dtype=torch.int32, device=dev)
        return CommitPlan(empty, empty.clone(), empty.clone(), empty.clone(), empty.clone())

    nc = nc_t.to(torch.int64)
    ql = ql_t.to(torch.int64)
    clen = torch.minimum(na_t.to(torch.int64).clamp(min=0), ql.clamp(min=0))
    if num_spec is not None:
        clen = clen.clamp(max=num_spec + 1)
    table = bt.to(torch.int64)
    rows = torch.arange(n, device=dev)
    last = width - 1

    src_col = (nc - 1).clamp(min=0) // B
    fin_col = (nc + clen - 1).clamp(min=0) // B
    next_b = (nc // B + 1) * B
    crosses = (nc + clen) >= next_b
    b_col = next_b // B - 1
    src = table[rows, src_col.clamp(max=last)]
    live = src >= 0

    if validate:
        need = torch.maximum(src_col, fin_col)
        need = torch.where(crosses, torch.maximum(need, b_col), need)
        over = live & (need > last)
        # rows whose source column itself is past the table are reported too
        over |= src_col > last
        if bool(over.any()):
            i = int(torch.nonzero(over)[0, 0].item())
            raise ValueError(
                f"argument 'block_table': row {i} (num_computed={int(nc[i])}, "
                f"commit_len={int(clen[i])}) needs column {int(need[i])} but the table has "
                f"{width} column(s)"
            )
        fin_chk = table[rows, fin_col.clamp(max=last)]
        bnd_chk = table[rows, b_col.clamp(max=last)]
        bad = live & ((fin_chk < 0) | (crosses & (bnd_chk < 0)))
        if bool(bad.any()):
            i = int(torch.nonzero(bad)[0, 0].item())
            raise ValueError(
                f"argument 'block_table': row {i} needs a slot in column "
                f"{int(fin_col[i]) if int(fin_chk[i]) < 0 else int(b_col[i])} but it holds "
                "the null slot"
            )

    fin = table[rows, fin_col.clamp(max=last)]
    bslot = table[rows, b_col.clamp(max=last)]
    has_b = live & crosses & (bslot >= 0)
    plan = CommitPlan(
        state_indices=torch.where(live, src, NULL),
        commit_lens=torch.where(live, clen, 0),
        final_indices=torch.where(live, fin, NULL),
        boundary_indices=torch.where(has_b, bslot, NULL),
        boundary_lens=torch.where(has_b, next_b - nc, 0),
    )
    for name in ("state_indices", "commit_lens", "final_indices", "boundary_indices",
                 "boundary_lens"):
        setattr(plan, name, getattr(plan, name).to(torch.int32).contiguous())
    return plan


@dataclass(frozen=True)
class AlignRow:
    """One row of an align-mode commit plan, as plain ints (the reference's output)."""

    state_index: int
    commit_len: int
    final_index: int
    boundary_index: int
    boundary_len: int


def reference_align_commit_plan(
    block_table: Sequence[Sequence[int]],
    num_computed: Sequence[int],
    query_lens: Sequence[int],
    num_accepted: Sequence[int],
    block_size: int,
) -> list[AlignRow]:
    """Plain-Python, row-by-row align commit plan (the oracle for the vectorised one).

    Assumes valid inputs (columns inside the table); null entries propagate as in
    :func:`build_align_commit_plan`.
    """
    B = block_size
    out: list[AlignRow] = []
    for row, nc, ql, na in zip(block_table, num_computed, query_lens, num_accepted,
                               strict=True):
        n = min(max(na, 0), max(ql, 0))
        src = row[max(nc - 1, 0) // B]
        if src < 0:
            out.append(AlignRow(NULL, 0, NULL, NULL, 0))
            continue
        fin = row[max(nc + n - 1, 0) // B]
        nxt = (nc // B + 1) * B
        bslot, blen = NULL, 0
        if nc + n >= nxt and row[nxt // B - 1] >= 0:
            bslot, blen = row[nxt // B - 1], nxt - nc
        out.append(AlignRow(src, n, fin, bslot, blen))
    return out


def plan_rows(plan: CommitPlan) -> list[AlignRow]:
    """A plan's rows as :class:`AlignRow` values (missing fields read as in-place / none)."""
    si = plan.state_indices.tolist()
    cl = plan.commit_lens.tolist()
    fi = si if plan.final_indices is None else plan.final_indices.tolist()
    n = len(si)
    bi = [NULL] * n if plan.boundary_indices is None else plan.boundary_indices.tolist()
    bl = [0] * n if plan.boundary_lens is None else plan.boundary_lens.tolist()
    return [AlignRow(*r) for r in zip(si, cl, fi, bi, bl, strict=True)]
