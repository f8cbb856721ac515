"""The producer (docs/method.md, Stage B: Producer, Flags): ONE persistent Triton GEMM per rank
over all local experts, with readiness flags.

x [P, K] the padded GEMM input X, weights [E, K, N] (contiguous; expert e's K rows are e*K ..
e*K+K-1 of the [E*K, N] view), y [P, N]. Tile t = s * tiles_n + n (schedule position s, column
tile n; band-major: the first scheduled band finishes first), unless swizzled (group_m positions,
or the plan's `groups`); the plan's `visit` reorders the positions. Stores mask rows past
band_rows: a partial local band never writes the next expert's rows. band_ready[band] (int32)
grows by TileConfig.tile_increment per finished tile of a remote band (s < n_signal; the flag
modes' ordering at the kernel's release). Loads: TMA (USE_TMA; K % block_k == 0, so a K tile
never crosses experts) or masked pointers (any K). The store is a masked tl.store, never TMA:
the flag cannot overtake it.
"""

from __future__ import annotations

from typing import Any

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from harness.kernels.activation import gelu_erf
from harness.kernels.relaunch import LaunchMemo
from systems.overlap import modes
from systems.overlap.kernels.primitives import publish_threads
from systems.overlap.modes import FLAG_CODES, FLAG_NONE, GROUP_CODE
from systems.overlap.tuning import TileConfig

_FLAG_CTA = tl.constexpr(modes.FLAG_CTA)
_FLAG_THREAD = tl.constexpr(modes.FLAG_THREAD)
_FLAG_DEFERRED = tl.constexpr(modes.FLAG_DEFERRED)


@triton.jit
def _tile_coords(t, n_sched, tiles_n, GROUP_M: tl.constexpr):
    """Tile id t -> (schedule position s, column tile pn); grouped by GROUP_M positions."""
    if GROUP_M == 1:
        s = t // tiles_n
        pn = t % tiles_n
    else:
        per_group = GROUP_M * tiles_n
        first = (t // per_group) * GROUP_M
        size = tl.minimum(n_sched - first, GROUP_M)
        local = t % per_group
        s = first + local % size
        pn = local // size
    return s, pn


@triton.jit
def _group_coords(t, tiles_n, groups, CODE: tl.constexpr):
    """Tile id t -> (visiting position s, column tile pn) with the swizzle groups of
    plan.producer_groups: group [first, first + size) owns tiles first * tiles_n ..
    (first + size) * tiles_n - 1, walked column-major."""
    g = tl.load(groups + t // tiles_n)
    first = g // CODE
    size = g % CODE
    local = t - first * tiles_n
    return first + local % size, local // size


@triton.jit
def _store_cols(vals, row_ptr, row_ok, c0, N, W: tl.constexpr):
    """vals [BM, W] to row_ptr[i] + c0 + j for the rows with row_ok [BM] and columns < N."""
    cols = c0 + tl.arange(0, W)
    tl.store(row_ptr[:, None] + cols[None, :], vals, mask=row_ok[:, None] & (cols[None, :] < N))


@triton.jit
def _producer_kernel(
    x_desc,
    w_desc,
    x_ptr,
    w_ptr,
    y_ptr,
    recv_ptr,
    row_dst,
    schedule,
    order,
    groups,
    band_expert,
    band_row,
    band_rows,
    band_ready,
    counts,
    N,
    K,
    num_progs,
    BM: tl.constexpr,
    BN: tl.constexpr,
    BK: tl.constexpr,
    GROUP_M: tl.constexpr,
    FLAG: tl.constexpr,
    NT: tl.constexpr,
    USE_TMA: tl.constexpr,
    FLATTEN: tl.constexpr,
    LOCAL_DIRECT: tl.constexpr,
    MIXED: tl.constexpr,
    ORDERED: tl.constexpr,
    EPI_SPLIT: tl.constexpr,
    EXPERT_GROUPS: tl.constexpr,
    GROUP_CODE: tl.constexpr,
    ACT: tl.constexpr,
):
    # the schedule length and the signalled prefix, from the plan's counts on the device
    n_sched = tl.load(counts + 2).to(tl.int32)
    n_signal = tl.load(counts + 3).to(tl.int32)
    pid = tl.program_id(0)
    tiles_n = tl.cdiv(N, BN)
    num_tiles = n_sched * tiles_n
    k_tiles = tl.cdiv(K, BK)
    rm = tl.arange(0, BM)
    rn = tl.arange(0, BN)
    rk = tl.arange(0, BK)
    lane = tl.arange(0, NT)
    pending = tl.full((), -1, tl.int32)  # FLAG 3: band of the previous tile still to publish
    for t in tl.range(pid, num_tiles, num_progs, flatten=FLATTEN):
        if EXPERT_GROUPS:
            s, pn = _group_coords(t, tiles_n, groups, GROUP_CODE)
        else:
            s, pn = _tile_coords(t, n_sched, tiles_n, GROUP_M)
        if ORDERED:  # the producer's visiting order of the schedule (the plan's visit)
            s = tl.load(order + s).to(tl.int32)  # int32 or int64 arrays
        band = tl.load(schedule + s)
        e = tl.load(band_expert + band)
        row0 = tl.load(band_row + band).to(tl.int32)
        nrows = tl.load(band_rows + band).to(tl.int32)
        col0 = pn * BN
        acc = tl.zeros((BM, BN), dtype=tl.float32)
        for kk in range(k_tiles):
            k0 = kk * BK
            if USE_TMA:
                a = x_desc.load([row0, k0])
                b = w_desc.load([(e * K + k0).to(tl.int32), col0])
            else:
                rows = row0 + rm
                ks = k0 + rk
                a = tl.load(
                    x_ptr + rows.to(tl.int64)[:, None] * K + ks[None, :],
                    mask=(rm[:, None] < nrows) & (ks[None, :] < K),
                    other=0.0,
                )
                cols = col0 + rn
                b = tl.load(
                    w_ptr + (e * K + ks).to(tl.int64)[:, None] * N + cols[None, :],
                    mask=(ks[:, None] < K) & (cols[None, :] < N),
                    other=0.0,
                )
            acc = tl.dot(a, b, acc)
        if FLAG == _FLAG_DEFERRED:
            # publish the PREVIOUS tile: its stores are a main loop old, so the release is cheap
            publish_threads(band_ready, pending, lane)
        rows = row0 + rm
        # per row: where it goes (a pointer to its first column) and whether it is stored
        row_ptr = y_ptr + rows.to(tl.int64) * N
        row_ok = rm < nrows
        if LOCAL_DIRECT:
            # local rows to recv, a local band's other rows nowhere (launch_producer's recv)
            if MIXED:
                dst = tl.load(row_dst + rows, mask=row_ok, other=-1)
            else:
                dst = tl.load(row_dst + rows, mask=row_ok & (s >= n_signal), other=-1)
            mine = dst >= 0
            row_ptr = tl.where(mine, recv_ptr + dst.to(tl.int64) * N, row_ptr)
            row_ok = row_ok & (mine | (s < n_signal))
        out = acc.to(y_ptr.dtype.element_ty)
        if ACT:  # fc1: GELU (erf) of the rounded output, as the reference rounds it
            out = gelu_erf(out.to(tl.float32)).to(out.dtype)
        if EPI_SPLIT == 1:
            _store_cols(out, row_ptr, row_ok, col0, N, BN)
        else:  # column halves (or quarters): fewer live pointers per thread; quarters convert
            # the accumulator's layout through 16 KB of shared memory instead of 64 KB
            h0, h1 = out.reshape(BM, 2, BN // 2).permute(0, 2, 1).split()
            if EPI_SPLIT == 2:
                _store_cols(h0, row_ptr, row_ok, col0, N, BN // 2)
                _store_cols(h1, row_ptr, row_ok, col0 + BN // 2, N, BN // 2)
            else:
                q0, q1 = h0.reshape(BM, 2, BN // 4).permute(0, 2, 1).split()
                _store_cols(q0, row_ptr, row_ok, col0, N, BN // 4)
                _store_cols(q1, row_ptr, row_ok, col0 + BN // 4, N, BN // 4)
                q2, q3 = h1.reshape(BM, 2, BN // 4).permute(0, 2, 1).split()
                _store_cols(q2, row_ptr, row_ok, col0 + BN // 2, N, BN // 4)
                _store_cols(q3, row_ptr, row_ok, col0 + 3 * (BN // 4), N, BN // 4)
        if FLAG == _FLAG_CTA:
            # one release per CTA (cumulative): the barrier orders all threads' stores before it
            if s < n_signal:
                tl.debug_barrier()
                tl.atomic_add(band_ready + band, 1, sem="release", scope="gpu")
        elif FLAG == _FLAG_THREAD:
            # one release per thread after its own stores (NT per tile), no barrier: a
            # tl.debug_barrier in the loop makes Triton 3.6 drop the flattened loop's pipelining
            tl.atomic_add(
                band_ready + band + lane * 0,
                lane * 0 + 1,
                mask=(lane * 0 + s) < n_signal,
                sem="release",
                scope="gpu",
            )
        elif FLAG == _FLAG_DEFERRED:
            pending = tl.where(s < n_signal, band.to(tl.int32), -1)
    if FLAG == _FLAG_DEFERRED:
        publish_threads(band_ready, pending, lane)


def producer_grid(sm_count: int, ccta: int) -> int:
    """Persistent grid of the producer: every SM but the consumer's cCTA."""
    if not 0 <= ccta < sm_count:
        raise ValueError(f"ccta={ccta} must be in [0, {sm_count})")
    return sm_count - ccta


def producer_input_args(x: torch.Tensor, config: TileConfig) -> dict:
    """The producer's arguments that carry its input x [P, K]: x_ptr, and x_desc where the
    tiles load through TMA (else None). A remembered launch (harness/kernels/relaunch.py)
    swaps these in for another x of the same shape, dtype and 16-byte alignment."""
    P, K = x.shape
    tma = config.use_tma and K % config.block_k == 0
    desc = TensorDescriptor(x, [P, K], [K, 1], [config.block_m, config.block_k]) if tma else None
    return {"x_ptr": x, "x_desc": desc}


def _check_operands(x, weights, y, band_ready) -> tuple[int, int, int, int]:
    """(P, K, E, N) of x [P, K], weights [E, K, N], y [P, N]: one dtype, contiguous, int32
    band_ready; else a one-line ValueError."""
    P, K = x.shape
    E, K2, N = weights.shape
    if K2 != K or y.shape != (P, N) or x.dtype != weights.dtype or y.dtype != x.dtype:
        raise ValueError(
            f"producer shapes: x {tuple(x.shape)} {x.dtype}, weights {tuple(weights.shape)} "
            f"{weights.dtype}, y {tuple(y.shape)} {y.dtype}"
        )
    if not (x.is_contiguous() and weights.is_contiguous() and y.is_contiguous()):
        raise ValueError("producer operands must be contiguous")
    if band_ready.dtype != torch.int32:
        raise ValueError("band_ready must be int32")
    return P, K, E, N


def launch_producer(
    x: torch.Tensor,
    weights: torch.Tensor,
    y: torch.Tensor,
    plan: Any,
    band_ready: torch.Tensor,
    *,
    num_programs: int,
    config: TileConfig,
    signal: bool = True,
    recv: torch.Tensor | None = None,
    memo: LaunchMemo | None = None,
    memo_key: Any = None,
    act: bool = False,
):
    """Launch the persistent producer on the current stream; returns Triton's compiled kernel.

    x [P, K], weights [E, K, N], y [P, N]: one dtype (fp16/bf16 on GPU, fp16/fp32 in the
    interpreter). plan: a CombinePlan on the device, possibly worst-case sized [B'] (the kernel
    reads n_bands / n_remote_bands from plan.counts). band_ready [B'] int32: + band_increment(N)
    per signalled band per run. num_programs: the grid (producer_grid). recv [S, N], this rank's
    receive buffer: local rows p (row_dst[p] >= 0; also in a compact plan's mixed band) go to
    recv[row_dst[p]] instead of y[p], a local band's other rows nowhere (None: all to y).
    memo (GPU): remember the launch under memo_key. act: y = gelu(x @ w_e) (fc1).
    """
    P, K, E, N = _check_operands(x, weights, y, band_ready)
    cfg = config
    if cfg.epi_split not in (1, 2, 4) or cfg.block_n % (2 * cfg.epi_split):
        raise ValueError(
            f"producer: epi_split must be 1, 2 or 4 and split block_n={cfg.block_n} "
            f"into even slices, got {cfg.epi_split}"
        )
    n_sched = plan.schedule.numel()
    if n_sched == 0:
        return None
    if cfg.expert_groups and (plan.groups is None or plan.group_cap != cfg.group_m):
        raise ValueError(
            f"producer: expert groups of {cfg.group_m} need a plan built with "
            f"group_cap={cfg.group_m}, got group_cap={plan.group_cap}"
        )
    x_desc = producer_input_args(x, cfg)["x_desc"]  # None: pointer loads
    w_desc = None
    if x_desc is not None:
        w2 = weights.view(E * K, N)
        w_desc = TensorDescriptor(w2, [E * K, N], [N, 1], [cfg.block_k, cfg.block_n])
    if recv is not None and (
        recv.dtype != y.dtype or recv.shape[1] != N or not recv.is_contiguous()
    ):
        raise ValueError(
            f"producer recv: {tuple(recv.shape)} {recv.dtype}, need [*, {N}] {y.dtype}"
        )
    grid = (max(1, min(num_programs, n_sched * cfg.tiles_n(N))),)
    unused = plan.schedule  # an argument the constexprs leave unread
    args = (x_desc, w_desc, x, weights, y, y if recv is None else recv, plan.row_dst)
    args += (plan.schedule, unused if plan.visit is None else plan.visit)
    args += (plan.groups if cfg.expert_groups else unused, plan.band_expert, plan.band_row)
    args += (plan.band_rows, band_ready, plan.counts, N, K, grid[0])
    meta = dict(BM=cfg.block_m, BN=cfg.block_n, BK=cfg.block_k, GROUP_M=cfg.group_m)
    meta |= dict(FLAG=FLAG_CODES[cfg.flag] if signal else FLAG_NONE, NT=32 * cfg.num_warps)
    meta |= dict(USE_TMA=x_desc is not None, FLATTEN=cfg.flatten, LOCAL_DIRECT=recv is not None)
    meta |= dict(MIXED=plan.layout == "compact", ORDERED=plan.visit is not None)
    meta |= dict(EPI_SPLIT=cfg.epi_split, EXPERT_GROUPS=cfg.expert_groups, GROUP_CODE=GROUP_CODE)
    meta |= dict(ACT=act, num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    compiled = _producer_kernel[grid](*args, **meta)
    if memo is not None:
        memo.remember(memo_key, _producer_kernel, grid, args, meta, compiled)
    return compiled
