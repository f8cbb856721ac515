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
every block's end in chunks of CH blocks; program 0 also writes offs. R may be a bound on the
rows (the dispatch launches it before its host sync, at the most rows a rank can receive): rows
past the blocks' total are -1. Given the total on the device (split_sizes' last entry), a program
whose rows all lie past it writes its -1 rows and skips both passes over the blocks: at W ranks
the bound grows with W while the real rows do not, and each pass walks all W*E blocks.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from harness.kernels.ints import cdiv, next_power_of_2
from harness.kernels.relaunch import launch_cached

BLOCK = 128  # rows per program
CH = 64  # blocks compared per step


@triton.jit(do_not_specialize=["R"])
def _recv_rows_kernel(
    counts,  # int64: recv_counts, block g = s*E + e at counts[g * c_step]
    offsets,  # int64: recv_off, block g at offsets[g * o_step]
    recv_src,  # [R] int64 out
    recv_expert,  # [R] int64 out
    recv_dst_index,  # [R] int64 out
    expert_pos,  # [R] int64 out (HAS_EPOS)
    offs,  # [E] int32 out
    n_total,  # [1] int64: the blocks' total rows (HAS_N), to skip programs past it
    c_step,
    o_step,
    R,
    E,
    G,
    HAS_EPOS: tl.constexpr,
    HAS_N: tl.constexpr,
    EP: tl.constexpr,  # next power of two >= E
    BLOCK: tl.constexpr,
    CH: tl.constexpr,
):
    pid = tl.program_id(0)
    i = pid.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mine = i < R  # rows this launch writes
    n_blocks = G
    if HAS_N:  # every row of this program past the total (program 0 also writes offs): no pass
        past = (pid > 0) & (pid.to(tl.int64) * BLOCK >= tl.load(n_total))
        n_blocks = tl.where(past, 0, G)
    # pass 1: the row's block b = #blocks whose end <= i
    b = tl.zeros([BLOCK], dtype=tl.int64)
    carry = tl.zeros([1], dtype=tl.int64)  # rows of the blocks before this chunk
    for g0 in range(0, n_blocks, CH):
        g = g0 + tl.arange(0, CH)
        c = tl.load(counts + g * c_step, mask=g < G, other=0)
        end = carry + tl.cumsum(c, 0)  # inclusive ends of this chunk's blocks
        ok = (g < G)[None, :] & (end[None, :] <= i[:, None])
        b += tl.sum(ok.to(tl.int64), 1)
        carry += tl.sum(c, 0)
    live = mine & (i < carry)  # R may be a bound: rows past the blocks' total are -1
    b = tl.where(live, b, 0)
    s = b // E
    e = b % E
    # pass 2: the block's first row (source major) and its first row expert major
    first = tl.zeros([BLOCK], dtype=tl.int64)
    em_first = tl.zeros([BLOCK], dtype=tl.int64)
    for g0 in range(0, n_blocks, CH):
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
    tl.store(recv_src + i, tl.where(live, s, -1), mask=mine)
    tl.store(recv_expert + i, tl.where(live, e, -1), mask=mine)
    off = tl.load(offsets + b * o_step, mask=live, other=0)
    tl.store(recv_dst_index + i, tl.where(live, off + idx, -1), mask=mine)
    if HAS_EPOS:
        tl.store(expert_pos + i, tl.where(live, em_first + idx, -1), mask=mine)
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
    recv_counts: torch.Tensor,
    recv_off: torch.Tensor,
    rows: int,
    expert_pos: bool,
    n_total: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """(recv_src, recv_expert, recv_dst_index [rows] int64, expert_pos [rows] int64 or None,
    offs [E] int32) of the rows received in recv_counts' [W, E] blocks (module docstring);
    rows: a host int, recv_counts.sum() or a bound on it (rows past the sum are -1); n_total
    [1] int64 (optional): recv_counts.sum() on the device, so programs past it skip the block
    passes. One launch; no host synchronisation."""
    W, E = recv_counts.shape
    dev = recv_counts.device
    c, c_step = _flat(recv_counts)
    o, o_step = _flat(recv_off)
    out = torch.empty(4 if expert_pos else 3, rows, dtype=torch.int64, device=dev)
    offs = torch.empty(E, dtype=torch.int32, device=dev)
    has_n = n_total is not None
    args = (c, o, out[0], out[1], out[2], out[3] if expert_pos else out[0], offs)
    args += (n_total if has_n else offs, c_step, o_step, rows, E, W * E)
    kw = dict(HAS_EPOS=expert_pos, HAS_N=has_n, EP=next_power_of_2(E), BLOCK=BLOCK, CH=CH)
    kw["num_warps"] = 4
    grid = (max(1, cdiv(rows, BLOCK)),)
    launch_cached(_recv_rows_kernel, grid, args, kw, ints=("R",))  # R: this step's rows
    return out[0], out[1], out[2], out[3] if expert_pos else None, offs


@triton.jit
def _send_meta_kernel(
    keys,  # [S] int64: the routing's global experts, sorted (stable)
    order,  # [S] int64: the sort's indices (send row j holds pair order[j])
    pos,  # [S] int64 out: pos[order[j]] = j
    token,  # [S] int64 out: token[j] = order[j] // k, the token send row j carries
    meta,  # [G, 2] int64 out: rows to global expert g, and the rows to experts before g
    S,
    G,
    k,
    BLOCK: tl.constexpr,
    GB: tl.constexpr,
    STEPS: tl.constexpr,  # binary-search steps: 2**STEPS > S
):
    pid = tl.program_id(0)
    j = pid.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    o = tl.load(order + j, mask=j < S, other=0)
    tl.store(pos + o, j, mask=j < S)
    tl.store(token + j, o // k, mask=j < S)
    g = pid.to(tl.int64) * GB + tl.arange(0, GB)
    lo = tl.zeros([GB], dtype=tl.int64)  # first sorted key >= g (lower bound)
    hi = tl.zeros([GB], dtype=tl.int64)  # first sorted key > g (upper bound)
    step = 1 << (STEPS - 1)
    for _ in range(STEPS):
        a = lo + step
        ka = tl.load(keys + a - 1, mask=a <= S, other=G)
        lo = tl.where((a <= S) & (ka < g), a, lo)
        b = hi + step
        kb = tl.load(keys + b - 1, mask=b <= S, other=G)
        hi = tl.where((b <= S) & (kb <= g), b, hi)
        step = step // 2
    tl.store(meta + 2 * g, hi - lo, mask=g < G)
    tl.store(meta + 2 * g + 1, lo, mask=g < G)


@triton.jit
def _split_sizes_kernel(
    meta,  # [W, E, 2] int64: this rank's rows per global expert (..., 0)
    got,  # [W, E, 2] int64: the rows each source sends this rank's experts (..., 0)
    sizes,  # [2W + E + 1] int64 out: rows to each rank, from each rank, to each local
    # expert, and the rows received in all
    W,
    E,
    WP: tl.constexpr,
    CH: tl.constexpr,
):
    w = tl.arange(0, WP)
    send = tl.zeros([WP], dtype=tl.int64)
    recv = tl.zeros([WP], dtype=tl.int64)
    for e0 in range(0, E, CH):
        e = e0 + tl.arange(0, CH)
        m = (w[:, None] < W) & (e[None, :] < E)
        at = 2 * (w[:, None] * E + e[None, :])
        send += tl.sum(tl.load(meta + at, mask=m, other=0), 1)
        recv += tl.sum(tl.load(got + at, mask=m, other=0), 1)
        per_expert = tl.sum(tl.load(got + at, mask=m, other=0), 0)
        tl.store(sizes + 2 * W + e, per_expert, mask=e < E)
    tl.store(sizes + w, send, mask=w < W)
    tl.store(sizes + W + w, recv, mask=w < W)
    tl.store(sizes + 2 * W + E, tl.sum(recv, 0))


def send_meta(
    keys: torch.Tensor, order: torch.Tensor, world_size: int, experts: int, top_k: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(pos [S], token [S], meta [W, 2E]) int64 from the stable sort of the routing's global
    experts (keys [S] sorted, order [S] its indices, pair i = token * top_k + slot):
    pos[order[j]] = j, token[j] = order[j] // top_k, and per global expert g the rows sent to
    it and the rows sent to the experts before it (the counts exchange's payload). One launch."""
    S, G = keys.numel(), world_size * experts
    pos = torch.empty(S, dtype=torch.int64, device=keys.device)
    token = torch.empty(S, dtype=torch.int64, device=keys.device)
    meta = torch.empty(world_size, 2 * experts, dtype=torch.int64, device=keys.device)
    block, gb = 1024, 256
    grid = max(cdiv(S, block), cdiv(G, gb), 1)
    launch_cached(
        _send_meta_kernel, (grid,), (keys, order, pos, token, meta, S, G, top_k),
        dict(BLOCK=block, GB=gb, STEPS=max(S, 1).bit_length()),
    )  # fmt: skip
    return pos, token, meta


def split_sizes(meta: torch.Tensor, got: torch.Tensor, world_size: int, experts: int):
    """sizes [2W + E + 1] int64: rows this rank sends to each rank (from meta), receives from
    each rank and for each local expert (from got, the exchanged meta), and the rows it
    receives in all. One launch."""
    sizes = torch.empty(2 * world_size + experts + 1, dtype=torch.int64, device=meta.device)
    args = (meta.contiguous(), got.contiguous(), sizes, world_size, experts)
    kw = dict(WP=next_power_of_2(world_size), CH=32)
    launch_cached(_split_sizes_kernel, (1,), args, kw)
    return sizes
