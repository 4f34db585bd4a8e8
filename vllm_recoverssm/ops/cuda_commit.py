"""The CUDA commit (``ops/csrc/kda_commit.cu``): every layer's accepted tokens in one launch.

It is written to give :func:`.triton_kda.commit_triton`'s states bit for bit (the same
instructions for the gate, the key norm and the update; a ``gpu`` test compares them), and
reads the same per-layer address tables (:class:`.plan.CommitTables`).
:func:`.backends.commit_kernel` takes it where :func:`preferred` says it is the faster.
It lives in the library of :mod:`.cuda_window` and applies where that builds, for
K = V = 128, a bounded gate, bfloat16 or float32 records, int32 indices and 16-byte
aligned pools. :data:`ROWS_PER_BLOCK` (the block sizes it is built for) is
:data:`.tuning.CUDA_COMMIT_ROWS`.
"""

from __future__ import annotations

import torch

from . import cuda_window
from .plan import CommitPlan, CommitTables
from .tuning import CUDA_COMMIT_ROWS as ROWS_PER_BLOCK


def applies(state: torch.Tensor, kg: torch.Tensor, lower_bound: float | None,
            tables: CommitTables, index_tensors: tuple[torch.Tensor | None, ...]) -> bool:
    """Whether a commit over these pools can run on the CUDA kernel (without building it)."""
    return (lower_bound is not None and tables.aligned
            and cuda_window.library_serves(state, kg.dtype, kg.shape[2], index_tensors))


MIN_COLUMNS = 8
"""Window length (S + 1) from which the CUDA commit is preferred: it shares each record's
key norm and decay over a block's rows, which pays off only with many tokens accepted
(``python -m vllm_recoverssm.bench.tune --ops commit_all,commit_2``; timings in
``docs/results.md``)."""
MIN_PROGRAMS = 1024
"""(request, layer, head) triples from which the CUDA commit is preferred: a batch of 32 with
one layer of 32 heads, or any batch with the 34 layers of GLM-5.3. Below it the Triton
commit was level or faster (timings in ``docs/results.md``)."""


def preferred(ncols: int, programs: int) -> bool:
    """Whether the CUDA commit is the faster for windows of ``ncols`` tokens over
    ``programs`` (request, layer, head) triples (see :data:`MIN_COLUMNS`)."""
    return ncols >= MIN_COLUMNS and programs >= MIN_PROGRAMS


def rows_per_block(rows: int, layer_heads: int) -> int:
    """Rows per block for ``rows`` requests over ``layer_heads`` (layer, head) pairs.

    Short blocks fill the SMs at small batches; at large ones longer blocks share their
    per-block record work over more rows, so the commit takes 32 rows wherever
    :func:`preferred` takes it (timings in ``docs/results.md``).
    """
    return 16 if rows * layer_heads < MIN_PROGRAMS else 32


def launch(tables: CommitTables, A_log: torch.Tensor, dt_bias: torch.Tensor,
           plan: CommitPlan, lower_bound: float, record_indices: torch.Tensor | None,
           ncols: int, rows: int) -> None:
    """One launch of the CUDA commit (arguments as :func:`.triton_kda.commit_triton`;
    ``A_log`` ``[L, H]`` and ``dt_bias`` ``[L, H, K]`` float32 and contiguous)."""
    lib = cuda_window.library()
    if lib is None:
        raise RuntimeError(f"the CUDA commit is unavailable: {cuda_window.unavailable_reason()}")
    if rows not in ROWS_PER_BLOCK:
        raise ValueError(f"argument 'rows': expected one of {ROWS_PER_BLOCK}, got {rows}")
    state0, kg0 = tables.states[0], tables.kg[0]
    _, H, _, _ = state0.shape
    L, N = len(tables.states), plan.num_rows
    if N == 0:
        return
    ptr = cuda_window.ptr
    stream = torch.cuda.current_stream(state0.device).cuda_stream
    err = lib.recoverssm_commit_launch(
        cuda_window.ACT_CODES[kg0.dtype], rows, N, L, H, ncols, float(lower_bound),
        tables.state_ptrs.data_ptr(), tables.state_strides.data_ptr(),
        tables.corr_ptrs.data_ptr(), tables.corr_strides.data_ptr(),
        tables.kg_ptrs.data_ptr(), tables.kg_strides.data_ptr(),
        A_log.data_ptr(), dt_bias.data_ptr(), plan.state_indices.data_ptr(),
        plan.commit_lens.data_ptr(), ptr(plan.final_indices), ptr(plan.boundary_indices),
        ptr(plan.boundary_lens), ptr(record_indices), stream,
    )
    if err:
        raise RuntimeError(f"CUDA commit launch failed: cudaError {err}")
