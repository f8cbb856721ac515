"""The dispatch's copy into fc1's padded input, band by band, each band's arrival signalled.

With dispatch_overlap=on (systems/overlap/dispatch_overlap.py) the received rows are not
gathered into the padded layout before fc1: this kernel copies them while fc1's producer
(producer.py, waiting mode) already runs, and after the rows of a band it sets that band's
arrival counter (release) to the band's place in the arrival order, 1, 2, ... (a ticket drawn
from arrived[-1]): fc1 waits for a counter >= 1, a test reads the order. A band is tile_m rows
of one (source rank, local expert) block of stage A's layout (a remote band of the aligned
layout holds one owner's rows), so the band counters are the blocks' counters cut at fc1's
tiles. Program i of the grid takes fc1's visiting positions i, i + G, ...: the bands fc1 visits
first land first.

Operands: src [S, K] (the played ranks' stacked tokens), rows [R] (received row r is
src[rows[r]]), dst [P', K] (fc1's padded input), the plan's schedule, visit (or None),
band_row, band_rows, gather_index and counts, arrived [B' + 1] int32 (the bands' counters,
then the ticket; zeroed by the host before every run, one memset: a CUDA graph replays one
fixed target). A padding row is written as
zeros; rows past a band's band_rows and past n_padded are never written.
"""

from __future__ import annotations

from typing import Any

import torch
import triton
import triton.language as tl


@triton.jit
def _put_bands_kernel(
    src, rows, dst, gather_index, schedule, order, band_row, band_rows, counts, arrived, ticket,
    K, num_progs, BM: tl.constexpr, BK: tl.constexpr, ORDERED: tl.constexpr,
):  # fmt: skip
    n_sched = tl.load(counts + 2).to(tl.int32)
    pid = tl.program_id(0)
    rm = tl.arange(0, BM)
    cols = tl.arange(0, BK)
    for v in range(pid, n_sched, num_progs):
        s = v
        if ORDERED:  # fc1's visiting order of the schedule (the plan's visit)
            s = tl.load(order + v).to(tl.int32)
        band = tl.load(schedule + s)
        p = tl.load(band_row + band).to(tl.int64) + rm
        m = rm < tl.load(band_rows + band)
        gi = tl.load(gather_index + p, mask=m, other=-1)
        ok = gi >= 0
        si = tl.load(rows + tl.where(ok, gi, 0), mask=ok, other=0).to(tl.int64)
        for k0 in range(0, K, BK):
            kk = k0 + cols
            mk = kk[None, :] < K
            val = tl.load(src + si[:, None] * K + kk[None, :], mask=ok[:, None] & mk, other=0.0)
            tl.store(dst + p[:, None] * K + kk[None, :], val, mask=m[:, None] & mk)
        # every thread's stores issued, then ONE release (a scalar atomic runs once per CTA;
        # release is cumulative over what the barrier ordered before it)
        tl.debug_barrier()
        place = tl.atomic_add(ticket, 1, sem="relaxed", scope="gpu") + 1
        tl.atomic_xchg(arrived + band, place, sem="release", scope="gpu")


def launch_put_bands(
    src: torch.Tensor,
    rows: torch.Tensor,
    dst: torch.Tensor,
    plan: Any,
    arrived: torch.Tensor,
    *,
    num_programs: int,
    num_warps: int = 4,
):
    """Launch the band copy on the current stream (shapes in the module docstring); returns
    Triton's compiled kernel, or None for a plan without bands."""
    K = src.shape[1]
    if not (src.is_contiguous() and dst.is_contiguous()) or dst.shape[1] != K:
        raise ValueError("put: contiguous [*, K] src and dst with the same K")
    if arrived.dtype != torch.int32 or arrived.numel() <= plan.schedule.numel():
        raise ValueError(f"put: int32 counters for {plan.schedule.numel()} bands and a ticket")
    if plan.schedule.numel() == 0:
        return None
    order = plan.schedule if plan.visit is None else plan.visit
    grid = (max(1, min(num_programs, plan.schedule.numel())),)
    args = (src, rows, dst, plan.gather_index, plan.schedule, order, plan.band_row)
    args += (plan.band_rows, plan.counts, arrived, arrived[-1:], K, grid[0])
    meta = dict(
        BM=plan.tile_m, BK=min(triton.next_power_of_2(K), 64), ORDERED=plan.visit is not None
    )
    return _put_bands_kernel[grid](*args, **meta, num_warps=num_warps)
