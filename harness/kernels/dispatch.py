"""The received rows' bookkeeping of the layer dispatch (harness/dispatch.py) in ONE kernel.

After the counts exchange and its host synchronisation every launch of a layer step is on the
step's critical path: the device idles while the host enqueues it. The received rows' labels
took about 20 small torch kernels (repeat_interleave, two exclusive cumsums, a transpose,
gathers, a division and a modulo); this kernel computes the same tensors in one launch.

For the rows [R] received in (source s, local expert e) blocks of recv_counts [W, E] (source
major), with the blocks' offsets recv_off [W, E] in each source's send order:
  recv_src[i]        s of row i's block b = s*E + e
  recv_expert[i]     e
  recv_dst_index[i]  recv_off[s, e] + (i - the block's first row)
  expert_pos[i]      row i's position when the blocks are reordered expert-major (e, then s)
  offs[e]            int32 cumulative rows of experts 0..e (torch._grouped_mm's offs)
Program p labels rows [p*BLOCK, (p+1)*BLOCK): a row's block is the number of blocks that end
at or before it (blocks with no rows end where they start), found by comparing the row against
every block's end in chunks of CH blocks; program 0 also writes offs.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK = 128  # rows per program
CH = 64  # blocks compared per step


@triton.jit
def _recv_rows_kernel(
    counts,  # int64: recv_counts, block g = s*E + e at counts[g * c_step]
    offsets,  # int64: recv_off, block g at offsets[g * o_step]
    recv_src,  # [R] int64 out
    recv_expert,  # [R] int64 out
    recv_dst_index,  # [R] int64 out
    expert_pos,  # [R] int64 out (HAS_EPOS)
    offs,  # [E] int32 out
    c_step,
    o_step,
    R,
    E,
    G,
    HAS_EPOS: tl.constexpr,
    EP: tl.constexpr,  # next power of two >= E
    BLOCK: tl.constexpr,
    CH: tl.constexpr,
):
    pid = tl.program_id(0)
    i = pid.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    live = i < R
    # pass 1: the row's block b = #blocks whose end <= i
    b = tl.zeros([BLOCK], dtype=tl.int64)
    carry = tl.zeros([1], dtype=tl.int64)  # rows of the blocks before this chunk
    for g0 in range(0, G, CH):
        g = g0 + tl.arange(0, CH)
        c = tl.load(counts + g * c_step, mask=g < G, other=0)
        end = carry + tl.cumsum(c, 0)  # inclusive ends of this chunk's blocks
        ok = (g < G)[None, :] & (end[None, :] <= i[:, None])
        b += tl.sum(ok.to(tl.int64), 1)
        carry += tl.sum(c, 0)
    b = tl.where(live, b, 0)
    s = b // E
    e = b % E
    # pass 2: the block's first row (source major) and its first row expert major
    first = tl.zeros([BLOCK], dtype=tl.int64)
    em_first = tl.zeros([BLOCK], dtype=tl.int64)
    for g0 in range(0, G, CH):
        g = g0 + tl.arange(0, CH)
        c = tl.load(counts + g * c_step, mask=g < G, other=0)
        gs, ge = g // E, g % E
        before = g[None, :] < b[:, None]
        em_before = (ge[None, :] < e[:, None]) | (
            (ge[None, :] == e[:, None]) & (gs[None, :] < s[:, None])
        )
        first += tl.sum(tl.where(before, c[None, :], 0), 1)
        em_first += tl.sum(tl.where(em_before, c[None, :], 0), 1)
    idx = i - first
    tl.store(recv_src + i, s, mask=live)
    tl.store(recv_expert + i, e, mask=live)
    off = tl.load(offsets + b * o_step, mask=live, other=0)
    tl.store(recv_dst_index + i, off + idx, mask=live)
    if HAS_EPOS:
        tl.store(expert_pos + i, em_first + idx, mask=live)
    if pid == 0:  # offs[e] = rows of experts <= e
        ex = tl.arange(0, EP)
        tot = tl.zeros([EP], dtype=tl.int64)
        for g0 in range(0, G, CH):
            g = g0 + tl.arange(0, CH)
            c = tl.load(counts + g * c_step, mask=g < G, other=0)
            upto = (g % E)[None, :] <= ex[:, None]
            tot += tl.sum(tl.where(upto, c[None, :], 0), 1)
        tl.store(offs + ex, tot.to(tl.int32), mask=ex < E)


def _flat(t: torch.Tensor) -> tuple[torch.Tensor, int]:
    """An int64 [W, E] tensor as (t, step) with element (s, e) at flat index (s*E + e) * step
    (a view such as the counts exchange's [W, E, 2][..., 0] needs no copy), else a copy."""
    W, E = t.shape
    st = t.stride(1) if E > 1 else t.stride(0)
    if t.dtype == torch.int64 and st > 0 and (W == 1 or t.stride(0) == E * st):
        return t, st
    return t.to(torch.int64).contiguous(), 1


def recv_rows(
    recv_counts: torch.Tensor, recv_off: torch.Tensor, rows: int, expert_pos: bool
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """(recv_src, recv_expert, recv_dst_index [rows] int64, expert_pos [rows] int64 or None,
    offs [E] int32) of the rows received in recv_counts' [W, E] blocks (module docstring);
    rows = recv_counts.sum(), a host int. One launch; no host synchronisation."""
    W, E = recv_counts.shape
    dev = recv_counts.device
    c, c_step = _flat(recv_counts)
    o, o_step = _flat(recv_off)
    out = torch.empty(4 if expert_pos else 3, rows, dtype=torch.int64, device=dev)
    offs = torch.empty(E, dtype=torch.int32, device=dev)
    _recv_rows_kernel[(max(1, triton.cdiv(rows, BLOCK)),)](
        c,
        o,
        out[0],
        out[1],
        out[2],
        out[3] if expert_pos else out[0],
        offs,
        c_step,
        o_step,
        rows,
        E,
        W * E,
        HAS_EPOS=expert_pos,
        EP=triton.next_power_of_2(E),
        BLOCK=BLOCK,
        CH=CH,
        num_warps=4,
    )
    return out[0], out[1], out[2], out[3] if expert_pos else None, offs
