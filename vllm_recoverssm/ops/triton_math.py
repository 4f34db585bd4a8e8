"""Triton helpers shared by every kernel: the dtype table, the gate, the key norm, one update.

Commit, the full-state verify and the fused verify all rebuild states from the same
records, and a commit is bit-for-bit equal to the full-state column only if each of them
computes the normalised key and the decay with the same bits. Element-wise code is the
same wherever it is compiled; a sum over K is not, because Triton picks the reduction
tree from the tensor layout, which follows the tile. So the sum of squares behind every
key norm is taken in float64: the squares of bf16 (or fp32) inputs are exact there, the
sum of 128 of them is exact for bf16 inputs and within 2^-53 for fp32 ones, and rounding
it once to fp32 gives the same value in any order. Kernels with different tiles then agree
to the last bit.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

TL_DTYPES = {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16, torch.float32: tl.float32}
"""Torch dtypes the kernels read and write, with their Triton names."""


@triton.jit
def gate(raw_g, a_coef, dt_bias, LOWER_BOUND: tl.constexpr, BOUNDED: tl.constexpr):
    """Log-decay ``g`` (DESIGN.md section 2): bounded sigmoid gate or ``-a*softplus``."""
    x = raw_g + dt_bias
    if BOUNDED:
        g = LOWER_BOUND * tl.sigmoid(a_coef * x)
    else:
        # softplus with the usual linear tail for large inputs (no overflow in exp)
        sp = tl.where(x > 20.0, x, tl.log(1.0 + tl.exp(tl.minimum(x, 20.0))))
        g = -a_coef * sp
    return g


@triton.jit
def sumsq(x):
    """Sum of squares of a 1-D fp32 vector, taken in float64 (order-independent)."""
    x64 = x.to(tl.float64)
    return tl.sum(x64 * x64, axis=0)


@triton.jit
def unit(x, EPS: tl.constexpr):
    """``x / sqrt(sum(x*x) + eps)`` for a 1-D fp32 vector (see the module docstring)."""
    return x / tl.sqrt(sumsq(x).to(tl.float32) + EPS)


@triton.jit
def apply_record(s, c, raw_k, raw_g, live, a_coef, dt_bias, LOWER_BOUND: tl.constexpr,
                 BOUNDED: tl.constexpr, EPS: tl.constexpr):
    """One recorded token: ``S = S * diag(a) + outer(c, k^)``, or ``S`` if not ``live``.

    ``s`` is ``[BV, K]``, ``c`` ``[BV]``, ``raw_k`` / ``raw_g`` ``[K]`` fp32. A token that is
    not live must come with ``c`` and ``raw_k`` loaded as zeros: its decay is forced to 1,
    so the update is exactly the identity and the caller can unroll over every column
    with masked loads issued up front instead of branching per token. The decay and the
    fma are two rounding steps, written out so that no compiler contracts them
    differently in two kernels.
    """
    khat = unit(raw_k, EPS)
    a = tl.where(live, tl.exp(gate(raw_g, a_coef, dt_bias, LOWER_BOUND, BOUNDED)), 1.0)
    s = s * a[None, :]
    return tl.fma(c[:, None], khat[None, :], s)
