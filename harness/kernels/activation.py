"""GELU (erf form) in place over the first n rows of a [P, F] activation, n on the device.

The overlap layer's fc1 output is sized for the most rows any step can receive (its plan is built
before the dispatch's host sync) and only its first n_padded rows are real: torch's gelu would
touch every row. Programs whose rows start at or past n return at once. float32 math, stored in
h's dtype, as torch's bf16/fp16 gelu.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from harness.kernels.ints import cdiv, next_power_of_2
from harness.kernels.relaunch import launch_cached

ELEMS = 4096  # elements per program: rows x columns, columns as wide as F up to 2048


@triton.jit
def gelu_erf(v):
    """GELU, erf form, of float32 v (the activation's one formula; the producer's fc1 epilogue
    uses it too)."""
    return 0.5 * v * (1.0 + tl.math.erf(v * 0.7071067811865476))


@triton.jit
def _gelu_rows_kernel(h, n_ptr, F, BR: tl.constexpr, BF: tl.constexpr):
    n = tl.load(n_ptr)
    r0 = tl.program_id(0).to(tl.int64) * BR
    if r0 < n:
        rows = r0 + tl.arange(0, BR)
        cols = tl.program_id(1) * BF + tl.arange(0, BF)
        m = (rows[:, None] < n) & (cols[None, :] < F)
        at = h + rows[:, None] * F + cols[None, :]
        v = tl.load(at, mask=m, other=0.0).to(tl.float32)
        tl.store(at, gelu_erf(v).to(h.dtype.element_ty), mask=m)


def blocks(F: int) -> tuple[int, int]:
    """(rows, columns) per program for width F (2 x 2048 measured fastest at F=2048 on an H200:
    docs/measurements.md)."""
    bf = min(2048, next_power_of_2(F))
    return max(1, ELEMS // bf), bf


def gelu_rows_(h: torch.Tensor, n_rows: torch.Tensor) -> torch.Tensor:
    """h [P, F] contiguous, n_rows a 1-element int device tensor (<= P): rows [0, n) of h
    become gelu(h) in place, rows past n are left as they are. Returns h. One launch of
    [P / br, F / bf] programs, (br, bf) = blocks(F)."""
    if h.dim() != 2 or not h.is_contiguous():
        raise ValueError(f"gelu_rows_: a contiguous [P, F] tensor, got {tuple(h.shape)}")
    P, F = h.shape
    if P == 0 or F == 0:
        return h
    br, bf = blocks(F)
    args = (h, n_rows.reshape(1), F)
    launch_cached(_gelu_rows_kernel, (cdiv(P, br), cdiv(F, bf)), args, dict(BR=br, BF=bf))
    return h
