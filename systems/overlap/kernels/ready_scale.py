"""A scale that starts before the producer ends (a prototype; benchmarks/ready_scale.py measures
it on one GPU, W=1): out[t] = sum_j gate[t, j] * recv[pos[t, j]], token tile by token tile, each
tile as soon as the bands holding its rows have been signalled.

The tokens come sorted by when their rows are expected (the latest of their bands in the
producer's visiting order, computed on the host), so the early tiles are the early-ready ones.
A persistent grid of small programs walks the tiles (tile = pid, pid + programs, ...); for a
tile it polls the counters of every band its BLOCK_T x k rows come from at once (vector acquire
atomics, bounded like spin_until) until all are >= target, then gathers the rows over all N
columns in BLOCK_N steps and stores out[token]. A wait that times out writes one error record
(CODE_SCALE_TIMEOUT: segment = the tile, band = the first band still short) and the program
stops; the host raises it (errors.raise_if_error).

Launch the producer on a higher-priority stream: its CTAs are then placed first. Scale programs
placed first could hold the room a producer CTA needs; that CTA would start only when another
producer CTA ends (the producer never waits), so the producer would take up to twice as long
while the scale's tiles wait for its bands. Scale programs that find no room beside a producer
CTA start when producer CTAs end.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from harness.kernels.ints import cdiv, next_power_of_2
from systems.overlap import errors
from systems.overlap.kernels.primitives import (
    load_acquire,
    nanosleep,
    poll_bound,
    record_error,
    uniform,
    uniform_now,
)

_SCALE_TIMEOUT = tl.constexpr(errors.CODE_SCALE_TIMEOUT)


@triton.jit
def _poll(band_ready, b, pk, POLL_LOAD: tl.constexpr):
    """The counters of bands b where pk (acquire): atomic reads, or POLL_LOAD (GPU) plain
    ld.acquire loads (masked lanes read counter 0, then count as done)."""
    if POLL_LOAD:
        f = load_acquire(band_ready + tl.where(pk, b, 0))
    else:
        f = tl.atomic_add(band_ready + b, 0, mask=pk, sem="acquire", scope="gpu")
    return f


@triton.jit
def _lowest(f, pk, target, clock, POLL_LOAD: tl.constexpr):
    """The lowest counter of f where pk, one value for the whole program. The tile's few
    counters are replicated across the warps: an atomic's result is broadcast to every copy, but
    each warp loads its own copy, and warps that read the counters apart would part at the
    wait's branch, whose polls hold barriers (bar.sync counts arrivals anywhere, so the program's
    shared scratch, its claimed tile among it, would be overwritten: NaN rows and a fault on
    the GPU, 2026-12-02). So a loaded minimum is thread 0's, broadcast (the other warps read
    rows after the wait's barrier, which orders them after thread 0's acquire)."""
    low = tl.min(tl.where(pk, f, target))
    if POLL_LOAD:
        low = uniform(clock, low.to(tl.int64)).to(tl.int32)
    return low


@triton.jit
def _wait_bands(
    band_ready,
    b,
    pk,
    target,
    err,
    clock,
    timeout,
    max_spins,
    tile,
    pid,
    USE_TIMER,
    BACKOFF,
    POLL_LOAD,
):
    """Poll the counters of every band in b [BLOCK_T, KP] (mask pk) together, acquire, until all
    are >= target: one round trip a poll for the whole tile. The timer starts only when the
    first poll finds a band short; BACKOFF > 0 (GPU) sleeps that many ns between polls, so the
    waiting tiles leave the producer's counters and issue slots alone. Bounded like spin_until
    (timeout ns on the GPU, max_spins polls in the interpreter; 2 when another program recorded
    an error); a time-out records the first band still short. Returns the status (0: ready)."""
    f = _poll(band_ready, b, pk, POLL_LOAD)
    low = _lowest(f, pk, target, clock, POLL_LOAD)
    status = tl.zeros((), dtype=tl.int32)
    if low < target:
        t0 = tl.zeros((), dtype=tl.int64)
        if USE_TIMER:
            t0 = uniform_now(clock)
        spins = tl.zeros((), dtype=tl.int32)
        while (low < target) & (status == 0):
            if USE_TIMER and BACKOFF > 0:
                nanosleep(tl.full((), BACKOFF, tl.int32))
            f = _poll(band_ready, b, pk, POLL_LOAD)
            low = _lowest(f, pk, target, clock, POLL_LOAD)
            spins += 1
            status = poll_bound(spins, err, clock, t0, timeout, max_spins, USE_TIMER)
        status = tl.where(low >= target, 0, status)
        if status == 1:
            short = pk & (f < target)
            band = tl.min(tl.where(short, b, 1 << 62))
            seen = tl.min(tl.where(short, f, target))
            record_error(err, _SCALE_TIMEOUT, tile, band, 0, pid, seen, target, -1)
    tl.debug_barrier()  # every thread reads rows only after the whole tile's acquire
    return status


@triton.jit(do_not_specialize=["target"])
def _ready_scale_kernel(
    y_ptr,  # [S, N] receive buffer
    tok_ptr,  # [T] token of each sorted position
    pos_ptr,  # [T, K_SLOTS] rows of the sorted tokens in y
    band_ptr,  # [T, K_SLOTS] band that writes each of those rows
    gate_ptr,  # [T, K_SLOTS] float32 gate weights of the sorted tokens
    out_ptr,  # [T, N]
    band_ready,  # [B] int32 counters
    err,  # int64 [8] error record
    clock,  # int64 [programs] scratch of uniform_now
    claim,  # int32 [1] tiles taken so far (CLAIM), zero before the step
    target,
    T,
    N,
    timeout,
    max_spins,
    K_SLOTS: tl.constexpr,
    KP: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_N: tl.constexpr,
    USE_TIMER: tl.constexpr,
    BACKOFF: tl.constexpr,
    POLL_LOAD: tl.constexpr,
    CLAIM: tl.constexpr,
):
    pid = tl.program_id(0)
    n_tiles = tl.cdiv(T, BLOCK_T)
    kk = tl.arange(0, KP)
    kmask = kk < K_SLOTS
    status = tl.zeros((), dtype=tl.int32)
    tile = pid
    if CLAIM:  # the next tile in ready order, shared with every kernel on this counter
        tile = tl.atomic_add(claim, 1, sem="relaxed")
    while (tile < n_tiles) & (status == 0):
        s0 = tile * BLOCK_T
        s = s0 + tl.arange(0, BLOCK_T)
        smask = s < T
        idx = s.to(tl.int64)[:, None] * K_SLOTS + kk[None, :]
        pk = smask[:, None] & kmask[None, :]
        b = tl.load(band_ptr + idx, mask=pk, other=0)
        # the host-made tables load beside the wait's atomics (nothing orders them after it)
        p = tl.load(pos_ptr + idx, mask=pk, other=0).to(tl.int64)
        g = tl.load(gate_ptr + idx, mask=pk, other=0.0)
        t = tl.load(tok_ptr + s, mask=smask, other=0).to(tl.int64)
        status = _wait_bands(band_ready, b, pk, target, err, clock + pid, timeout, max_spins,
                             tile, pid, USE_TIMER, BACKOFF, POLL_LOAD)  # fmt: skip
        if status == 0:
            # two column steps in flight: the next step's rows load before this step's store
            # (y and out may alias for the compiler, so it would not move a load above a store)
            c = tl.arange(0, BLOCK_N)
            v = tl.load(y_ptr + p[:, :, None] * N + c[None, None, :],
                        mask=pk[:, :, None] & (c < N)[None, None, :], other=0.0)  # fmt: skip
            for c0 in range(0, N, BLOCK_N):
                cols = c0 + c
                nxt = cols + BLOCK_N
                vn = tl.load(y_ptr + p[:, :, None] * N + nxt[None, None, :],
                             mask=pk[:, :, None] & (nxt < N)[None, None, :], other=0.0)  # fmt: skip
                acc = tl.sum(v.to(tl.float32) * g[:, :, None], axis=1)
                omask = smask[:, None] & (cols < N)[None, :]
                dst = out_ptr + t[:, None] * N + cols[None, :]
                tl.store(dst, acc.to(out_ptr.dtype.element_ty), mask=omask)
                v = vn
        if CLAIM:
            tile = tl.atomic_add(claim, 1, sem="relaxed")
        else:
            tile += tl.num_programs(0)


_CLOCKS: dict[tuple, torch.Tensor] = {}


def launch_ready_scale(
    y: torch.Tensor,
    tok: torch.Tensor,
    pos: torch.Tensor,
    band: torch.Tensor,
    gate: torch.Tensor,
    out: torch.Tensor,
    band_ready: torch.Tensor,
    err: torch.Tensor,
    target: int,
    *,
    programs: int,
    block_t: int = 4,
    block_n: int = 512,
    num_warps: int = 4,
    backoff_ns: int = 200,
    poll: str = "atomic",
    claim: torch.Tensor | None = None,
    timeout_s: float = 5.0,
    max_spins: int = 1000,
):
    """out [T, N] (rows written as their tiles become ready) on the current stream; returns
    Triton's compiled kernel (its registers and shared memory: runner.residency_report).

    y [S, N] the receive buffer; tok [T] int64 the token of each sorted position (a permutation
    of [0, T)); pos, band [T, k] int64 the sorted tokens' rows in y and the bands writing them;
    gate [T, k] float32; band_ready [B] int32; err int64 [8] (errors.new_error_buffer); target
    the counter value of a finished band; all contiguous. programs: the persistent grid;
    backoff_ns: the sleep between polls of a tile whose bands are not all done (GPU); poll:
    "atomic" (atomic reads of the counters) or "load" (ld.acquire on the GPU; atomic reads in
    the interpreter, which has no inline assembly); claim: an int32 [1] counter, zero before the
    step: the programs take tiles in ready order from it instead of pid, pid + programs, ...,
    so a second launch on the same counter (a tail after the producer, on all free SMs) takes
    the tiles not yet taken and no tile is scaled twice.
    """
    T, k = pos.shape
    if tuple(band.shape) != (T, k) or tuple(gate.shape) != (T, k) or tuple(tok.shape) != (T,):
        raise ValueError(
            f"ready scale: tok [T], pos, band, gate [T, k] needed, got {tuple(tok.shape)}, "
            f"{tuple(pos.shape)}, {tuple(band.shape)}, {tuple(gate.shape)}"
        )
    if y.ndim != 2 or tuple(out.shape) != (T, y.shape[1]) or out.dtype != y.dtype:
        raise ValueError(f"ready scale: y [S, N] and out [T, N] of one dtype, got "
                         f"{tuple(y.shape)} {y.dtype}, {tuple(out.shape)} {out.dtype}")  # fmt: skip
    if (
        programs < 1
        or block_t < 1
        or block_n < 16
        or block_t & (block_t - 1)
        or block_n & (block_n - 1)
    ):
        raise ValueError(
            f"ready scale: programs >= 1, block_t and block_n (>= 16) powers of two needed, got "
            f"{programs}, {block_t}, {block_n}"
        )
    if claim is not None and (claim.dtype != torch.int32 or claim.numel() < 1):
        raise ValueError(f"ready scale: claim is an int32 counter, got {claim.dtype}")
    if poll not in ("atomic", "load"):
        raise ValueError(f"ready scale: poll is 'atomic' or 'load', got {poll!r}")
    loose = [n for n, t in (("y", y), ("tok", tok), ("pos", pos), ("band", band),
                            ("gate", gate), ("out", out)) if not t.is_contiguous()]  # fmt: skip
    if loose:
        raise ValueError(f"ready scale: {loose} must be contiguous")
    on_gpu = y.device.type == "cuda"
    # the broadcast scratch of uniform/uniform_now: any content will do, so no fill per call;
    # one per stream, as two launches running at once (a beside kernel and its tail) must not
    # trade the values thread 0 broadcasts (a loaded poll's minimum among them)
    stream = torch.cuda.current_stream(y.device).cuda_stream if on_gpu else 0
    key = (y.device, programs, stream)
    if key not in _CLOCKS:
        _CLOCKS[key] = torch.empty(programs, dtype=torch.int64, device=y.device)
    clock = _CLOCKS[key]
    grid = (min(programs, max(cdiv(T, block_t), 1)),)
    return _ready_scale_kernel[grid](
        y, tok, pos, band, gate, out, band_ready, err, clock,
        clock if claim is None else claim, int(target), T, y.shape[1], int(timeout_s * 1e9),
        max_spins,
        K_SLOTS=k, KP=next_power_of_2(k), BLOCK_T=block_t,
        BLOCK_N=min(block_n, next_power_of_2(max(y.shape[1], 16))),
        USE_TIMER=on_gpu, BACKOFF=max(0, int(backoff_ns)), POLL_LOAD=on_gpu and poll == "load",
        CLAIM=claim is not None, num_warps=num_warps,
    )  # fmt: skip
