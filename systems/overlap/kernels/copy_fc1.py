"""dispatch_overlap's kernels: the dispatch's copy into fc1's padded input, and fc1 + GELU.

One Triton kernel in three modes, each launched as a persistent grid whose programs draw work
items from their own ticket (an atomic counter), in the plan's visiting order:
  COPIES (MODE 1)        an item copies one column chunk (CK columns) of one band (tile_m rows
                         of one (source rank, local expert) block of stage A's layout) from the
                         received rows into fc1's padded input, SUB rows a step, then adds 1 to
                         the band's arrival counter (release). No tile code is compiled in: a
                         small CTA (few registers, no shared memory) that fits on an SM beside
                         a tile CTA.
  WAITING_TILES (MODE 3) an item is one fc1 tile (a band x BN columns, the K loop, GELU in the
                         epilogue); it first waits, bounded, until its band's counter holds all
                         C chunks.
  TILES (MODE 2)         the same tiles without waits (fc1 alone, on input already copied).
dispatch_overlap launches COPIES and WAITING_TILES at once on two streams, both on every SM.
The copies never wait, so they finish as long as a copy CTA always finds room on some SM: the
host checks that one fits beside the tile CTAs an SM can hold (systems/overlap/runner.py
residency_report) before it launches them side by side. The band's completing chunk writes its
place in the arrival order (1, 2, ...) to places[band]: with one copy program the places follow
the visiting order, which a test reads.

Operands: src [S, K] (the played ranks' stacked tokens), rows [R] (received row r is
src[rows[r]]), x [P', K] (fc1's padded input), w [E, K, N], h [P', N] (gelu(x @ w_e); rows past
a band's band_rows never written), the plan's gather_index, schedule, visit (None: the
schedule's order), band_expert, band_row, band_rows, band_dst (a band's source rank), counts;
sync int32 [2 * B' + 3]: the bands' arrival counters [0, B'), their places [B', 2B'), the
copies' ticket, the place ticket, the tiles' ticket (zeroed by the host before every run, one
memset: a CUDA graph replays one fixed target). Padding rows (gather_index -1) are copied as
zeros. On the GPU the tiles load x and the weights through TMA: x was stored by other
programs' generic stores, so both sides fence the async proxy (after the stores, after the
acquire).
"""

from __future__ import annotations

from typing import Any

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from systems.overlap import errors
from systems.overlap.kernels.primitives import record_error, spin_until

_ARRIVAL_TIMEOUT = tl.constexpr(errors.CODE_ARRIVAL_TIMEOUT)
#: MODE: the copies, fc1's tiles without waits, fc1's tiles each waiting for its band's copies
COPIES, TILES, WAITING_TILES = 1, 2, 3
#: rows of one copy step (few registers per thread)
SUB_ROWS = 32


@triton.jit
def _proxy_fence():
    """fence.proxy.async.global: orders this thread's generic-proxy accesses of global memory
    with the async proxy's (TMA): a TMA load of rows another program stored needs it on both
    sides (after the stores, after the acquire)."""
    tl.inline_asm_elementwise(
        "fence.proxy.async.global; mov.u32 $0, 0;", "=r", [], dtype=tl.int32, is_pure=False,
        pack=1,
    )  # fmt: skip


@triton.jit
def _copy_chunk(src, rows, x, gather_index, row0, nrows, c0, K, sync, band, C, n_band,
                BM: tl.constexpr, CK: tl.constexpr, SUB: tl.constexpr,
                X_TMA: tl.constexpr):  # fmt: skip
    """x[p, c0:c0+CK] = src[rows[gather_index[p]], c0:c0+CK] for the band's rows p (zeros for
    padding rows), SUB rows a step (few registers: the CTA must fit beside a tile's), then the
    band's arrival counter + 1 (release); the band's last chunk draws its place."""
    cols = c0 + tl.arange(0, CK)
    mk = cols[None, :] < K
    for r in tl.static_range(0, BM, SUB):
        rm = r + tl.arange(0, SUB)
        p = row0 + rm
        m = rm < nrows
        gi = tl.load(gather_index + p, mask=m, other=-1)
        ok = gi >= 0
        si = tl.load(rows + tl.where(ok, gi, 0), mask=ok, other=0).to(tl.int64)
        val = tl.load(src + si[:, None] * K + cols[None, :], mask=ok[:, None] & mk, other=0.0)
        tl.store(x + p[:, None] * K + cols[None, :], val, mask=m[:, None] & mk)
    if X_TMA:
        _proxy_fence()
    # every thread's stores issued, then ONE release (a scalar atomic runs once per CTA;
    # release is cumulative over what the barrier ordered before it)
    tl.debug_barrier()
    done = tl.atomic_add(sync + band, 1, sem="release", scope="gpu") + 1
    if done == C:
        place = tl.atomic_add(sync + 2 * n_band + 1, 1, sem="relaxed", scope="gpu") + 1
        tl.store(sync + n_band + band, place)


@triton.jit
def _fc1_tile(x, x_desc, w, w_desc, h, e, row0, nrows, col0, K, N,
              BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, ACT: tl.constexpr,
              USE_TMA: tl.constexpr, X_TMA: tl.constexpr):  # fmt: skip
    """h[row0 + i, col0 + j] = gelu(x[row0 + i] @ w[e][:, col0 + j]) for i < nrows, j < BN."""
    rm = tl.arange(0, BM)
    rk = tl.arange(0, BK)
    cols = col0 + tl.arange(0, BN)
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    for k0 in range(0, K, BK):
        ks = k0 + rk
        if X_TMA:
            a = x_desc.load([row0.to(tl.int32), k0])
        else:
            a_mask = (rm[:, None] < nrows) & (ks[None, :] < K)
            a = tl.load(x + (row0 + rm)[:, None] * K + ks[None, :], mask=a_mask, other=0.0)
        if USE_TMA:
            b = w_desc.load([(e * K + k0).to(tl.int32), col0])
        else:
            b_mask = (ks[:, None] < K) & (cols[None, :] < N)
            b = tl.load(w + (e * K + ks).to(tl.int64)[:, None] * N + cols[None, :], mask=b_mask)
        acc = tl.dot(a, b, acc)
    out = acc.to(h.dtype.element_ty)
    if ACT:  # GELU (erf) of the rounded fc1 output, as the reference rounds it
        g = out.to(tl.float32)
        out = (0.5 * g * (1.0 + tl.math.erf(g * 0.7071067811865476))).to(out.dtype)
    mask = (rm[:, None] < nrows) & (cols[None, :] < N)
    tl.store(h + (row0 + rm)[:, None] * N + cols[None, :], out, mask=mask)


@triton.jit
def _band(v, order, schedule, band_row, band_rows, ORDERED: tl.constexpr):
    """Visiting position v -> (band, its first row, its rows)."""
    s = v
    if ORDERED:  # fc1's visiting order of the schedule (the plan's visit)
        s = tl.load(order + v).to(tl.int32)
    band = tl.load(schedule + s)
    return band, tl.load(band_row + band).to(tl.int64), tl.load(band_rows + band).to(tl.int32)


@triton.jit
def _wait_band(sync, band, C, e, band_dst, err, clock, timeout, max_spins, rank, pid,
               USE_TIMER: tl.constexpr, X_TMA: tl.constexpr):  # fmt: skip
    """Bounded wait until the band's C chunks have landed; a time-out is an error record."""
    status, seen = spin_until(
        sync + band, C, err, clock + pid, timeout, max_spins, "gpu", USE_TIMER
    )
    if status == 1:
        source = tl.load(band_dst + band)
        record_error(err, _ARRIVAL_TIMEOUT, e, band, rank, pid, seen, C, source)
    if X_TMA:
        _proxy_fence()


@triton.jit
def _copy_fc1_kernel(
    x_desc, w_desc, src, rows, x, w, h, gather_index, schedule, order, band_expert, band_row,
    band_rows, band_dst, counts, sync, n_band, err, clock, timeout, max_spins, rank,
    K, N, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, CK: tl.constexpr,
    SUB: tl.constexpr, MODE: tl.constexpr, ACT: tl.constexpr, USE_TMA: tl.constexpr,
    USE_TIMER: tl.constexpr, ORDERED: tl.constexpr, X_TMA: tl.constexpr,
):  # fmt: skip
    n_sched = tl.load(counts + 2).to(tl.int32)
    pid = tl.program_id(0)
    tiles_n = tl.cdiv(N, BN)
    C = tl.cdiv(K, CK)
    per_band = C if MODE == 1 else tiles_n
    ticket = sync + 2 * n_band + (0 if MODE == 1 else 2)  # the copies' or the tiles' own
    i = tl.atomic_add(ticket, 1, sem="relaxed", scope="gpu")
    while i < n_sched * per_band:
        v = i // per_band
        q = i % per_band
        band, row0, nrows = _band(v, order, schedule, band_row, band_rows, ORDERED)
        if MODE == 1:  # no tile code at all: no shared memory, few registers
            _copy_chunk(src, rows, x, gather_index, row0, nrows, q * CK, K, sync, band, C,
                        n_band, BM, CK, SUB, X_TMA)  # fmt: skip
        else:
            e = tl.load(band_expert + band)
            if MODE == 3:  # the band's rows must have landed
                _wait_band(sync, band, C, e, band_dst, err, clock, timeout, max_spins, rank, pid,
                           USE_TIMER, X_TMA)  # fmt: skip
            _fc1_tile(x, x_desc, w, w_desc, h, e, row0, nrows, q * BN, K, N,
                      BM, BN, BK, ACT, USE_TMA, X_TMA)  # fmt: skip
        i = tl.atomic_add(ticket, 1, sem="relaxed", scope="gpu")


def sync_words(max_bands: int) -> int:
    """Size of the sync buffer for plans of at most max_bands bands."""
    return 2 * max_bands + 3


def launch_copy_fc1(
    src: torch.Tensor,
    rows: torch.Tensor,
    x: torch.Tensor,
    w: torch.Tensor,
    h: torch.Tensor,
    plan: Any,
    sync: torch.Tensor,
    wait: dict,
    *,
    mode: int,
    programs: int,
    block_n: int,
    block_k: int,
    chunk: int,
    num_warps: int,
    num_stages: int,
    use_tma: bool,
    act: bool = True,
    compile_only: bool = False,
):
    """Launch one mode (shapes in the module docstring) on the current stream; wait: err
    (int64 record), clock (int64 [>= programs]), timeout_ns, max_spins, use_timer, rank.
    Returns Triton's compiled kernel (compile_only: compiled, not launched), or None for a plan
    without bands."""
    K, E, N = src.shape[1], w.shape[0], w.shape[2]
    if x.shape[1] != K or w.shape[1] != K or h.shape[1] != N or h.shape[0] != x.shape[0]:
        raise ValueError(f"copy_fc1: x [P, {K}], w [E, {K}, N], h [P, N], got "
                         f"{tuple(x.shape)}, {tuple(w.shape)}, {tuple(h.shape)}")  # fmt: skip
    n_band = plan.schedule.numel()
    if sync.dtype != torch.int32 or sync.numel() < sync_words(n_band):
        raise ValueError(f"copy_fc1: an int32 sync buffer of >= {sync_words(n_band)} words")
    if wait["clock"].numel() < programs:
        raise ValueError(f"copy_fc1: a clock of >= {programs} words")
    if n_band == 0:
        return None
    tma = use_tma and K % block_k == 0
    w_desc = x_desc = None
    if tma:
        w2 = w.view(E * K, N)
        w_desc = TensorDescriptor(w2, [E * K, N], [N, 1], [block_k, block_n])
        P = x.shape[0]
        x_desc = TensorDescriptor(x, [P, K], [K, 1], [plan.tile_m, block_k])
    order = plan.schedule if plan.visit is None else plan.visit
    args = (x_desc, w_desc, src, rows, x, w, h, plan.gather_index, plan.schedule, order)
    args += (plan.band_expert, plan.band_row, plan.band_rows, plan.band_dst, plan.counts)
    args += (sync, n_band, wait["err"], wait["clock"], wait["timeout_ns"], wait["max_spins"])
    args += (wait["rank"], K, N)
    meta = dict(BM=plan.tile_m, BN=block_n, BK=block_k, CK=chunk, SUB=min(SUB_ROWS, plan.tile_m),
                MODE=mode, ACT=act, USE_TMA=tma, USE_TIMER=wait["use_timer"],
                ORDERED=plan.visit is not None, X_TMA=x_desc is not None,
                num_warps=num_warps, num_stages=num_stages)  # fmt: skip
    grid = (programs,)
    if compile_only:
        return _copy_fc1_kernel.warmup(*args, grid=grid, **meta)
    return _copy_fc1_kernel[grid](*args, **meta)
