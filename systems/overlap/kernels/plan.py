"""Stage A's Triton kernels (host glue: systems/overlap/plan_device.py; terms: plan.py):
_rows_kernel (group row counts, then every group-level quantity and the counts), _fill_kernel
(bands, schedule, visit, pieces, segments, rows; then the swizzle groups) and _gather_rows_kernel
(the padded GEMM input X). G = E * W groups g = e * W + slot, slot = the owner's position (remote
owners ascending, this rank last). Work words (-1-filled): cnt_enc[g] = rows - 1 (atomic adds),
dmin_enc[g] = BIG - min dst (atomic max).
"""

from __future__ import annotations

import triton
import triton.language as tl

BIG = tl.constexpr(1 << 40)  # > any dst: min dst is BIG - max(BIG - dst)


@triton.jit
def _n_valid(n_rows_ptr, R, HAS_N: tl.constexpr):
    n = R
    if HAS_N:
        n = tl.minimum(tl.load(n_rows_ptr).to(tl.int64), R)
    return n


@triton.jit
def _row_groups(src_ptr, exp_ptr, dst_ptr, i, valid, rank, W):
    """(group e * W + slot, slot, dst) of rows i (int64; slot W-1 = this rank, the local
    group; masked rows give group 0)."""
    src = tl.load(src_ptr + i, mask=valid, other=0).to(tl.int64)
    e = tl.load(exp_ptr + i, mask=valid, other=0).to(tl.int64)
    d = tl.load(dst_ptr + i, mask=valid, other=0).to(tl.int64)
    slot = tl.where(src == rank, W - 1, src - (src > rank).to(tl.int64))
    return e * W + slot, slot, d


@triton.jit
def _rows_kernel(
    src_ptr, exp_ptr, dst_ptr, n_rows_ptr, R, cnt_enc, dmin_enc, ticket, send_counts, gw, ge,
    counts, expert_row_start, recv_rows, rank, E, W, tm, mgb,
    HAS_N: tl.constexpr, BLOCK: tl.constexpr, EP: tl.constexpr, WP: tl.constexpr,
    HAS_SEND: tl.constexpr, COMPACT: tl.constexpr, JB: tl.constexpr = 32,
):  # fmt: skip
    """Group row counts and minimum dst by runs of one group in INPUT order within the block (a
    few atomics per group and block on grouped input, not one per row; correct for any order):
    a run [j_s, j_e] adds j_e + 1 - j_s to the count; a row offers its dst to the minimum unless
    the row before it is of its group with a smaller dst. The last program (_last_program) then
    runs _groups_body; no rows: the grid is one masked program."""
    pid = tl.program_id(0)
    j = tl.arange(0, BLOCK)
    i = pid.to(tl.int64) * BLOCK + j
    n = _n_valid(n_rows_ptr, R, HAS_N)
    valid = i < n
    g, _, d = _row_groups(src_ptr, exp_ptr, dst_ptr, i, valid, rank, W)
    has_prev = valid & (j > 0)
    gp, _, dp = _row_groups(src_ptr, exp_ptr, dst_ptr, i - 1, has_prev, rank, W)
    has_next = (j < BLOCK - 1) & (i + 1 < n)
    gn, _, _ = _row_groups(src_ptr, exp_ptr, dst_ptr, i + 1, has_next, rank, W)
    start = valid & ~(has_prev & (gp == g))
    end = valid & ~(has_next & (gn == g))
    offer = valid & ~(has_prev & (gp == g) & (dp < d))
    jj = j.to(tl.int64)
    tl.atomic_add(cnt_enc + g, -jj, mask=start, sem="relaxed")
    tl.atomic_add(cnt_enc + g, jj + 1, mask=end, sem="relaxed")
    tl.atomic_max(dmin_enc + g, BIG - d, mask=offer, sem="relaxed")
    if _last_program(ticket):
        _groups_body(
            cnt_enc, dmin_enc, n_rows_ptr, R, send_counts, gw, ge, counts, expert_row_start,
            recv_rows, rank, E, W, tm, mgb, EP, WP, HAS_N, HAS_SEND, COMPACT, JB,
        )  # fmt: skip


@triton.jit
def _last_program(ticket):
    """Whether this program is the last of its grid to get here ("last block done", as in CUB
    and the CUDA threadFenceReduction sample): a CTA barrier, ONE scalar acq_rel ticket at GPU
    scope on ticket [1] (-1 before the grid's first); the program drawing num_programs - 2 is
    last, and its acquire (then a CTA barrier, so every thread's loads follow it) makes every
    other program's released writes visible. What a body reads from the other programs is only
    stored or atomically updated before the tickets, never loaded, so no SM holds a stale line."""
    tl.debug_barrier()
    t = tl.atomic_add(ticket, 1, sem="acq_rel", scope="gpu")
    last = t == tl.num_programs(0) - 2
    if last:
        tl.debug_barrier()
    return last


@triton.jit
def _group_tiles(cnt_enc, dmin_enc, E, W, EP: tl.constexpr, WP: tl.constexpr):
    """The groups as [EP, WP] tiles (expert x slot): e1 [EP], s1 [WP], e2, s2, inb (a real
    group), g2 (group id), cnt (rows), dmin (minimum dst; 0 for an empty group)."""
    e1 = tl.arange(0, EP)
    s1 = tl.arange(0, WP)
    e2 = e1[:, None] + s1[None, :] * 0  # [EP, WP]
    s2 = s1[None, :] + e1[:, None] * 0
    inb = (e2 < E) & (s2 < W)
    g2 = e2 * W + s2
    cnt = tl.load(cnt_enc + g2, mask=inb, other=-1) + 1
    dmin = tl.where(cnt > 0, BIG - tl.load(dmin_enc + g2, mask=inb, other=0), 0)
    return e1, s1, e2, s2, inb, g2, cnt, dmin


@triton.jit
def _plan_fields(
    e1, s1, loc, cnt, e_row, P, n_bands, NR, n_segments, E, W, expert_row_start, send_counts,
    recv_rows, counts, n_rows_ptr, R, Q, HAS_N: tl.constexpr, HAS_SEND: tl.constexpr,
):  # fmt: skip
    """What both layouts' group programs write alike from their [EP, WP] tiles (_group_tiles):
    expert_row_start, the receive side and the seven counts (Q: the pieces)."""
    tl.store(expert_row_start + e1, e_row, mask=e1 < E)
    tl.store(expert_row_start + E, P)
    if HAS_SEND:
        sc = tl.load(send_counts + s1, mask=s1 < W, other=0).to(tl.int64)
        tl.store(recv_rows + s1, sc, mask=s1 < W)
    tl.store(counts, _n_valid(n_rows_ptr, R, HAS_N))
    tl.store(counts + 1, P)
    tl.store(counts + 2, n_bands)
    tl.store(counts + 3, NR)
    tl.store(counts + 4, n_segments)
    tl.store(counts + 5, tl.sum(tl.where(loc, cnt, 0)))
    tl.store(counts + 6, Q)


@triton.jit
def _sums_before(
    ge, E, key, e1, RA: tl.constexpr, RB: tl.constexpr, RC: tl.constexpr, EP: tl.constexpr,
    JB: tl.constexpr,
):  # fmt: skip
    """([EP], [EP], [EP]): for each expert i, the sums of ge[RA, j], ge[RB, j] and ge[RC, j] over
    the experts j that precede it in rule (ii)'s order (more remote bands first, then j < i;
    ge[1] holds each expert's remote bands, key [EP] the same in registers); a row -1 is not
    read and its sum stays 0. j goes in chunks of JB read from memory, so the code is [EP, JB]
    wide at any E ([EP, EP] tiles took a minute to compile)."""
    a = tl.zeros([EP], dtype=tl.int64)
    b = tl.zeros([EP], dtype=tl.int64)
    c = tl.zeros([EP], dtype=tl.int64)
    ki = key[:, None]
    for j0 in range(0, E, JB):
        ej = j0 + tl.arange(0, JB)[None, :]
        mj = ej < E
        kj = tl.load(ge + E + ej, mask=mj, other=0)
        before = ((kj > ki) | ((kj == ki) & (ej < e1[:, None]))) & mj
        a += tl.sum(tl.where(before, tl.load(ge + RA * E + ej, mask=mj, other=0), 0), 1)
        if RB >= 0:
            b += tl.sum(tl.where(before, tl.load(ge + RB * E + ej, mask=mj, other=0), 0), 1)
        if RC >= 0:
            c += tl.sum(tl.where(before, tl.load(ge + RC * E + ej, mask=mj, other=0), 0), 1)
    return a, b, c


@triton.jit
def _groups_body(
    cnt_enc, dmin_enc, n_rows_ptr, R, send_counts,
    gw,  # [8, G] work (aligned: cnt, row, nb, band_first, sched_start, seg_before, min dst,
    #      visit base; compact: cnt, first row, pieces, first band, piece base, seg base,
    #      min dst, start within the expert)
    ge,  # [13, E] work: expert start, remote bands, local bands, remote section rows, first band,
    #      remote schedule start, local schedule start, visit start, remote rows, rows; rows
    #      10-12 the bands, pieces and segments per expert that _sums_before reads back
    #      (aligned: rows 1, 10, 12 only)
    counts,  # [7] n_rows, n_padded, n_bands, n_remote_bands, n_segments, n_local, n_pieces
    expert_row_start, recv_rows, rank, E, W, tm, mgb, EP: tl.constexpr, WP: tl.constexpr,
    HAS_N: tl.constexpr, HAS_SEND: tl.constexpr, COMPACT: tl.constexpr, JB: tl.constexpr,
):  # fmt: skip
    """In ONE program, every group-level quantity: aligned, groups padded to tile_m; COMPACT,
    per-expert sections (remote bands, then local-only bands) and each remote group's pieces;
    both, the rule (ii) expert order and the segments per remote group (cut rule)."""
    G = E * W
    e1, s1, e2, s2, inb, g2, cnt, dmin = _group_tiles(cnt_enc, dmin_enc, E, W, EP, WP)
    loc = inb & (s2 == W - 1)
    rem = inb & (s2 < W - 1)
    me = e1 < E
    if COMPACT:
        # sections per expert: remote bands hold the remote rows (and the first local rows of the
        # last one, a mixed band); the local-only bands hold the rest
        rem_e = tl.sum(tl.where(rem, cnt, 0), 1)  # [EP]
        n_e = rem_e + tl.sum(tl.where(loc, cnt, 0), 1)
        key = (rem_e + tm - 1) // tm  # remote bands per expert: rule (ii)'s key
        rsec = tl.minimum(key * tm, n_e)
        nbl = (n_e - rsec + tm - 1) // tm
        e_row = tl.cumsum(n_e, 0) - n_e
        cnt_in = tl.where(inb, cnt, 0)
        within = tl.cumsum(cnt_in, 1) - cnt_in  # group start inside its expert (local: rem_e)
        tot_b = key + nbl
        bfirst = tl.cumsum(tot_b, 0) - tot_b
        # pieces of each remote group: the bands it touches, in send order
        fb = within // tm
        n_units = tl.where(rem & (cnt > 0), (within + cnt - 1) // tm - fb + 1, 0)
        ptot = tl.sum(n_units, 1)
        # rule (ii)'s order (_sums_before): sums read back from ge rows 1, 10, 11 (12 below)
        tl.store(ge + E + e1, key, mask=me)
        if WP == 1:  # one rank: no remote rows, every key 0, so the order is e ascending
            rstart = tl.zeros([EP], dtype=tl.int64)
            vstart, pb = tl.cumsum(tot_b, 0) - tot_b, rstart
        else:
            tl.store(ge + 10 * E + e1, tot_b, mask=me)
            tl.store(ge + 11 * E + e1, ptot, mask=me)
            tl.debug_barrier()
            rstart, vstart, pb = _sums_before(ge, E, key, e1, 1, 10, 11, EP, JB)
        NR = tl.sum(key, 0)
        a = pb[:, None] + tl.cumsum(n_units, 1) - n_units
        Q = tl.sum(ptot, 0)
        n_total = Q  # segments over pieces
        padded = cnt  # no padding rows
        P = tl.sum(n_e, 0)
        w_first, w_start, w_visit = fb, a, within
        tl.store(ge + e1, e_row, mask=me)
        tl.store(ge + 2 * E + e1, nbl, mask=me)
        tl.store(ge + 3 * E + e1, rsec, mask=me)
        tl.store(ge + 4 * E + e1, bfirst, mask=me)
        tl.store(ge + 5 * E + e1, rstart, mask=me)
        tl.store(ge + 6 * E + e1, NR + tl.cumsum(nbl, 0) - nbl, mask=me)
        tl.store(ge + 7 * E + e1, vstart, mask=me)
        tl.store(ge + 8 * E + e1, rem_e, mask=me)
        tl.store(ge + 9 * E + e1, n_e, mask=me)
    else:
        n_units = (cnt + tm - 1) // tm  # bands per group
        padded = tl.where(loc, cnt, n_units * tm)
        # layout: groups in g order; first padded row and first band id of each group
        tot_p = tl.sum(padded, 1)
        e_row = tl.cumsum(tot_p, 0) - tot_p
        tot_b = tl.sum(n_units, 1)
        bfirst = (tl.cumsum(tot_b, 0) - tot_b)[:, None] + tl.cumsum(n_units, 1) - n_units
        # schedule: experts by (-remote bands, e), read back from ge (rows 1, 10)
        nb_r = tl.where(rem, n_units, 0)
        key = tl.sum(nb_r, 1)  # [EP] remote bands per expert
        lb = tl.sum(tl.where(loc, n_units, 0), 1)
        if WP == 1:  # one rank: no remote bands, every key 0, so the order is e ascending
            rb_before = tl.zeros([EP], dtype=tl.int64)
            vstart = tl.cumsum(lb, 0) - lb
        else:
            tl.store(ge + E + e1, key, mask=me)
            tl.store(ge + 10 * E + e1, key + lb, mask=me)
            tl.debug_barrier()
            rb_before, vstart, _ = _sums_before(ge, E, key, e1, 1, 10, -1, EP, JB)
        NR = tl.sum(key, 0)
        a = rb_before[:, None] + tl.cumsum(nb_r, 1) - nb_r
        lstart = NR + tl.cumsum(lb, 0) - lb
        # a group's first position in order="expert"'s visiting order (plan.producer_order:
        # experts in remote-first order, each its remote bands then its local bands)
        vbase = tl.where(loc, (vstart + key)[:, None], vstart[:, None] + a - rb_before[:, None])
        n_total = NR  # segments over remote bands
        Q = 0
        P = tl.sum(tot_p, 0)
        w_first, w_start, w_visit = bfirst, tl.where(loc, lstart[:, None], a), vbase
    # segments per remote group over its units (bands, or pieces), by the cut rule
    lo = tl.maximum(a, 1)
    hi = tl.minimum(a + n_units - 1, n_total - 2)
    mid = tl.maximum(hi - lo + 1, 0)
    first = ((a == 0) & (n_units > 0)).to(tl.int64)
    last = ((n_total - 1 > 0) & (a <= n_total - 1) & (n_total - 1 < a + n_units)).to(tl.int64)
    nseg = tl.where(rem, (mid + mgb - 1) // mgb + first + last, 0)
    segtot = tl.sum(nseg, 1)
    if WP == 1:  # no remote group: no segments
        seg_e = tl.zeros([EP], dtype=tl.int64)
    else:
        tl.store(ge + 12 * E + e1, segtot, mask=me)
        tl.debug_barrier()
        seg_e, _, _ = _sums_before(ge, E, key, e1, 12, -1, -1, EP, JB)
    segb = seg_e[:, None] + tl.cumsum(nseg, 1) - nseg
    row = e_row[:, None] + tl.cumsum(padded, 1) - padded
    tl.store(gw + g2, cnt, mask=inb)
    tl.store(gw + G + g2, row, mask=inb)
    tl.store(gw + 2 * G + g2, n_units, mask=inb)
    tl.store(gw + 3 * G + g2, w_first, mask=inb)
    tl.store(gw + 4 * G + g2, w_start, mask=inb)
    tl.store(gw + 5 * G + g2, segb, mask=inb)
    tl.store(gw + 6 * G + g2, dmin, mask=inb)
    tl.store(gw + 7 * G + g2, w_visit, mask=inb)
    _plan_fields(
        e1, s1, loc, cnt, e_row, P, tl.sum(tot_b, 0), NR, tl.sum(segtot, 0), E, W,
        expert_row_start, send_counts, recv_rows, counts, n_rows_ptr, R, Q, HAS_N, HAS_SEND,
    )  # fmt: skip


@triton.jit
def _segment_of(p, a, n, segb, NU, mgb):
    """The segment rule at send position p (int64 vector) of a group whose n units (bands, or
    pieces) sit at a .. a + n - 1 of NU units, its segments numbered from segb: (segment of
    p, whether p starts it, its unit count where it does)."""
    lo = tl.maximum(a, 1)
    hi = tl.minimum(a + n - 1, NU - 2)
    mid_ok = (p >= lo) & (hi >= lo)
    n_mid = tl.where(mid_ok, (tl.minimum(p, hi) - lo) // mgb + 1, 0)
    n_last = ((NU - 1 > 0) & (p >= NU - 1)).to(tl.int64)
    seg = segb + (a == 0).to(tl.int64) + n_mid + n_last - 1
    ends = (p == 0) | (p == NU - 1)
    is_start = ends | (mid_ok & (p <= hi) & ((p - lo) % mgb == 0))
    c = tl.where(ends, 1, tl.minimum(p + mgb, hi + 1) - p)
    return seg, is_start, c


@triton.jit
def _fill_kernel(
    src_ptr, exp_ptr, dst_ptr, n_rows_ptr, R, gw, ge, counts,  # inputs and work
    row_pos, gather_index,
    row_dst,  # [P'] each local row's receive position at its padded row
    band_expert, band_row, band_rows, band_dst, band_valid, band_offset, schedule, visit,
    piece_band, piece_row, piece_rows, piece_offset,
    seg_start, seg_count, seg_dst,
    rank, E, W, tm, mgb,
    ticket, groups, B, cap,  # GROUPS: ticket [1] (-1-filled), groups [B], the group cap
    COMPACT: tl.constexpr, HAS_N: tl.constexpr, QB: tl.constexpr, BLOCK: tl.constexpr,
    GROUPS: tl.constexpr, ORDERED: tl.constexpr, CODE: tl.constexpr, GBLOCK: tl.constexpr,
):  # fmt: skip
    """Aligned: programs [0, G) one group each (its bands in layout order, schedule entries,
    places in the order="expert" visiting order `visit`, segments). COMPACT: [0, E) one
    expert's bands, schedule entries and visiting positions; [E, E + G) one remote group's
    pieces and the segments that start there. Then one row block each (_fill_rows). GROUPS:
    the last program then runs _producer_groups_body (ORDERED: over `visit`)."""
    pid = tl.program_id(0)
    G = E * W
    n_struct = G  # programs before the row blocks
    if COMPACT:
        n_struct = G + E
    if pid >= n_struct:
        _fill_rows(
            pid - n_struct, src_ptr, exp_ptr, dst_ptr, n_rows_ptr, R, gw, G, row_pos,
            gather_index, row_dst, rank, W, HAS_N, BLOCK,
        )  # fmt: skip
    elif COMPACT:
        if pid < E:
            e = pid
            nbr = tl.load(ge + E + e)
            nb = nbr + tl.load(ge + 2 * E + e)
            e_row = tl.load(ge + e)
            rsec = tl.load(ge + 3 * E + e)
            bfirst = tl.load(ge + 4 * E + e)
            rstart = tl.load(ge + 5 * E + e)
            lstart = tl.load(ge + 6 * E + e)
            vstart = tl.load(ge + 7 * E + e)
            rem_e = tl.load(ge + 8 * E + e)
            n_e = tl.load(ge + 9 * E + e)
            for q0 in range(0, nb, QB):
                q = q0 + tl.arange(0, QB).to(tl.int64)
                m = q < nb
                is_r = q < nbr
                qq = tl.where(is_r, q, q - nbr)
                o = tl.where(is_r, 0, rsec) + qq * tm  # first row of the band inside the expert
                rows = tl.minimum(tl.where(is_r, rsec, n_e) - o, tm)
                band = bfirst + q
                tl.store(band_expert + band, e + q * 0, mask=m)
                tl.store(band_row + band, e_row + o, mask=m)
                tl.store(band_rows + band, rows, mask=m)
                tl.store(band_valid + band, rows, mask=m)
                # owner and destination row of the band's first row
                dst = rank + q * 0
                off = tl.load(gw + 6 * G + e * W + W - 1) + o - rem_e
                for s in range(0, W - 1):
                    g = e * W + s
                    c = tl.load(gw + g)
                    ws = tl.load(gw + 7 * G + g)
                    hit = is_r & (c > 0) & (ws <= o) & (o < ws + c)
                    dst = tl.where(hit, s + (s >= rank).to(tl.int64), dst)
                    off = tl.where(hit, tl.load(gw + 6 * G + g) + o - ws, off)
                tl.store(band_dst + band, dst, mask=m)
                tl.store(band_offset + band, off, mask=m)
                pos = tl.where(is_r, rstart + q, lstart + qq)
                tl.store(schedule + pos, band, mask=m)
                tl.store(visit + vstart + q, pos, mask=m)
        else:
            g = pid - E
            npc = tl.load(gw + 2 * G + g)
            if npc > 0:  # a remote group with rows
                e = g // W
                s = g % W
                owner = s + (s >= rank).to(tl.int32)
                c = tl.load(gw + g)
                gs = tl.load(gw + G + g)
                fb = tl.load(gw + 3 * G + g)
                a = tl.load(gw + 4 * G + g)
                segb = tl.load(gw + 5 * G + g)
                dmin = tl.load(gw + 6 * G + g)
                e_row = tl.load(ge + e)
                bfirst = tl.load(ge + 4 * E + e)
                NQ = tl.load(counts + 6)
                for j0 in range(0, npc, QB):
                    j = j0 + tl.arange(0, QB).to(tl.int64)
                    m = j < npc
                    brow = e_row + (fb + j) * tm
                    prow = tl.maximum(gs, brow)
                    u = a + j  # piece position in send order
                    tl.store(piece_band + u, bfirst + fb + j, mask=m)
                    tl.store(piece_row + u, prow, mask=m)
                    tl.store(piece_rows + u, tl.minimum(gs + c, brow + tm) - prow, mask=m)
                    tl.store(piece_offset + u, dmin + prow - gs, mask=m)
                    seg, is_start, k = _segment_of(u, a, npc, segb, NQ, mgb)
                    tl.store(seg_start + seg, u, mask=m & is_start)
                    tl.store(seg_count + seg, k, mask=m & is_start)
                    tl.store(seg_dst + seg, owner + j * 0, mask=m & is_start)
    else:
        g = pid
        nb = tl.load(gw + 2 * G + g)
        if nb > 0:
            e = g // W
            s = g % W
            is_loc = s == W - 1
            owner = tl.where(is_loc, rank, s + (s >= rank).to(tl.int32))
            cnt = tl.load(gw + g)
            row = tl.load(gw + G + g)
            bfirst = tl.load(gw + 3 * G + g)
            a = tl.load(gw + 4 * G + g)
            segb = tl.load(gw + 5 * G + g)
            dmin = tl.load(gw + 6 * G + g)
            NR = tl.load(counts + 3)
            for q0 in range(0, nb, QB):
                q = q0 + tl.arange(0, QB).to(tl.int64)
                m = q < nb
                band = bfirst + q
                valid = tl.minimum(cnt - q * tm, tm)
                tl.store(band_expert + band, e + q * 0, mask=m)
                tl.store(band_row + band, row + q * tm, mask=m)
                tl.store(band_rows + band, tl.where(is_loc, valid, tm), mask=m)
                tl.store(band_dst + band, owner + q * 0, mask=m)
                tl.store(band_valid + band, valid, mask=m)
                tl.store(band_offset + band, dmin + q * tm, mask=m)
                tl.store(schedule + a + q, band, mask=m)
                tl.store(visit + tl.load(gw + 7 * G + g) + q, a + q, mask=m)
                if s != W - 1:
                    p = a + q  # schedule position
                    seg, is_start, c = _segment_of(p, a, nb, segb, NR, mgb)
                    tl.store(seg_start + seg, p, mask=m & is_start)
                    tl.store(seg_count + seg, c, mask=m & is_start)
                    tl.store(seg_dst + seg, owner + q * 0, mask=m & is_start)
    if GROUPS:
        if _last_program(ticket):
            _producer_groups_body(
                visit, schedule, band_expert, counts, groups, B, cap, CODE, ORDERED, GBLOCK
            )


@triton.jit
def _fill_rows(
    blk, src_ptr, exp_ptr, dst_ptr, n_rows_ptr, R, gw, G, row_pos, gather_index, row_dst, rank,
    W, HAS_N: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    """One block of rows: padded position (the group's first row gw[1] + dst - its minimum dst
    gw[6]), gather index, and each local row's place in the own receive buffer at its padded
    position (row_dst; -1 is pre-filled)."""
    j = tl.arange(0, BLOCK)
    i = blk.to(tl.int64) * BLOCK + j
    valid = i < _n_valid(n_rows_ptr, R, HAS_N)
    gr, slot, d = _row_groups(src_ptr, exp_ptr, dst_ptr, i, valid, rank, W)
    gr = tl.where(valid, gr, 0)
    rp = tl.load(gw + G + gr, mask=valid, other=0) + d - tl.load(gw + 6 * G + gr, mask=valid)
    tl.store(row_pos + i, rp, mask=valid)
    tl.store(gather_index + rp, i, mask=valid)
    tl.store(row_dst + rp, d, mask=valid & (slot == W - 1))


@triton.jit
def _gather_rows_kernel(
    src, dst, src_index, n_ptr, K, row_of, BR: tl.constexpr, BK: tl.constexpr,
    HAS_ROWS: tl.constexpr,
):  # fmt: skip
    """dst[i] = src[src_index[i]] for i < *n_ptr (HAS_ROWS: src[row_of[src_index[i]]], the
    received row's row of the tokens it came from); a row with src_index < 0 is written as
    zeros. BR rows a program, all K columns in BK steps."""
    pid = tl.program_id(0)
    n = tl.load(n_ptr)
    i = pid.to(tl.int64) * BR + tl.arange(0, BR)
    if pid.to(tl.int64) * BR < n:
        m = i < n
        si = tl.load(src_index + i, mask=m, other=-1)
        ok = si >= 0
        si = tl.where(ok, si, 0)
        if HAS_ROWS:
            si = tl.load(row_of + si, mask=ok, other=0)
        cols = tl.arange(0, BK)
        for k0 in range(0, K, BK):
            kk = k0 + cols
            mk = kk[None, :] < K
            v = tl.load(src + si[:, None] * K + kk[None, :], mask=ok[:, None] & mk, other=0.0)
            tl.store(dst + i[:, None] * K + kk[None, :], v, mask=m[:, None] & mk)


@triton.jit
def _max_combine(a, b):
    return tl.maximum(a, b)


@triton.jit
def _min_combine(a, b):
    return tl.minimum(a, b)


@triton.jit
def _visit_key(v, visit, schedule, band_expert, B, n_bands, ORDERED: tl.constexpr):
    """The expert of the band at visiting positions v, or -1 - v past n_bands (groups of one)."""
    vc = tl.minimum(tl.maximum(v, 0), B - 1)
    pos = vc
    if ORDERED:
        pos = tl.minimum(tl.maximum(tl.load(visit + vc).to(tl.int64), 0), B - 1)
    band = tl.minimum(tl.maximum(tl.load(schedule + pos).to(tl.int64), 0), B - 1)
    e = tl.load(band_expert + band).to(tl.int64)
    return tl.where(v < n_bands, e, -1 - v)


@triton.jit
def _producer_groups_body(
    visit, schedule, band_expert, counts, groups, B, cap,
    CODE: tl.constexpr, ORDERED: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    """In ONE program, plan.producer_groups on the device: pass 1 (blocks forward) each visiting
    position's run start (a running max of the positions where the expert changes), kept in
    `groups`; pass 2 (blocks backward) the run's end (a reverse running min), then the run cut
    into ceil(run / cap) near-equal groups, stored as first * CODE + size."""
    n_bands = tl.load(counts + 2)
    lane = tl.arange(0, BLOCK).to(tl.int64)
    carry = tl.zeros((), tl.int64)
    for b0 in range(0, B, BLOCK):
        v = b0 + lane
        key = _visit_key(v, visit, schedule, band_expert, B, n_bands, ORDERED)
        prev = _visit_key(v - 1, visit, schedule, band_expert, B, n_bands, ORDERED)
        start = (v == 0) | (key != prev)
        first = tl.maximum(tl.associative_scan(tl.where(start, v, 0), 0, _max_combine), carry)
        tl.store(groups + v, first.to(tl.int32), mask=v < B)
        carry = tl.max(tl.where(v < B, first, 0), 0)
    carry = tl.zeros((), tl.int64) + B
    n_blk = tl.cdiv(B, BLOCK)
    for i in range(0, n_blk):
        v = (n_blk - 1 - i) * BLOCK + lane
        m = v < B
        key = _visit_key(v, visit, schedule, band_expert, B, n_bands, ORDERED)
        nxt = _visit_key(v + 1, visit, schedule, band_expert, B, n_bands, ORDERED)
        last = (v == B - 1) | (key != nxt)
        end = tl.where(m & last, v + 1, B)
        end = tl.minimum(tl.associative_scan(end, 0, _min_combine, reverse=True), carry)
        carry = tl.min(tl.where(m, end, B), 0)
        first = tl.load(groups + v, mask=m, other=0).to(tl.int64)
        n = end - first
        chunks = (n + cap - 1) // cap
        base = n // chunks
        extra = n % chunks
        o = v - first
        big = extra * (base + 1)
        ob = o - big
        g0 = tl.where(o < big, o - o % (base + 1), big + ob - ob % tl.maximum(base, 1))
        size = tl.where(o < big, base + 1, base)
        tl.store(groups + v, ((first + g0) * CODE + size).to(tl.int32), mask=m)
