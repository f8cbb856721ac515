"""The consumer (docs/method.md, Stage B: Consumer; its tables: transport.py): ONE persistent
Triton kernel of cCTA programs (launched by runner.run_consumer), and the receivers' wait
(launch_wait_signals). Program j takes segments j, j + cCTA, ... (plan.seg_*); an entry waits
(primitives.spin_until; a time-out writes an errors.py record and stops the program) until its
band's counter reaches ready_target, then copies its valid rows (all N columns, contiguous).
"""

from __future__ import annotations

from typing import Any

import torch
import triton
import triton.language as tl

from harness.kernels.relaunch import LaunchMemo
from systems.overlap import errors
from systems.overlap.kernels.primitives import copy_rows, record_error, spin_until
from systems.overlap.tuning import ConsumerConfig

_BAND_TIMEOUT = tl.constexpr(errors.CODE_BAND_TIMEOUT)
_SIGNAL_TIMEOUT = tl.constexpr(errors.CODE_SIGNAL_TIMEOUT)


@triton.jit(do_not_specialize=["ready_target"])  # an epoch value: one compile for all runs
def _consumer_kernel(
    y_ptr,
    schedule,
    band_row,
    band_valid,
    band_offset,
    piece_band,
    band_ready,
    seg_start,
    seg_count,
    seg_dst,
    counts,
    recv_ptrs,
    signal_ptrs,
    err,
    clock,
    ready_target,
    rank,
    N,
    timeout,
    n_progs,
    BLOCK: tl.constexpr,
    WAIT: tl.constexpr,
    SCOPE: tl.constexpr,
    USE_TIMER: tl.constexpr,
    VEC: tl.constexpr,
    PIECES: tl.constexpr,
):
    """Stores through the destinations' directly writable addresses (recv_ptrs, signal_ptrs).
    counts: the plan's counts on the device (counts[4]: the segments). PIECES (a compact plan):
    a segment's entries seg_start .. + seg_count are piece ids u (band_row / band_valid /
    band_offset hold the pieces' row / rows / offset), waiting for piece_band[u]; otherwise
    entry i is the band schedule[i]."""
    n_segments = tl.load(counts + 4).to(tl.int32)
    pid = tl.program_id(0)
    clock_p = clock + pid
    elem_ty = y_ptr.dtype.element_ty
    status = tl.zeros((), dtype=tl.int32)
    for seg in range(pid, n_segments, n_progs):
        if status == 0:
            s0 = tl.load(seg_start + seg)
            cnt = tl.load(seg_count + seg).to(tl.int32)
            d = tl.load(seg_dst + seg).to(tl.int32)
            base = tl.load(recv_ptrs + d)
            rows = tl.zeros((), dtype=tl.int64)
            for i in range(cnt):
                if status == 0:
                    if PIECES:
                        u = s0 + i
                        band = tl.load(piece_band + u)
                    else:
                        u = tl.load(schedule + s0 + i)
                        band = u
                    if WAIT:
                        status, seen = spin_until(
                            band_ready + band,
                            ready_target,
                            err,
                            clock_p,
                            timeout,
                            "gpu",
                            USE_TIMER,
                        )
                        if status == 1:
                            record_error(
                                err, _BAND_TIMEOUT, seg, band, rank, pid, seen, ready_target, -1
                            )
                    if status == 0:
                        r0 = tl.load(band_row + u).to(tl.int64)
                        nv = tl.load(band_valid + u).to(tl.int64)
                        off = tl.load(band_offset + u).to(tl.int64)
                        src = y_ptr + r0 * N
                        dst = base.to(tl.pointer_type(elem_ty)) + off * N
                        copy_rows(src, dst, (nv * N).to(tl.int32), BLOCK, VEC)
                        rows += nv
            if status == 0:
                tl.debug_barrier()
                sig_p = tl.load(signal_ptrs + d).to(tl.pointer_type(tl.int64)) + rank
                tl.atomic_add(sig_p, rows, sem="release", scope=SCOPE)


@triton.jit
def _wait_signals_kernel(
    signal,
    expected,
    err,
    clock,
    n_src,
    rank,
    timeout,
    SCOPE: tl.constexpr,
    USE_TIMER: tl.constexpr,
):
    """Receiver side: wait until signal[s] >= expected[s] for every source s (one program)."""
    status = tl.zeros((), dtype=tl.int32)
    for s in range(n_src):
        if status == 0:
            want = tl.load(expected + s)
            st, seen = spin_until(signal + s, want, err, clock, timeout, SCOPE, USE_TIMER)
            status = st
            if st == 1:
                record_error(err, _SIGNAL_TIMEOUT, -1, -1, rank, 0, seen, want, s)


def launch_wait_signals(
    signal: torch.Tensor,
    expected: torch.Tensor,
    err: torch.Tensor,
    clock: torch.Tensor,
    *,
    rank: int,
    config: ConsumerConfig,
    scope: str = "sys",
    memo: LaunchMemo | None = None,
    memo_key: Any = None,
):
    """Block the stream until signal[s] >= expected[s] for all s (int64 [W]), bounded (a time-out
    records CODE_SIGNAL_TIMEOUT with source s); memo: remember the launch under memo_key."""
    args = (signal, expected, err, clock, signal.numel(), rank, int(config.timeout_s * 1e9))
    meta = dict(SCOPE=scope, USE_TIMER=config.use_timer, num_warps=1)
    compiled = _wait_signals_kernel[(1,)](*args, **meta)
    if memo is not None:
        memo.remember(memo_key, _wait_signals_kernel, (1,), args, meta, compiled)
    return compiled
