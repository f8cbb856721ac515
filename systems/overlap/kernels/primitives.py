"""Shared Triton device primitives of producer.py and consumer.py: bounded waits (spin_until,
poll_bound, record_error; the interpreter has no inline asm: its clock is the host's), copy_rows
and publish_threads.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def globaltimer():
    return tl.inline_asm_elementwise(
        "mov.u64 $0, %globaltimer;", "=l", [], dtype=tl.int64, is_pure=False, pack=1
    )


@triton.jit
def uniform(scratch, v):
    """v as thread 0 holds it, the same value in every thread (scalar atomics on scratch, an
    int64 nobody else uses, + broadcast): one decision for the whole program where its warps
    may have read a value apart (a branch holding a barrier must be taken by all or none)."""
    tl.atomic_xchg(scratch, v, sem="relaxed")
    return tl.atomic_xchg(scratch, v, sem="relaxed")


@triton.jit
def uniform_now(clock):
    """%globaltimer of thread 0, the same value in every thread (scalar atomic + broadcast)."""
    return uniform(clock, globaltimer())


@triton.jit
def spin_until(ptr, target, err, clock, timeout, SCOPE: tl.constexpr, USE_TIMER: tl.constexpr):
    """Poll *ptr (acquire) until >= target; returns (status, last value seen), status 0 where
    reached, else poll_bound's. clock: the program's scratch word on the GPU, the host clock
    (int64 ns, errors.new_clock) in the interpreter."""
    seen = tl.atomic_add(ptr, 0, sem="acquire", scope=SCOPE)
    status = tl.zeros((), dtype=tl.int32)
    if USE_TIMER:
        t0 = uniform_now(clock)
    else:
        t0 = tl.load(clock)
    spins = tl.zeros((), dtype=tl.int32)
    while (seen < target) & (status == 0):
        seen = tl.atomic_add(ptr, 0, sem="acquire", scope=SCOPE)
        spins += 1
        status = poll_bound(spins, err, clock, t0, timeout, USE_TIMER)
    status = tl.where(seen >= target, 0, status)
    return status, seen


@triton.jit
def poll_bound(spins, err, clock, t0, timeout, USE_TIMER: tl.constexpr):
    """The bound of a polling loop after `spins` polls: 1 past the time-out (more than timeout
    ns since t0: on the GPU every 64 polls by uniform_now, in the interpreter by the host clock
    every poll), else 2 when another program recorded an error (err[0] != 0), else 0."""
    status = tl.zeros((), dtype=tl.int32)
    if USE_TIMER:
        if spins % 64 == 0:
            if tl.atomic_add(err, 0, sem="relaxed") != 0:
                status = 2
            if uniform_now(clock) - t0 > timeout:
                status = 1
    else:
        if tl.atomic_add(err, 0, sem="relaxed") != 0:
            status = 2
        if tl.load(clock) - t0 > timeout:
            status = 1
    return status


@triton.jit
def record_error(err, code, seg, band, rank, pid, seen, want, source):
    """First error wins (CAS on err[0]); the winner fills the record (errors.py layout)."""
    zero = tl.zeros((), dtype=tl.int64)
    won = tl.atomic_cas(err, zero, zero + code, sem="relaxed") == 0
    if won:
        tl.store(err + 1, seg)
        tl.store(err + 2, band)
        tl.store(err + 3, rank)
        tl.store(err + 4, pid)
        tl.store(err + 5, seen)
        tl.store(err + 6, want)
        tl.store(err + 7, source)


@triton.jit
def copy_rows(src, dst, n, BLOCK: tl.constexpr, VEC: tl.constexpr):
    """dst[0:n] = src[0:n] (contiguous), BLOCK elements a step (VEC: 16-byte aligned)."""
    offs = tl.arange(0, BLOCK)
    for start in tl.range(0, n, BLOCK, num_stages=1):
        idx = start + offs
        mask = idx < n
        s = src + idx
        d = dst + idx
        if VEC:
            s = tl.multiple_of(s, 16)
            d = tl.multiple_of(d, 16)
        v = tl.load(s, mask=mask)
        tl.store(d, v, mask=mask)


@triton.jit
def publish_threads(band_ready, band, lane):
    """Every thread adds 1 to band's counter with release (band < 0: nothing)."""
    tl.atomic_add(
        band_ready + band + lane * 0,
        lane * 0 + 1,
        mask=(lane * 0 + band) >= 0,
        sem="release",
        scope="gpu",
    )
