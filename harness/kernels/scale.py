"""The fused scale (step 5 of the layer): out[t] = sum_j gate[t, j] * y[pos[t, j]].

One Triton kernel instead of a gather, a product and a sum (three kernels and a [T, k, N]
temporary); program (b, c) does BLOCK_T tokens x BLOCK_N columns, accumulating in float32.
benchmarks.scale_bound measures VARIANTS against the memory bound (docs/measurements.md).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from harness.kernels.ints import cdiv, next_power_of_2
from harness.kernels.relaunch import launch_cached


@dataclass(frozen=True)
class ScaleConfig:
    """Tokens per program, columns per program, warps per program."""

    block_t: int
    block_n: int
    num_warps: int


#: the variants the benchmark measures
VARIANTS: dict[str, ScaleConfig] = {
    "t1_n2048_w8": ScaleConfig(1, 2048, 8),
    "t2_n1024_w4": ScaleConfig(2, 1024, 4),
    "t4_n1024_w8": ScaleConfig(4, 1024, 8),
    "t4_n512_w4": ScaleConfig(4, 512, 4),
    "t8_n512_w8": ScaleConfig(8, 512, 8),
    "t8_n256_w4": ScaleConfig(8, 256, 4),
    "t16_n256_w8": ScaleConfig(16, 256, 8),
}
DEFAULT = "t1_n2048_w8"


@triton.jit
def _scale_kernel(
    y_ptr,
    pos_ptr,
    gate_ptr,
    out_ptr,
    T,
    N,
    K_SLOTS: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    tmask = t < T
    mask = tmask[:, None] & (cols < N)[None, :]
    acc = tl.zeros((BLOCK_T, BLOCK_N), dtype=tl.float32)
    for j in tl.static_range(K_SLOTS):
        p = tl.load(pos_ptr + t * K_SLOTS + j, mask=tmask, other=0).to(tl.int64)
        g = tl.load(gate_ptr + t * K_SLOTS + j, mask=tmask, other=0.0)
        v = tl.load(y_ptr + p[:, None] * N + cols[None, :], mask=mask, other=0.0)
        acc += g[:, None] * v.to(tl.float32)
    rows = t.to(tl.int64)[:, None] * N
    tl.store(out_ptr + rows + cols[None, :], acc.to(out_ptr.dtype.element_ty), mask=mask)


def launch_scale(
    y: torch.Tensor,
    pos: torch.Tensor,
    gate: torch.Tensor,
    out: torch.Tensor,
    variant: str | None = None,
) -> torch.Tensor:
    """out [T, N] = sum_j gate[t, j] * y[pos[t, j]]; y [S, N] contiguous, pos [T, k] int32/64,
    gate [T, k] float32, all on one device. Shapes are checked by harness.scale.Scaler.
    variant: a VARIANTS key (None: DEFAULT), its column block capped at N's power of two."""
    T, k = pos.shape
    N = y.shape[1]
    if T == 0:
        return out
    cfg = VARIANTS[variant or DEFAULT]
    bn = min(cfg.block_n, next_power_of_2(max(N, 16)))
    grid = (cdiv(T, cfg.block_t), cdiv(N, bn))
    kw = dict(K_SLOTS=k, BLOCK_T=cfg.block_t, BLOCK_N=bn, num_warps=cfg.num_warps)
    launch_cached(_scale_kernel, grid, (y, pos, gate, out, T, N), kw)  # remembered on a GPU
    return out
