"""The CUDA commit (``csrc/kda_commit.cu``): every layer's accepted tokens in one launch.

It is written to give :func:`.triton_kda.commit_triton`'s states bit for bit (the same
instructions for the gate, the key norm and the update; a ``gpu`` test compares them), and
reads the same per-layer address tables (:class:`.triton_kda.CommitTables`).
:func:`.triton_kda.commit_kernel` takes it where :func:`preferred` says it was the faster
on an H200. It lives in the library of :mod:`.cuda_window` and applies where that builds,
for K = V = 128, a bounded gate, bfloat16 or float32 records, int32 indices and 16-byte
aligned pools.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from . import cuda_window
from .api import CommitPlan

if TYPE_CHECKING:
    from .triton_kda import CommitTables

ROWS_PER_BLOCK = (16, 32, 64)
"""State rows one block of the kernel replays (of one request, layer and head)."""


def applies(state: torch.Tensor, kg: torch.Tensor, lower_bound: float | None,
            tables: CommitTables, index_tensors: tuple[torch.Tensor | None, ...]) -> bool:
    """Whether a commit over these pools can run on the CUDA kernel (without building it)."""
    return (lower_bound is not None and tables.aligned
            and cuda_window.library_serves(state, kg.dtype, kg.shape[2], index_tensors))


MIN_COLUMNS = 8
"""Window length (S + 1) from which the CUDA commit is preferred. On an H200 (``python -m
vllm_recoverssm.bench.tune --ops commit_all,commit_2``, 2026-12-05), with all 8 tokens of
S = 7 accepted it took 0.85-0.88 of the Triton commit's time at a batch of 128-256
(32 heads, one layer), from sharing each record's key norm and decay over a block's rows;
with 2 accepted 1.005-1.017; at S = 3 it was nowhere faster (1.00-1.13)."""
MIN_PROGRAMS = 1024
"""(request, layer, head) triples from which the CUDA commit is preferred: a batch of 32 with
one layer of 32 heads, or any batch with the 34 layers of GLM-5.3. On an H100 with the
blocks launched heads before requests (``python -m vllm_recoverssm.bench.tune --ops
commit_all,commit_2 --batch 16,32,48,64``, 2026-12-06,
docs/bench/h100-2026-12-06-commit-tune.txt), S = 7 at 32 rows took 0.86-0.91 of the Triton
commit's time with all 8 tokens accepted from a batch of 32 and 1.01 with 2; at a batch of
16 (512 triples) 0.95-0.97 and 1.03-1.06, and at a batch of 8
(h100-2026-12-06-grid-order.txt, 16 rows) 1.04 and 1.11. (On an H200 with requests first,
2026-12-05, the threshold was 4096: there the CUDA commit took 1.04-1.16 of the time with 2
accepted at a batch of 8-32.)"""


def preferred(ncols: int, programs: int) -> bool:
    """Whether the CUDA commit is the faster for windows of ``ncols`` tokens over
    ``programs`` (request, layer, head) triples (see :data:`MIN_COLUMNS`)."""
    return ncols >= MIN_COLUMNS and programs >= MIN_PROGRAMS


def rows_per_block(rows: int, layer_heads: int) -> int:
    """Rows per block for ``rows`` requests over ``layer_heads`` (layer, head) pairs.

    Short blocks fill the SMs at small batches; at large ones longer blocks share their
    per-block record work over more rows (H200, S = 7, one layer of 32 heads: 32 rows took
    0.85 / 0.88 of the Triton commit's time at a batch of 128 / 256, 16 rows 0.90 / 0.94,
    64 rows 0.93). On an H100 with heads before requests, at a batch of 32, 16 rows were 3%
    faster with all 8 tokens accepted and 4% slower with 2; from 48, 32 rows were level or
    faster, so the commit takes 32 rows wherever :func:`preferred` takes it.
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
