"""dispatch_overlap's fc1: the dispatch's copy into fc1's padded input and fc1 + GELU, one queue.

One persistent kernel whose programs draw work items from one ticket (an atomic counter), in
order. An item is either a COPY of one column chunk (CK columns) of one band (tile_m rows of
one (source rank, local expert) block of stage A's layout) from the received rows into fc1's
padded input, or a TILE of fc1 (one band x BN columns, the K loop, GELU in the epilogue). A
copy item adds 1 to its band's arrival counter (release) after its stores; a tile waits
(bounded) until its band's counter holds every chunk. The queue puts the copies of a band
LOOK bands ahead of its tiles:

  copies of visiting positions 0..LOOK-1, then per position v: v's tiles, v+LOOK's copies

so a tile only ever waits on items drawn before it. Those belong to programs that are running
and never wait on a later item: the queue cannot deadlock, whatever the grid or residency
(no SMs are set aside, nothing depends on two kernels sharing the GPU). The copy thus spreads
over every SM, in fc1's visiting order (the plan's visit), beside fc1's tiles.

MODE 0 runs the queue, MODE 1 only the copies (the dispatch alone), MODE 2 only the tiles with
no waits (fc1 alone, on input already copied). The completing chunk of a band also writes the
band's place in the arrival order (1, 2, ...) to places[band]: with one program the places
follow the visiting order, which a test reads.

Operands: src [S, K] (the played ranks' stacked tokens), rows [R] (received row r is
src[rows[r]]), x [P', K] (fc1's padded input), w [E, K, N], h [P', N] (gelu(x @ w_e); rows past
a band's band_rows never written), the plan's gather_index, schedule, visit (None: the
schedule's order), band_expert, band_row, band_rows, band_dst (a band's source rank), counts;
sync int32 [2 * B' + 2]: the bands' arrival counters [0, B'), their places [B', 2B'), the work
ticket, the place ticket (zeroed by the host before every run, one memset: a CUDA graph
replays one fixed target). Padding rows (gather_index -1) are copied as zeros. Weights load
through TMA (USE_TMA); x through pointers: another program's generic stores wrote it.
"""

from __future__ import annotations

from typing import Any

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from harness.kernels.ints import cdiv
from systems.overlap import errors
from systems.overlap.kernels.primitives import record_error, spin_until

_ARRIVAL_TIMEOUT = tl.constexpr(errors.CODE_ARRIVAL_TIMEOUT)
#: MODE: the queue, the copies alone, the tiles alone
QUEUE, COPIES, TILES = 0, 1, 2


@triton.jit
def _item(i, n_sched, tiles_n, C, LOOK, MODE: tl.constexpr):
    """Item i of the queue -> (is_copy, visiting position, chunk or column tile); a copy past
    the schedule's end gets position n_sched (nothing to do)."""
    if MODE == 1:
        is_copy, v, q = i >= 0, i // C, i % C
    elif MODE == 2:
        is_copy, v, q = i < 0, i // tiles_n, i % tiles_n
    else:
        pre = LOOK * C
        j = tl.maximum(i - pre, 0)
        seg = j // (tiles_n + C)
        r = j % (tiles_n + C)
        ahead = i < pre
        tile = (r < tiles_n) & ~ahead
        is_copy = ~tile
        v = tl.where(ahead, i // C, tl.where(tile, seg, tl.minimum(seg + LOOK, n_sched)))
        q = tl.where(ahead, i % C, tl.where(tile, r, r - tiles_n))
    return is_copy, v, q


@triton.jit
def _copy_chunk(src, rows, x, gather_index, p, m, c0, K, sync, band, C, n_band,
                BM: tl.constexpr, CK: tl.constexpr):  # fmt: skip
    """x[p, c0:c0+CK] = src[rows[gather_index[p]], c0:c0+CK] (zeros for padding rows), then the
    band's arrival counter + 1 (release); the band's last chunk draws its place."""
    gi = tl.load(gather_index + p, mask=m, other=-1)
    ok = gi >= 0
    si = tl.load(rows + tl.where(ok, gi, 0), mask=ok, other=0).to(tl.int64)
    cols = c0 + tl.arange(0, CK)
    mk = cols[None, :] < K
    val = tl.load(src + si[:, None] * K + cols[None, :], mask=ok[:, None] & mk, other=0.0)
    tl.store(x + p[:, None] * K + cols[None, :], val, mask=m[:, None] & mk)
    # every thread's stores issued, then ONE release (a scalar atomic runs once per CTA;
    # release is cumulative over what the barrier ordered before it)
    tl.debug_barrier()
    done = tl.atomic_add(sync + band, 1, sem="release", scope="gpu") + 1
    if done == C:
        place = tl.atomic_add(sync + 2 * n_band + 1, 1, sem="relaxed", scope="gpu") + 1
        tl.store(sync + n_band + band, place)


@triton.jit
def _fc1_tile(x, w, w_desc, h, e, row0, nrows, col0, K, N,
              BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, ACT: tl.constexpr,
              USE_TMA: tl.constexpr):  # fmt: skip
    """h[row0 + i, col0 + j] = gelu(x[row0 + i] @ w[e][:, col0 + j]) for i < nrows, j < BN."""
    rm = tl.arange(0, BM)
    rk = tl.arange(0, BK)
    cols = col0 + tl.arange(0, BN)
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    for k0 in range(0, K, BK):
        ks = k0 + rk
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
def _copy_fc1_kernel(
    w_desc, src, rows, x, w, h, gather_index, schedule, order, band_expert, band_row,
    band_rows, band_dst, counts, sync, n_band, err, clock, timeout, max_spins, rank,
    K, N, LOOK, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, CK: tl.constexpr,
    MODE: tl.constexpr, ACT: tl.constexpr, USE_TMA: tl.constexpr, USE_TIMER: tl.constexpr,
    ORDERED: tl.constexpr,
):  # fmt: skip
    n_sched = tl.load(counts + 2).to(tl.int32)
    pid = tl.program_id(0)
    tiles_n = tl.cdiv(N, BN)
    C = tl.cdiv(K, CK)
    if MODE == 1:
        total = n_sched * C
    elif MODE == 2:
        total = n_sched * tiles_n
    else:
        total = LOOK * C + n_sched * (tiles_n + C)
    rm = tl.arange(0, BM)
    ticket = sync + 2 * n_band
    i = tl.atomic_add(ticket, 1, sem="relaxed", scope="gpu")
    while i < total:
        is_copy, v, q = _item(i, n_sched, tiles_n, C, LOOK, MODE)
        if v < n_sched:
            s = v
            if ORDERED:  # fc1's visiting order of the schedule (the plan's visit)
                s = tl.load(order + v).to(tl.int32)
            band = tl.load(schedule + s)
            row0 = tl.load(band_row + band).to(tl.int64)
            nrows = tl.load(band_rows + band).to(tl.int32)
            if is_copy:
                p = row0 + rm
                _copy_chunk(src, rows, x, gather_index, p, rm < nrows, q * CK, K, sync, band,
                            C, n_band, BM, CK)  # fmt: skip
            else:
                e = tl.load(band_expert + band)
                if MODE == 0:  # the band's rows must have landed
                    status, seen = spin_until(
                        sync + band, C, err, clock + pid, timeout, max_spins, "gpu", USE_TIMER
                    )
                    if status == 1:
                        source = tl.load(band_dst + band)
                        record_error(err, _ARRIVAL_TIMEOUT, e, band, rank, pid, seen, C, source)
                _fc1_tile(x, w, w_desc, h, e, row0, nrows, q * BN, K, N, BM, BN, BK, ACT, USE_TMA)
        i = tl.atomic_add(ticket, 1, sem="relaxed", scope="gpu")


def sync_words(max_bands: int) -> int:
    """Size of the sync buffer for plans of at most max_bands bands."""
    return 2 * max_bands + 2


def look_ahead(programs: int, tiles_n: int, chunks: int) -> int:
    """Bands whose copies run ahead of their tiles: enough that the first wave of programs
    finds copied bands (one more than the bands a wave takes)."""
    return cdiv(programs, tiles_n + chunks) + 1


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
):
    """Launch the queue (shapes in the module docstring) on the current stream; wait: err
    (int64 record), clock (int64 [>= programs]), timeout_ns, max_spins, use_timer, rank.
    Returns Triton's compiled kernel, or None for a plan without bands."""
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
    w_desc = None
    if tma:
        w2 = w.view(E * K, N)
        w_desc = TensorDescriptor(w2, [E * K, N], [N, 1], [block_k, block_n])
    order = plan.schedule if plan.visit is None else plan.visit
    tiles_n = cdiv(N, block_n)
    look = look_ahead(programs, tiles_n, cdiv(K, chunk))
    args = (w_desc, src, rows, x, w, h, plan.gather_index, plan.schedule, order)
    args += (plan.band_expert, plan.band_row, plan.band_rows, plan.band_dst, plan.counts)
    args += (sync, n_band, wait["err"], wait["clock"], wait["timeout_ns"], wait["max_spins"])
    args += (wait["rank"], K, N, look)
    meta = dict(BM=plan.tile_m, BN=block_n, BK=block_k, CK=chunk, MODE=mode, ACT=act, USE_TMA=tma,
                USE_TIMER=wait["use_timer"], ORDERED=plan.visit is not None)  # fmt: skip
    grid = (programs,)
    return _copy_fc1_kernel[grid](*args, **meta, num_warps=num_warps, num_stages=num_stages)
