"""Device code of harness/dispatch_peer.py (docs/method.md, "The host-free dispatch across
processes"): rows and counts through [W] int64 address tables of the peers' memory, with the
overlap system's release atomics; one code path for shm (Triton's interpreter), p2p and nvshmem.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from harness.kernels.ints import cdiv, next_power_of_2

BR = 16  # rows per program of gather / put


@triton.jit
def _publish_kernel(counts, slot, count_ptrs, signal_ptrs, rank, W, C, BC: tl.constexpr):
    """Program d: counts [W, C] row d -> destination d's region [2W, C] at row slot*W + rank."""
    d = tl.program_id(0)
    cols = tl.arange(0, BC)
    row = (tl.load(slot) * W + rank).to(tl.int64)
    dst = tl.load(count_ptrs + d).to(tl.pointer_type(tl.int64)) + row * C
    tl.store(dst + cols, tl.load(counts + d * C + cols, mask=cols < C), mask=cols < C)
    tl.debug_barrier()
    sig = tl.load(signal_ptrs + d).to(tl.pointer_type(tl.int64)) + rank
    tl.atomic_add(sig, 1, sem="release", scope="sys")


@triton.jit
def _gather_kernel(out, src, rows, n_rows, row_ptrs, H, BR: tl.constexpr, BH: tl.constexpr):
    """out [B, H]: row i = row rows[i] of the region of source src[i] (i < n_rows)."""
    i = tl.program_id(0) * BR + tl.arange(0, BR)
    ok = i < tl.load(n_rows)
    s = tl.load(src + i, mask=ok, other=0)
    r = tl.load(rows + i, mask=ok, other=0).to(tl.int64)
    base = tl.load(row_ptrs + s, mask=ok, other=0).to(tl.pointer_type(out.dtype.element_ty))
    for c in range(0, H, BH):
        cols = c + tl.arange(0, BH)
        m = ok[:, None] & (cols[None, :] < H)
        v = tl.load(base[:, None] + r[:, None] * H + cols[None, :], mask=m)
        tl.store(out + i[:, None].to(tl.int64) * H + cols[None, :], v, mask=m)


@triton.jit
def _put_kernel(
    y, dst, at, n_rows, row_ptrs, signal_ptrs, rank, W, H, BR: tl.constexpr, BH: tl.constexpr
):
    """Row i of y [B, H] to row at[i] of owner dst[i]'s region (i < n_rows); then, per owner,
    its counter[rank] += this program's rows there (release: the rows before the count)."""
    i = tl.program_id(0) * BR + tl.arange(0, BR)
    ok = i < tl.load(n_rows)
    d = tl.load(dst + i, mask=ok, other=0)
    r = tl.load(at + i, mask=ok, other=0).to(tl.int64)
    base = tl.load(row_ptrs + d, mask=ok, other=0).to(tl.pointer_type(y.dtype.element_ty))
    for c in range(0, H, BH):
        cols = c + tl.arange(0, BH)
        m = ok[:, None] & (cols[None, :] < H)
        v = tl.load(y + i[:, None].to(tl.int64) * H + cols[None, :], mask=m)
        tl.store(base[:, None] + r[:, None] * H + cols[None, :], v, mask=m)
    tl.debug_barrier()
    for o in range(W):
        n = tl.sum((ok & (d == o)).to(tl.int64))
        if n > 0:
            sig = tl.load(signal_ptrs + o).to(tl.pointer_type(tl.int64)) + rank
            tl.atomic_add(sig, n, sem="release", scope="sys")


def publish(counts: torch.Tensor, slot: torch.Tensor, count_ptrs, signal_ptrs, rank: int):
    """counts [W, C] int64 (row d for destination d); slot [1] int64 on the device (0 or 1)."""
    W, C = counts.shape
    args = (counts, slot, count_ptrs, signal_ptrs, rank, W, C)
    _publish_kernel[(W,)](*args, BC=next_power_of_2(C), num_warps=1)


def _bh(H: int) -> int:
    return min(next_power_of_2(H), 256)


def gather(out: torch.Tensor, src, rows, n_rows, row_ptrs) -> torch.Tensor:
    """out [B, H] <- the peers' rows (src, rows [B] int64; n_rows [1] int64 on the device)."""
    B, H = out.shape
    if B:
        _gather_kernel[(cdiv(B, BR),)](out, src, rows, n_rows, row_ptrs, H, BR=BR, BH=_bh(H))
    return out


def put(y: torch.Tensor, dst, at, n_rows, row_ptrs, signal_ptrs, rank: int) -> None:
    """y [B, H] rows i < n_rows to (owner dst[i], row at[i]), counted at each owner."""
    B, H = y.shape
    W = row_ptrs.numel()
    if B:
        args = (y, dst, at, n_rows, row_ptrs, signal_ptrs, rank, W, H)
        _put_kernel[(cdiv(B, BR),)](*args, BR=BR, BH=_bh(H))
