"""The fused scale (step 5 of the layer): out[t] = sum_j gate[t, j] * y[pos[t, j]].

One Triton kernel instead of a gather, a product and a sum (three kernels and a [T, k, N]
temporary). Program (b, c) reads the k rows of BLOCK_T tokens in column block c, multiplies by
the gate weights and accumulates in float32, then stores a [BLOCK_T, BLOCK_N] block of out in
out's dtype. Memory traffic: k*T*N elements read, T*N written, plus the [T, k] indices and
weights. Several tokens per program give each thread several independent row loads in flight
(the rows are gathered: pos is a permutation). ScaleConfig picks (BLOCK_T, BLOCK_N, warps);
benchmarks.scale_bound measures every variant in VARIANTS against the memory bound.

Persistent variants (ScaleConfig.per_sm > 0, names "p_..."): per_sm programs per SM loop over
the [BLOCK_T, BLOCK_N] tiles, and each loads the next tile's indices and weights before it
gathers the current tile's rows (all k rows of the tile in one [BLOCK_T, KP, BLOCK_N] load), so
the index load's latency no longer precedes every row load.
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
    per_sm: int = 0  # > 0: the persistent kernel, per_sm programs per SM


#: the variants the benchmark measures (the first is the one-token kernel this file started with)
VARIANTS: dict[str, ScaleConfig] = {
    "t1_n2048_w8": ScaleConfig(1, 2048, 8),
    "t2_n1024_w4": ScaleConfig(2, 1024, 4),
    "t4_n1024_w8": ScaleConfig(4, 1024, 8),
    "t4_n512_w4": ScaleConfig(4, 512, 4),
    "t8_n512_w8": ScaleConfig(8, 512, 8),
    "t8_n256_w4": ScaleConfig(8, 256, 4),
    "t16_n256_w8": ScaleConfig(16, 256, 8),
    "p_t1_n2048_w8": ScaleConfig(1, 2048, 8, per_sm=8),
    "p_t2_n1024_w4": ScaleConfig(2, 1024, 4, per_sm=16),
    "p_t4_n512_w4": ScaleConfig(4, 512, 4, per_sm=16),
    "p_t4_n1024_w8": ScaleConfig(4, 1024, 8, per_sm=8),
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


@triton.jit
def _scale_persistent_kernel(
    y_ptr,
    pos_ptr,
    gate_ptr,
    out_ptr,
    T,
    N,
    K_SLOTS: tl.constexpr,
    KP: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    """The same sum, tiles visited by a grid-stride loop; tile i = (token block i // NB, column
    block i % NB). The next tile's pos / gate [BLOCK_T, KP] load before this tile's rows."""
    nb = tl.cdiv(N, BLOCK_N)
    n_tiles = tl.cdiv(T, BLOCK_T) * nb
    kk = tl.arange(0, KP)
    kmask = kk < K_SLOTS
    tile = tl.program_id(0)
    t = (tile // nb) * BLOCK_T + tl.arange(0, BLOCK_T)
    pk = (t < T)[:, None] & kmask[None, :] & (tile < n_tiles)
    idx = t.to(tl.int64)[:, None] * K_SLOTS + kk[None, :]
    p = tl.load(pos_ptr + idx, mask=pk, other=0).to(tl.int64)
    g = tl.load(gate_ptr + idx, mask=pk, other=0.0)
    while tile < n_tiles:
        t = (tile // nb) * BLOCK_T + tl.arange(0, BLOCK_T)
        cols = (tile % nb) * BLOCK_N + tl.arange(0, BLOCK_N)
        tmask = t < T
        cmask = cols < N
        # the next tile's indices and weights, in flight while this tile's rows load
        nxt = tile + tl.num_programs(0)
        tn = (nxt // nb) * BLOCK_T + tl.arange(0, BLOCK_T)
        pkn = (tn < T)[:, None] & kmask[None, :] & (nxt < n_tiles)
        idxn = tn.to(tl.int64)[:, None] * K_SLOTS + kk[None, :]
        p_next = tl.load(pos_ptr + idxn, mask=pkn, other=0).to(tl.int64)
        g_next = tl.load(gate_ptr + idxn, mask=pkn, other=0.0)
        vmask = (tmask[:, None] & kmask[None, :])[:, :, None] & cmask[None, None, :]
        v = tl.load(y_ptr + p[:, :, None] * N + cols[None, None, :], mask=vmask, other=0.0)
        acc = tl.sum(v.to(tl.float32) * g[:, :, None], axis=1)
        rows = t.to(tl.int64)[:, None] * N
        omask = tmask[:, None] & cmask[None, :]
        tl.store(out_ptr + rows + cols[None, :], acc.to(out_ptr.dtype.element_ty), mask=omask)
        p, g, tile = p_next, g_next, nxt


def config_for(n: int, variant: str | None = None) -> ScaleConfig:
    """The variant asked for (default DEFAULT), its column block capped at N's power of two."""
    cfg = VARIANTS[variant or DEFAULT]
    bn = min(cfg.block_n, next_power_of_2(max(n, 16)))
    return ScaleConfig(cfg.block_t, bn, cfg.num_warps, cfg.per_sm)


_SMS: dict[int, int] = {}


def _programs(device: torch.device, per_sm: int, tiles: int) -> int:
    """Programs of a persistent launch: per_sm per SM (4 per_sm on the CPU interpreter), at
    most one per tile."""
    if device.type != "cuda":
        return max(1, min(tiles, 4 * per_sm))
    i = device.index if device.index is not None else torch.cuda.current_device()
    if i not in _SMS:
        _SMS[i] = torch.cuda.get_device_properties(i).multi_processor_count
    return max(1, min(tiles, _SMS[i] * per_sm))


def launch_scale(
    y: torch.Tensor,
    pos: torch.Tensor,
    gate: torch.Tensor,
    out: torch.Tensor,
    variant: str | None = None,
) -> torch.Tensor:
    """out [T, N] = sum_j gate[t, j] * y[pos[t, j]]; y [S, N] contiguous, pos [T, k] int32/64,
    gate [T, k] float32, all on one device. Shapes are checked by harness.scale.Scaler."""
    T, k = pos.shape
    N = y.shape[1]
    if T == 0:
        return out
    cfg = config_for(N, variant)
    grid = (cdiv(T, cfg.block_t), cdiv(N, cfg.block_n))
    kw = dict(K_SLOTS=k, BLOCK_T=cfg.block_t, BLOCK_N=cfg.block_n, num_warps=cfg.num_warps)
    if cfg.per_sm:
        grid = (_programs(y.device, cfg.per_sm, grid[0] * grid[1]),)
        kw["KP"] = next_power_of_2(k)
        launch_cached(_scale_persistent_kernel, grid, (y, pos, gate, out, T, N), kw)
        return out
    launch_cached(_scale_kernel, grid, (y, pos, gate, out, T, N), kw)  # remembered on a GPU
    return out
