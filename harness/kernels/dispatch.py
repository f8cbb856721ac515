"""The layer dispatch's bookkeeping (harness/dispatch.py) in a few Triton kernels: after the
counts exchange every launch is on the step's critical path, and torch needs about 20 small
kernels for the received rows' labels alone.

recv_rows labels the rows [R] received in (source s, local expert e) blocks b = s*E + e of
recv_counts [W, E] (G = W*E blocks) as recv_rows_torch does (fields: harness.dispatch.Dispatched).
One program writes the blocks' inclusive ends (source major), their expert-major starts and offs;
then program p labels rows [p*BLOCK, (p+1)*BLOCK): a row's block is the number of blocks that
end at or before it, by binary search over the ends (docs/measurements.md: all pairs is too
slow). R may be a bound on the rows (launched before the host sync): rows past the total are -1.

sort_meta is a stable counting sort of the S = T*k global experts over G keys, in two launches
with no memset (sort_meta_torch takes 35 kernels). Program p sorts block p's B pairs in
registers by (expert << log2 B | place), so ties keep their order, and writes lb[p, g], the
block's pairs routed to experts before g. Pair j of block p's sorted block, routed to expert e,
then goes to send row
  sum over blocks q of lb[q, e]  (every pair routed to an earlier expert)
  + sum over q < p of (lb[q, e+1] - lb[q, e])  (expert e's pairs in earlier blocks)
  + j - lb[p, e]  (expert e's pairs before it in its block).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from harness.kernels.ints import cdiv, next_power_of_2
from harness.kernels.relaunch import launch_cached

BLOCK = 128  # rows per program
CH = 1024  # most blocks summed per step of the starts' cumsums (one program)
SORT_LOGB = 10
SORT_B = 1 << SORT_LOGB  # pairs a program of the send sort sorts in registers


@triton.jit
def _block_starts_kernel(
    counts,  # int64: recv_counts, block g = s*E + e at counts[g * c_step]
    ends,  # [G] int64 out: rows of blocks 0..g (source major), inclusive
    em_start,  # [G] int64 out: block g's first row when the blocks go expert major (e, then s)
    offs,  # [E] int32 out: rows of experts 0..e
    c_step,
    W,
    E,
    G,
    CH: tl.constexpr,
):
    carry = tl.zeros([1], dtype=tl.int64)
    for g0 in range(0, G, CH):  # source major: the blocks' inclusive ends
        g = g0 + tl.arange(0, CH)
        c = tl.load(counts + g * c_step, mask=g < G, other=0)
        tl.store(ends + g, carry + tl.cumsum(c, 0), mask=g < G)
        carry += tl.sum(c, 0)
    carry = tl.zeros([1], dtype=tl.int64)
    for j0 in range(0, G, CH):  # expert major: position j = e*W + s holds block s*E + e
        j = j0 + tl.arange(0, CH)
        e = j // W
        s = j % W
        g = s * E + e
        c = tl.load(counts + g * c_step, mask=j < G, other=0)
        inc = carry + tl.cumsum(c, 0)
        tl.store(em_start + g, inc - c, mask=j < G)
        tl.store(offs + e, inc.to(tl.int32), mask=(j < G) & (s == W - 1))  # expert e's last
        carry += tl.sum(c, 0)


@triton.jit(do_not_specialize=["R"])
def _recv_rows_kernel(
    ends,  # [G] int64: _block_starts_kernel's
    em_start,  # [G] int64: _block_starts_kernel's
    offsets,  # int64: recv_off, block g at offsets[g * o_step]
    recv_src,  # [R] int64 out
    recv_expert,  # [R] int64 out
    recv_dst_index,  # [R] int64 out
    expert_pos,  # [R] int64 out (HAS_EPOS)
    o_step,
    R,
    E,
    G,
    HAS_EPOS: tl.constexpr,
    STEPS: tl.constexpr,  # binary-search steps: 2**STEPS > G
    BLOCK: tl.constexpr,
):
    pid = tl.program_id(0)
    i = pid.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mine = i < R  # rows this launch writes
    live = mine & (i < tl.load(ends + G - 1))  # R may be a bound: rows past the total are -1
    # the row's block b = #blocks whose end <= i (a binary search over the ends; rows past the
    # total search nothing, so programs past it only write their -1 rows)
    b = tl.zeros([BLOCK], dtype=tl.int64)
    step = 1 << (STEPS - 1)
    for _ in range(STEPS):
        a = b + step
        ok = live & (a <= G)
        end = tl.load(ends + a - 1, mask=ok, other=0)
        b = tl.where(ok & (end <= i), a, b)
        step = step // 2
    s = b // E
    e = b % E
    first = tl.load(ends + b - 1, mask=live & (b > 0), other=0)  # the block's first row
    idx = i - first
    tl.store(recv_src + i, tl.where(live, s, -1), mask=mine)
    tl.store(recv_expert + i, tl.where(live, e, -1), mask=mine)
    off = tl.load(offsets + b * o_step, mask=live, other=0)
    tl.store(recv_dst_index + i, tl.where(live, off + idx, -1), mask=mine)
    if HAS_EPOS:
        em_first = tl.load(em_start + b, mask=live, other=0)
        tl.store(expert_pos + i, tl.where(live, em_first + idx, -1), mask=mine)


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
    offs [E] int32) of the rows received in recv_counts' [W, E] blocks (module docstring); rows:
    recv_counts.sum() or a bound on it (rows past the sum are -1). Two launches, no host sync."""
    W, E = recv_counts.shape
    G = W * E
    dev = recv_counts.device
    c, c_step = _flat(recv_counts)
    o, o_step = _flat(recv_off)
    starts = torch.empty(2, G, dtype=torch.int64, device=dev)  # ends, em_start
    offs = torch.empty(E, dtype=torch.int32, device=dev)
    args = (c, starts[0], starts[1], offs, c_step, W, E, G)
    ch = min(CH, next_power_of_2(G))
    launch_cached(_block_starts_kernel, (1,), args, dict(CH=ch, num_warps=4))
    out = torch.empty(4 if expert_pos else 3, rows, dtype=torch.int64, device=dev)
    args = (starts[0], starts[1], o, out[0], out[1], out[2], out[3] if expert_pos else out[0])
    args += (o_step, rows, E, G)
    kw = dict(HAS_EPOS=expert_pos, STEPS=G.bit_length(), BLOCK=BLOCK, num_warps=4)
    launch_cached(_recv_rows_kernel, (max(1, cdiv(rows, BLOCK)),), args, kw, ints=("R",))
    return out[0], out[1], out[2], out[3] if expert_pos else None, offs


@triton.jit
def _sort_blocks_kernel(
    ids,  # [S] int: the routing's global experts (pair i = token * k + slot)
    sorted_c,  # [NB * B] int32 out: block p's (expert << LOGB | i) sorted, i its place
    lb,  # [NB, G + 1] int32 out: block p's pairs routed to experts before g
    S,
    G,
    B: tl.constexpr,
    LOGB: tl.constexpr,
    GB: tl.constexpr,
):
    p = tl.program_id(0)
    j = tl.arange(0, B)
    at = p.to(tl.int64) * B + j
    key = tl.load(ids + at, mask=at < S, other=G)  # pairs past S sort last (expert G)
    c = tl.sort((key.to(tl.int32) << LOGB) | j)  # stable: ties keep their places in the block
    tl.store(sorted_c + at, c)
    tl.debug_barrier()  # the binary searches read the whole sorted block
    base = sorted_c + p.to(tl.int64) * B
    for g0 in range(0, G + 1, GB):  # lower bounds of every expert g = 0..G in the block
        g = g0 + tl.arange(0, GB)
        probe = g << LOGB
        lo = tl.zeros([GB], dtype=tl.int32)  # first sorted place whose expert is >= g
        step = B
        for _ in range(LOGB + 1):
            a = lo + step
            ca = tl.load(base + a - 1, mask=(a <= B) & (g <= G), other=0)
            lo = tl.where((a <= B) & (ca < probe), a, lo)
            step = step // 2
        tl.store(lb + p * (G + 1) + g, lo, mask=g <= G)


@triton.jit
def _sort_place_kernel(
    sorted_c,  # [NB * B]: _sort_blocks_kernel's
    lb,  # [NB, G + 1] int32: _sort_blocks_kernel's
    first,  # [NB, G] int32 scratch: block p's first send row for each expert
    order,  # [S] int64 out: send row j holds pair order[j] (the stable sort's indices)
    pos,  # [S] int64 out: pos[order[j]] = j
    token,  # [S] int64 out: token[j] = order[j] // k, the token send row j carries
    meta,  # [G, 2] int64 out: rows to global expert g, and the rows to experts before g
    S,
    G,
    NB,
    k,
    B: tl.constexpr,
    LOGB: tl.constexpr,
    GB: tl.constexpr,
):
    p = tl.program_id(0)
    for g0 in range(0, G, GB):
        g = g0 + tl.arange(0, GB)
        mg = g < G
        lead = tl.zeros([GB], dtype=tl.int32)  # block p's first send row for expert g
        cnt = tl.zeros([GB], dtype=tl.int32)
        before = tl.zeros([GB], dtype=tl.int32)
        for q in range(0, NB):  # rows before: experts < g anywhere, expert g in blocks < p
            lo = tl.load(lb + q * (G + 1) + g, mask=mg, other=0)
            hi = tl.load(lb + q * (G + 1) + g + 1, mask=mg, other=0)
            lead += tl.where(q < p, hi, lo)
            cnt += hi - lo
            before += lo
        tl.store(first + p * G + g, lead, mask=mg)
        tl.store(meta + 2 * g, cnt.to(tl.int64), mask=mg & (p == 0))
        tl.store(meta + 2 * g + 1, before.to(tl.int64), mask=mg & (p == 0))
    tl.debug_barrier()  # the rows below read the whole of first[p]
    j = tl.arange(0, B)
    at = p.to(tl.int64) * B + j
    live = at < S  # the block's pairs sort first, the padding (expert G) last
    c = tl.load(sorted_c + at)
    e = c >> LOGB
    o = p.to(tl.int64) * B + (c & (B - 1))  # the pair's index in the routing
    ahead = tl.load(lb + p * (G + 1) + e, mask=live, other=0)  # block pairs before expert e
    row = tl.load(first + p * G + e, mask=live, other=0) + j - ahead
    row = row.to(tl.int64)
    tl.store(order + row, o, mask=live)
    tl.store(pos + o, row, mask=live)
    tl.store(token + row, o // k, mask=live)


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


def sort_meta(
    expert_ids: torch.Tensor, world_size: int, experts: int, top_k: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(order [S], pos [S], token [S], meta [W, 2E]) int64, as harness.dispatch's
    sort_meta_torch, from expert_ids [T, k] (S = T*k, G = W*E experts). Two launches, no
    memset (module docstring)."""
    S, G = expert_ids.numel(), world_size * experts
    dev = expert_ids.device
    ids = expert_ids.reshape(-1)
    if (G + 1) << SORT_LOGB >= 2**31:  # the composite keys are int32
        raise ValueError(f"sort_meta: at most {2**31 // SORT_B - 2} global experts, got {G}")
    nb = max(1, cdiv(S, SORT_B))
    sorted_c = torch.empty(nb * SORT_B, dtype=torch.int32, device=dev)
    lb = torch.empty(nb, G + 1, dtype=torch.int32, device=dev)
    first = torch.empty(nb, G, dtype=torch.int32, device=dev)
    out = torch.empty(3, S, dtype=torch.int64, device=dev)  # order, pos, token
    meta = torch.empty(world_size, 2 * experts, dtype=torch.int64, device=dev)
    kw = dict(B=SORT_B, LOGB=SORT_LOGB, GB=min(256, next_power_of_2(G + 1)), num_warps=4)
    launch_cached(_sort_blocks_kernel, (nb,), (ids, sorted_c, lb, S, G), kw)
    args = (sorted_c, lb, first, out[0], out[1], out[2], meta, S, G, nb, top_k)
    launch_cached(_sort_place_kernel, (nb,), args, kw)
    return out[0], out[1], out[2], meta


def split_sizes(meta: torch.Tensor, got: torch.Tensor, world_size: int, experts: int):
    """sizes [2W + E + 1] int64, as split_sizes_torch: rows sent to each rank (from meta),
    received from each rank and for each local expert (from got) and in all. One launch."""
    sizes = torch.empty(2 * world_size + experts + 1, dtype=torch.int64, device=meta.device)
    args = (meta.contiguous(), got.contiguous(), sizes, world_size, experts)
    kw = dict(WP=next_power_of_2(world_size), CH=32)
    launch_cached(_split_sizes_kernel, (1,), args, kw)
    return sizes
