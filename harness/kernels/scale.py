"""The fused scale (step 5 of the layer): out[t] = sum_j gate[t, j] * y[pos[t, j]].

One Triton kernel instead of a gather, a product and a sum (three kernels and a [T, k, N]
temporary). Program (t, c) reads the k rows of token t in column block c, multiplies by the gate
weights and accumulates in float32, then stores one row block of out in out's dtype. Memory
traffic: k*T*N elements read, T*N written, plus the [T, k] indices and weights.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _scale_kernel(
    y_ptr,
    pos_ptr,
    gate_ptr,
    out_ptr,
    N,
    K_SLOTS: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    t = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask = cols < N
    acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
    for j in tl.static_range(K_SLOTS):
        p = tl.load(pos_ptr + t * K_SLOTS + j).to(tl.int64)
        g = tl.load(gate_ptr + t * K_SLOTS + j)
        v = tl.load(y_ptr + p * N + cols, mask=mask, other=0.0)
        acc += g * v.to(tl.float32)
    tl.store(out_ptr + t.to(tl.int64) * N + cols, acc.to(out_ptr.dtype.element_ty), mask=mask)


def block_n(n: int) -> int:
    """Columns per program: the row up to 2048 elements (power of two)."""
    return min(triton.next_power_of_2(max(n, 16)), 2048)


def launch_scale(y: torch.Tensor, pos: torch.Tensor, gate: torch.Tensor, out: torch.Tensor):
    """out [T, N] = sum_j gate[t, j] * y[pos[t, j]]; y [S, N] contiguous, pos [T, k] int32/64,
    gate [T, k] float32, all on one device. Shapes are checked by harness.scale.Scaler."""
    T, k = pos.shape
    N = y.shape[1]
    if T == 0:
        return out
    bn = block_n(N)
    _scale_kernel[(T, triton.cdiv(N, bn))](
        y, pos, gate, out, N, K_SLOTS=k, BLOCK_N=bn, num_warps=4 if bn <= 1024 else 8
    )
    return out
