"""Property tests of stage A (systems/overlap/plan.py) on random routings."""

import warnings
from dataclasses import fields

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from harness.layout import rank_layout
from harness.workload import WorkloadSpec
from systems.overlap.plan import (
    GROUP_CODE,
    build_plan,
    padded_input,
    producer_groups,
    producer_order,
)
from tests.overlap_testing import (
    local_rows,
    plan_pieces,
    plan_segments,
    plans_for_spec,
    rows_sent,
    synthetic_plan,
    synthetic_rows,
)

SETTINGS = settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def _synthetic(W, E, rank, max_rows, p_empty, seed):
    """Expert-side rows of `rank` in a random order, like harness.layout.RankLayout.

    Returns recv_src, recv_expert, recv_dst_index [R] and the owners' buffer sizes [W].
    """
    g = torch.Generator().manual_seed(seed)
    cnt = torch.randint(0, max_rows + 1, (W, E), generator=g)
    cnt[torch.rand(W, E, generator=g) < p_empty] = 0
    per_src = cnt.sum(1)
    before = torch.randint(0, 50, (W,), generator=g)  # rows the owner sends to lower ranks
    after = torch.randint(0, 50, (W,), generator=g)
    src = torch.repeat_interleave(torch.arange(W).repeat_interleave(E), cnt.reshape(-1))
    expert = torch.repeat_interleave(torch.arange(E).repeat(W), cnt.reshape(-1))
    first = torch.cumsum(per_src, 0) - per_src
    dst = before[src] + torch.arange(src.numel()) - first[src]
    perm = torch.randperm(src.numel(), generator=g)
    return src[perm], expert[perm], dst[perm], before + per_src + after


def _band_rows(plan):
    """Padded row of every row of every band [P] and its band id [P]."""
    b = torch.repeat_interleave(torch.arange(plan.n_bands), plan.band_rows)
    within = torch.arange(b.numel()) - (torch.cumsum(plan.band_rows, 0) - plan.band_rows)[b]
    return plan.band_row[b] + within, b, within


def _segment_rows(plan):
    """Padded row, destination and destination offset of every row each segment sends."""
    src_row, rows, offset = plan_segments(plan)
    s = torch.repeat_interleave(torch.arange(plan.n_segments), rows)
    within = torch.arange(s.numel()) - (torch.cumsum(rows, 0) - rows)[s]
    return src_row[s] + within, plan.seg_dst[s], offset[s] + within


def check_plan(plan, src, expert, dst, buf_rows):
    W, E, tm, rank = plan.world_size, plan.experts_per_rank, plan.tile_m, plan.rank
    R, P, B, NR = plan.n_rows, plan.n_padded, plan.n_bands, plan.n_remote_bands
    gi = plan.gather_index
    # Layout: every x_recv row exactly once; padding rows are -1.
    assert R == src.numel() and gi.numel() == P
    assert torch.equal(gi[plan.row_pos], torch.arange(R))
    assert int((gi == -1).sum()) == P - R
    assert int(plan.expert_row_start[-1]) == P
    # Bands tile [0, P) in layout order; one destination and one expert per band.
    assert torch.equal(plan.band_row, torch.cumsum(plan.band_rows, 0) - plan.band_rows)
    rows, b, within = _band_rows(plan)
    assert torch.equal(rows, torch.arange(P))
    valid = within < plan.band_valid[b]
    assert torch.equal(valid, gi >= 0)  # padding = the trailing rows of a band, never inside
    x = gi[valid]
    assert torch.equal(src[x], plan.band_dst[b[valid]])
    assert torch.equal(expert[x], plan.band_expert[b[valid]])
    rs, re = plan.expert_row_start[:-1], plan.expert_row_start[1:]
    assert bool(
        ((plan.band_row >= rs[plan.band_expert]) & (plan.band_row < re[plan.band_expert])).all()
    )
    # Remote bands are full tile_m bands; local bands are never padded.
    remote = plan.band_dst != rank
    assert bool((plan.band_rows[remote] == tm).all())
    assert torch.equal(plan.band_valid[~remote], plan.band_rows[~remote])
    assert bool((plan.band_valid >= 1).all()) and bool((plan.band_rows <= tm).all())
    # Within an expert: remote owners ascending, local last.
    slot = torch.where(plan.band_dst == rank, W, plan.band_dst)
    key = plan.band_expert * (W + 1) + slot
    assert bool((key[1:] >= key[:-1]).all())
    # Every valid row lands at its own position; per destination disjoint and in bounds.
    assert torch.equal(dst[x], plan.band_offset[b[valid]] + within[valid])
    pos = plan.band_dst[b[valid]] * (int(buf_rows.max()) + 1) + dst[x]
    assert torch.unique(pos).numel() == pos.numel()
    assert bool((plan.band_offset + plan.band_valid <= buf_rows[plan.band_dst]).all())
    # Schedule: a permutation, remote first (rule i), rule (ii), layout order inside.
    sched = plan.schedule
    assert torch.equal(torch.sort(sched).values, torch.arange(B))
    assert NR == int(remote.sum())
    assert bool(remote[sched[:NR]].all()) and not bool(remote[sched[NR:]].any())
    assert bool((sched[NR:].diff() > 0).all())
    rexp = plan.band_expert[sched[:NR]]
    rb = torch.bincount(plan.band_expert[remote], minlength=E)
    blocks = torch.unique_consecutive(rexp)
    assert blocks.numel() == torch.unique(rexp).numel()  # one block per expert
    want = [e for e in sorted(range(E), key=lambda e: (-int(rb[e]), e)) if rb[e] > 0]
    assert blocks.tolist() == want
    assert bool((sched[:NR].diff()[rexp.diff() == 0] > 0).all())
    # Segments: cover the remote schedule once, in order; first/last single; middle <= mgb.
    S = plan.n_segments
    if NR == 0:
        assert S == 0
    else:
        assert int(plan.seg_start[0]) == 0
        assert torch.equal(plan.seg_start[1:], (plan.seg_start + plan.seg_count)[:-1])
        assert int(plan.seg_start[-1] + plan.seg_count[-1]) == NR
        assert int(plan.seg_count[0]) == 1 and int(plan.seg_count[-1]) == 1
        assert bool((plan.seg_count >= 1).all() & (plan.seg_count <= plan.mgb).all())
        seg_of = torch.repeat_interleave(torch.arange(S), plan.seg_count)
        rband = sched[:NR]
        group = plan.band_expert[rband] * W + plan.band_dst[rband]
        assert torch.equal(plan.band_dst[rband], plan.seg_dst[seg_of])  # never two destinations
        assert torch.equal(group, group[plan.seg_start[seg_of]])  # the cut rule: one group
        # A middle segment is short only where its group ends or the last band follows.
        end = plan.seg_start + plan.seg_count
        short = (plan.seg_count < plan.mgb) & (torch.arange(S) > 0) & (torch.arange(S) < S - 1)
        nxt = end[short].clamp(max=NR - 1)
        assert bool(((end[short] >= NR - 1) | (group[nxt] != group[end[short] - 1])).all())
    # The rows sent are exactly the remote rows, each at its own destination position.
    srow, sdst, soff = _segment_rows(plan)
    sx = gi[srow]
    assert bool((sx >= 0).all())
    assert torch.equal(src[sx], sdst) and torch.equal(dst[sx], soff)
    assert torch.equal(torch.sort(sx).values, torch.nonzero(src != rank).squeeze(1))
    assert rows_sent(plan) == torch.bincount(src[src != rank], minlength=W).tolist()
    # Local rows: stored at row_dst, never sent.
    local_src, local_dst = local_rows(plan)
    lx = gi[local_src]
    assert plan.n_local == int((src == rank).sum())
    assert torch.equal(lx, torch.nonzero(src == rank).squeeze(1))
    assert torch.equal(dst[lx], local_dst)
    # The padded GEMM input: x_recv rows at row_pos, zero padding rows.
    x_recv = torch.arange(R * 2, dtype=torch.float32).view(R, 2) + 1
    want = x_recv.new_zeros(P, 2)
    want[plan.row_pos] = x_recv
    assert torch.equal(padded_input(x_recv, gi), want)
    return plan


@SETTINGS
@given(
    W=st.sampled_from([1, 2, 3, 4, 8]),
    E=st.integers(1, 16),
    tm=st.sampled_from([16, 64, 128, 256]),
    mgb=st.integers(1, 3),
    rank_frac=st.floats(0, 0.999),
    rows_mult=st.sampled_from([0.0, 0.3, 1.0, 2.5]),
    p_empty=st.sampled_from([0.0, 0.3, 0.8, 1.0]),
    seed=st.integers(0, 2**31 - 1),
)
def test_plan_properties_synthetic(W, E, tm, mgb, rank_frac, rows_mult, p_empty, seed):
    rank = int(rank_frac * W)
    src, expert, dst, buf_rows = _synthetic(W, E, rank, int(rows_mult * tm), p_empty, seed)
    plan = build_plan(
        src,
        expert,
        dst,
        world_size=W,
        rank=rank,
        experts_per_rank=E,
        tile_m=tm,
        mgb=mgb,
        out_cols=24,
        elem_bytes=2,
    )
    check_plan(plan, src, expert, dst, buf_rows)


@settings(max_examples=60, deadline=None)
@given(
    W=st.sampled_from([1, 2, 3, 4, 8]),
    E=st.integers(1, 6),
    tm=st.sampled_from([16, 64]),
    mgb=st.integers(1, 2),
    routing=st.sampled_from(["balanced", "moderate_skew", "stress_skew"]),
    tokens=st.integers(1, 120),
    seed=st.integers(0, 1000),
)
def test_plans_of_all_ranks_fill_every_receive_buffer_exactly(W, E, tm, mgb, routing, tokens, seed):
    """Real routings: the W plans together write every row of every owner's receive buffer
    exactly once, with the right token, and each plan passes the single-rank properties."""
    if 2 > W * E:
        return
    spec = WorkloadSpec(
        tokens_per_rank=tokens,
        hidden=8,
        out=8,
        experts_per_rank=E,
        top_k=2,
        world_size=W,
        routing=routing,
        seed=seed,
    )
    plans, lays = plans_for_spec(spec, tile_m=tm, mgb=mgb)
    S_rows = torch.stack([lay.send_counts.sum() for lay in lays])
    hits = [torch.zeros(int(n), dtype=torch.int64) for n in S_rows]
    for plan, lay in zip(plans, lays):
        check_plan(plan, lay.recv_src, lay.recv_expert, lay.recv_dst_index, S_rows)
        srow, sdst, soff = _segment_rows(plan)
        x = plan.gather_index[srow]
        for d in range(W):
            sel = sdst == d
            hits[d].index_add_(0, soff[sel], torch.ones_like(soff[sel]))
            assert torch.equal(lays[d].send_token[soff[sel]], lay.recv_token[x[sel]])
        local_dst = local_rows(plan)[1]
        hits[plan.rank].index_add_(0, local_dst, torch.ones_like(local_dst))
        assert torch.equal(plan.recv_rows, lay.send_counts)
    for d in range(W):
        assert bool((hits[d] == 1).all())
        # what each peer sends to d is what d expects from it
        sent = torch.tensor([rows_sent(p)[d] for p in plans])
        expect = plans[d].recv_rows.clone()
        expect[d] = 0
        assert torch.equal(sent, expect)


def test_plan_of_rank_layout_edge_cases():
    """W=1 (no remote rows), an empty rank, tile_m=1 (no padding)."""
    spec = WorkloadSpec(
        tokens_per_rank=8,
        hidden=8,
        out=8,
        experts_per_rank=64,
        top_k=1,
        world_size=2,
        routing="stress_skew",
    )
    for tm in (1, 16):
        for r in range(2):
            lay = rank_layout(spec, r)
            plan = plans_for_spec(spec, tile_m=tm, mgb=2)[0][r]
            check_plan(
                plan, lay.recv_src, lay.recv_expert, lay.recv_dst_index, lay.send_counts * 0 + 10**6
            )
            if tm == 1:
                assert plan.n_padded == plan.n_rows
    e = torch.empty(0, dtype=torch.int64)
    plan = build_plan(
        e,
        e,
        e,
        world_size=3,
        rank=1,
        experts_per_rank=4,
        tile_m=64,
        mgb=2,
        out_cols=8,
        elem_bytes=2,
    )
    assert (plan.n_padded, plan.n_bands, plan.n_segments) == (0, 0, 0)


@pytest.mark.gpu
def test_plan_on_gpu_equals_cpu_with_one_host_sync():
    """The same plan on CUDA as on the CPU, and building it synchronises with the host once."""
    spec = WorkloadSpec(
        tokens_per_rank=512,
        hidden=8,
        out=8,
        experts_per_rank=8,
        top_k=2,
        world_size=4,
        routing="stress_skew",
    )
    lay = rank_layout(spec, 1)
    kw = dict(world_size=4, rank=1, experts_per_rank=8, tile_m=64, mgb=2, out_cols=8, elem_bytes=2)
    cpu = build_plan(lay.recv_src, lay.recv_expert, lay.recv_dst_index, **kw)
    dev = torch.device("cuda")
    args = [t.to(dev) for t in (lay.recv_src, lay.recv_expert, lay.recv_dst_index)]
    build_plan(*args, **kw)  # warm-up
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            gpu = build_plan(*args, **kw)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    syncs = [w for w in caught if "synchroniz" in str(w.message)]
    assert len(syncs) == 1, [str(w.message) for w in syncs]
    for f in fields(cpu):
        a, b = getattr(cpu, f.name), getattr(gpu, f.name)
        if isinstance(a, torch.Tensor):
            assert b.is_cuda and torch.equal(a, b.cpu()), f.name
        else:
            assert a == b, f.name


def test_synthetic_plans_come_from_build_plan():
    """tests.overlap_testing's plans (kernel tests, benchmarks) are stage-A plans."""
    rows = [[20, 16, 5], [0, 33, 18]]  # rows[e][s], this rank = 2
    plan = synthetic_plan(rows, rank=2, tile_m=16, mgb=2, dst_base=[3, 7, 0])
    src, expert, dst, dst_rows = synthetic_rows(rows, rank=2, dst_base=[3, 7, 0])
    check_plan(plan, src, expert, dst, torch.tensor(dst_rows))
    assert dst_rows == plan.dst_rows == [3 + 20, 7 + 16 + 33, 5 + 18]
    # x_recv rows in layout order: experts ascending, remote owners ascending, the local last
    assert src.tolist() == [0] * 20 + [1] * 16 + [2] * 5 + [1] * 33 + [2] * 18
    # destination d's rows are consecutive from dst_base[d] in (expert, row) order
    assert dst[src == 1].tolist() == list(range(7, 7 + 16 + 33))


def test_row_dst_holds_each_local_rows_receive_place():
    from systems.overlap.plan import plan_for_layout

    spec = WorkloadSpec(64, 16, 16, 4, 2, 4, "stress_skew", seed=1)
    lay = rank_layout(spec, 2)
    shape = dict(world_size=4, experts_per_rank=4, tile_m=8, mgb=1, out_cols=16, elem_bytes=2)
    for layout in ("aligned", "compact"):
        plan = plan_for_layout(lay, layout=layout, **shape)
        assert plan.row_dst.shape == (plan.n_padded,)
        want = torch.full((plan.n_padded,), -1, dtype=torch.int64)
        local = lay.recv_src == 2
        want[plan.row_pos[local]] = lay.recv_dst_index[local]
        assert torch.equal(plan.row_dst, want) and plan.n_local > 0


# -- layout=compact ------------------------------------------------------------------------


def check_compact_plan(plan, src, expert, dst, buf_rows):
    """Properties of a compact plan (build_plan(..., layout="compact"))."""
    W, E, tm, rank = plan.world_size, plan.experts_per_rank, plan.tile_m, plan.rank
    R, P, B, NR = plan.n_rows, plan.n_padded, plan.n_bands, plan.n_remote_bands
    gi = plan.gather_index
    assert plan.layout == "compact"
    # Layout: every x_recv row once; per expert remote rows (owners ascending) then local rows.
    assert torch.equal(gi[plan.row_pos], torch.arange(R))
    assert int(plan.expert_row_start[-1]) == P
    rows, b, within = _band_rows(plan)
    assert torch.equal(rows, torch.arange(P))
    valid = within < plan.band_valid[b]
    assert torch.equal(valid, gi >= 0)  # padding = the trailing rows of a band
    x = gi[valid]
    assert torch.equal(expert[x], plan.band_expert[b[valid]])
    slot = torch.where(src[x] == rank, W, src[x])
    key = expert[x] * (W + 1) + slot
    assert bool((key[1:] >= key[:-1]).all())  # experts ascending, owners ascending, local last
    assert plan.n_padded == plan.n_rows  # no padding
    # Bands: remote bands hold remote rows, full tile_m but an expert's last, where the expert's
    # first local rows may follow in the same, mixed, band.
    is_remote = torch.zeros(B, dtype=torch.bool).index_fill_(0, plan.schedule[:NR], True)
    rr = src[x] != rank
    assert bool(is_remote[b[valid]][rr].all())
    n_e = torch.bincount(expert, minlength=E)
    assert torch.equal(torch.bincount(plan.band_expert, minlength=E), (n_e + tm - 1) // tm)
    assert torch.equal(plan.band_valid, plan.band_rows)
    last = torch.ones(B, dtype=torch.bool)
    last[:-1] = plan.band_expert[1:] != plan.band_expert[:-1]
    assert bool((plan.band_rows[~last] == tm).all())
    # a mixed band's local rows follow its remote rows
    mixed_local = (~rr) & is_remote[b[valid]]
    assert bool((within[valid][mixed_local] >= 1).all())
    assert torch.equal(plan.band_valid[~is_remote], plan.band_rows[~is_remote])
    assert bool((plan.band_dst[~is_remote] == rank).all())
    first = gi[plan.band_row]
    assert torch.equal(plan.band_dst[is_remote], src[first[is_remote]])
    assert torch.equal(plan.band_offset, dst[first])
    # Schedule: a permutation; bands with remote rows first, by rule (ii); local ascending.
    sched = plan.schedule
    assert torch.equal(torch.sort(sched).values, torch.arange(B))
    assert bool((sched[NR:].diff() > 0).all())
    rexp = plan.band_expert[sched[:NR]]
    rb = torch.bincount(plan.band_expert[is_remote], minlength=E)
    assert torch.unique_consecutive(rexp).tolist() == [
        e for e in sorted(range(E), key=lambda e: (-int(rb[e]), e)) if rb[e] > 0
    ]
    assert bool((sched[:NR].diff()[rexp.diff() == 0] > 0).all())
    # Pieces: every remote row exactly once, each piece one owner inside its band, contiguous
    # in Y and at its destination; in send order (schedule position, then row).
    u = plan_pieces(plan)
    Q = u.band.numel()
    assert bool((u.rows >= 1).all())
    assert bool((u.row >= plan.band_row[u.band]).all())
    assert bool((u.row + u.rows <= plan.band_row[u.band] + plan.band_valid[u.band]).all())
    q = torch.repeat_interleave(torch.arange(Q), u.rows)
    inner = torch.arange(q.numel()) - (torch.cumsum(u.rows, 0) - u.rows)[q]
    px = gi[u.row[q] + inner]
    assert bool((px >= 0).all())
    assert torch.equal(src[px], u.dst[q]) and torch.equal(dst[px], u.offset[q] + inner)
    assert torch.equal(torch.sort(px).values, torch.nonzero(src != rank).squeeze(1))
    pos = torch.empty(B, dtype=torch.int64)
    pos[sched] = torch.arange(B)
    okey = pos[u.band] * (P + 1) + u.row
    assert bool((okey.diff() > 0).all())
    # a band with rows of k remote owners has k pieces (so a mixed band is split by owner)
    owners = torch.unique(torch.stack([b[valid], src[x]], 1)[src[x] != rank], dim=0)
    assert torch.equal(
        torch.bincount(owners[:, 0], minlength=B), torch.bincount(u.band, minlength=B)
    )
    # Segments: cover the pieces once, in order; first/last single; middle <= mgb; one
    # (expert, destination) group each; one contiguous range of Y and of the destination.
    S = plan.n_segments
    if Q == 0:
        assert S == 0 and NR == 0
    else:
        assert int(plan.seg_start[0]) == 0
        assert torch.equal(plan.seg_start[1:], (plan.seg_start + plan.seg_count)[:-1])
        assert int(plan.seg_start[-1] + plan.seg_count[-1]) == Q
        assert int(plan.seg_count[0]) == 1 and int(plan.seg_count[-1]) == 1
        assert bool((plan.seg_count >= 1).all() & (plan.seg_count <= plan.mgb).all())
        seg_of = torch.repeat_interleave(torch.arange(S), plan.seg_count)
        group = plan.band_expert[u.band] * W + u.dst
        assert torch.equal(group, group[plan.seg_start[seg_of]])  # the cut rule
        assert torch.equal(u.dst, plan.seg_dst[seg_of])
        nxt = u.row[1:] == u.row[:-1] + u.rows[:-1]  # contiguous inside a segment
        assert bool(nxt[(seg_of[1:] == seg_of[:-1])].all())
    srow, sdst, soff = _segment_rows(plan)
    sx = gi[srow]
    assert bool((sx >= 0).all())
    assert torch.equal(src[sx], sdst) and torch.equal(dst[sx], soff)
    assert torch.equal(torch.sort(sx).values, torch.nonzero(src != rank).squeeze(1))
    assert bool((soff < buf_rows[sdst]).all())
    assert rows_sent(plan) == torch.bincount(src[src != rank], minlength=W).tolist()
    # Local rows: stored at row_dst, never sent, as in the aligned layout.
    local_src, local_dst = local_rows(plan)
    lx = gi[local_src]
    assert torch.equal(lx, torch.nonzero(src == rank).squeeze(1))
    assert torch.equal(dst[lx], local_dst)
    return plan


@SETTINGS
@given(
    W=st.sampled_from([1, 2, 3, 4, 8]),
    E=st.integers(1, 16),
    tm=st.sampled_from([16, 64, 128]),
    mgb=st.integers(1, 3),
    rank_frac=st.floats(0, 0.999),
    rows_mult=st.sampled_from([0.0, 0.3, 1.0, 2.5]),
    p_empty=st.sampled_from([0.0, 0.3, 0.8, 1.0]),
    seed=st.integers(0, 2**31 - 1),
)
def test_compact_plan_properties_synthetic(W, E, tm, mgb, rank_frac, rows_mult, p_empty, seed):
    rank = int(rank_frac * W)
    src, expert, dst, buf_rows = _synthetic(W, E, rank, int(rows_mult * tm), p_empty, seed)
    kw = dict(world_size=W, rank=rank, experts_per_rank=E, tile_m=tm, mgb=mgb, out_cols=24)
    aligned = build_plan(src, expert, dst, elem_bytes=2, **kw)
    for layout in ("compact",):
        plan = build_plan(src, expert, dst, elem_bytes=2, layout=layout, **kw)
        check_compact_plan(plan, src, expert, dst, buf_rows)
        assert plan.n_padded - plan.n_rows <= aligned.n_padded - aligned.n_rows
        assert plan.n_bands <= aligned.n_bands
        assert rows_sent(plan) == rows_sent(aligned)
        assert torch.equal(local_rows(plan)[1], local_rows(aligned)[1])


@settings(max_examples=60, deadline=None)
@given(
    W=st.sampled_from([1, 2, 3, 4, 8]),
    E=st.integers(1, 6),
    tm=st.sampled_from([8, 16, 64]),
    mgb=st.integers(1, 3),
    routing=st.sampled_from(["balanced", "moderate_skew", "stress_skew"]),
    tokens=st.integers(1, 120),
    seed=st.integers(0, 1000),
    layout=st.sampled_from(["compact"]),
)
def test_compact_plans_fill_every_receive_buffer_and_count_bands(
    W, E, tm, mgb, routing, tokens, seed, layout
):
    """Real routings: compact plans write every row of every receive buffer exactly once with the
    right token, pad nothing, and their bands (and the aligned plans') equal row_tiles."""
    from harness.routing import owner_expert_counts
    from harness.workload import routing_of
    from systems.overlap.plan import row_tiles

    if 2 > W * E:
        return
    spec = WorkloadSpec(tokens, 8, 8, E, 2, W, routing, seed=seed)
    plans, lays = plans_for_spec(spec, tile_m=tm, mgb=mgb, layout=layout)
    C = owner_expert_counts(routing_of(spec).expert_ids, E)
    assert row_tiles(C, E, tm, layout).tolist() == [p.n_bands for p in plans]
    aligned = plans_for_spec(spec, tile_m=tm, mgb=mgb)[0]
    assert row_tiles(C, E, tm).tolist() == [p.n_bands for p in aligned]
    assert all(p.n_padded == p.n_rows for p in plans)
    S_rows = torch.stack([lay.send_counts.sum() for lay in lays])
    hits = [torch.zeros(int(n), dtype=torch.int64) for n in S_rows]
    for plan, lay in zip(plans, lays):
        check_compact_plan(plan, lay.recv_src, lay.recv_expert, lay.recv_dst_index, S_rows)
        srow, sdst, soff = _segment_rows(plan)
        x = plan.gather_index[srow]
        for d in range(W):
            sel = sdst == d
            hits[d].index_add_(0, soff[sel], torch.ones_like(soff[sel]))
            assert torch.equal(lays[d].send_token[soff[sel]], lay.recv_token[x[sel]])
        local_dst = local_rows(plan)[1]
        hits[plan.rank].index_add_(0, local_dst, torch.ones_like(local_dst))
    for d in range(W):
        assert bool((hits[d] == 1).all())


def test_compact_plan_fills_the_padding_with_local_rows():
    """The rows of test_packed_plan_splits_a_mixed_band_by_owner, layout compact: expert 0 =
    27 remote + 5 local rows = 2 bands (band 1: owner 0's last 4, owner 1's 7, then the 5 local
    rows), expert 1 = 36 remote + 18 local = 4 bands (band 4: owner 1's last 4 and 12 local
    rows; band 5: the last 6 local rows). No zero rows; 6 bands = grouped_mm's tiles, where the
    packed layout has 8 and the aligned one 10."""
    rows = [[20, 7, 5], [3, 33, 18]]
    src, expert, dst, dst_rows = synthetic_rows(rows, rank=2, dst_base=[3, 7, 0])
    kw = dict(rank=2, tile_m=16, mgb=1, dst_base=[3, 7, 0])
    plan = synthetic_plan(rows, layout="compact", **kw)
    check_compact_plan(plan, src, expert, dst, torch.tensor(dst_rows))
    aligned = synthetic_plan(rows, **kw)
    assert (plan.n_bands, aligned.n_bands) == (6, 10)
    assert (plan.n_padded, plan.n_rows) == (86, 86)
    assert plan.expert_row_start.tolist() == [0, 32, 86]
    assert plan.band_rows.tolist() == [16, 16, 16, 16, 16, 6]
    assert plan.schedule.tolist() == [2, 3, 4, 0, 1, 5] and plan.n_remote_bands == 5
    assert plan.band_dst.tolist() == [0, 0, 0, 1, 1, 2]  # owner of each band's first row
    u = plan_pieces(plan)
    got = list(zip(*(t.tolist() for t in (u.band, u.row, u.rows, u.dst, u.offset))))
    assert got == [
        (2, 32, 3, 0, 23),
        (2, 35, 13, 1, 14),
        (3, 48, 16, 1, 27),
        (4, 64, 4, 1, 43),  # the mixed band of expert 1: its remote rows only
        (0, 0, 16, 0, 3),
        (1, 16, 4, 0, 19),
        (1, 20, 7, 1, 7),  # the mixed band of expert 0: rows 27..31 are local
    ]
    assert local_rows(plan)[0].tolist() == [*range(27, 32), *range(68, 86)]
    assert torch.equal(local_rows(plan)[1], local_rows(aligned)[1])


@pytest.mark.parametrize("layout", ["aligned", "compact"])
@pytest.mark.parametrize("W", [2, 4])
@pytest.mark.parametrize("routing", ["balanced", "stress_skew"])
def test_producer_order_groups_each_experts_bands_and_keeps_the_remote_order(W, routing, layout):
    spec = WorkloadSpec(512, 8, 16, 6, 2, W, routing, seed=W, dtype="float16")
    plan = plans_for_spec(spec, tile_m=16, mgb=2, layout=layout)[0][0]
    order = producer_order(plan)
    B, NR = plan.n_bands, plan.n_remote_bands
    assert order.dtype == torch.int64 and sorted(order.tolist()) == list(range(B))
    visit = order.tolist()
    # the remote bands keep their schedule order (the consumer waits on them in that order)
    assert [s for s in visit if s < NR] == list(range(NR))
    experts = plan.band_expert[plan.schedule[order.long()]].tolist()
    remote_experts = set(plan.band_expert[plan.schedule[:NR]].tolist())
    # every expert with a remote band: all its bands visited back to back, remote ones first
    for e in remote_experts:
        at = [i for i, x in enumerate(experts) if x == e]
        assert at == list(range(at[0], at[-1] + 1)), f"expert {e} split: {at}"
        kinds = [visit[i] < NR for i in at]
        assert kinds == sorted(kinds, reverse=True)
    # experts without remote bands come last
    n_tail = sum(1 for x in experts if x not in remote_experts)
    assert all(x not in remote_experts for x in experts[B - n_tail :])


@pytest.mark.parametrize("ordered", [False, True])
@pytest.mark.parametrize("cap", [1, 3, 8, 64])
@pytest.mark.parametrize("routing", ["balanced", "stress_skew"])
def test_producer_groups_split_each_experts_run_into_near_equal_groups(routing, cap, ordered):
    spec = WorkloadSpec(512, 8, 16, 6, 2, 2, routing, seed=3, dtype="float16")
    plan = plans_for_spec(spec, tile_m=16, mgb=2, layout="compact")[0][0]
    order = producer_order(plan) if ordered else None
    g = producer_groups(plan, order, cap)
    B = plan.n_bands
    assert g.dtype == torch.int32 and g.numel() == B
    first, size = (g // GROUP_CODE).tolist(), (g % GROUP_CODE).tolist()
    visit = order.long() if ordered else torch.arange(B)
    experts = plan.band_expert[plan.schedule[visit]].tolist()
    v = 0
    while v < B:  # the groups tile [0, B): each one names itself at every position it holds
        f, n = first[v], size[v]
        assert f == v and 1 <= n <= cap and v + n <= B
        assert first[v : v + n] == [f] * n and size[v : v + n] == [n] * n
        assert len(set(experts[v : v + n])) == 1, "a group holds one expert"
        v += n
    # one expert's run: ceil(run / cap) groups, sizes differing by at most one
    runs, start = [], 0
    for i in range(1, B + 1):
        if i == B or experts[i] != experts[i - 1]:
            runs.append((start, i - start))
            start = i
    for r0, n in runs:
        sizes = sorted({size[i] for i in range(r0, r0 + n)})
        assert len({first[i] for i in range(r0, r0 + n)}) == -(-n // cap)
        assert sizes[-1] - sizes[0] <= 1


def test_producer_groups_refuse_a_cap_out_of_range():
    spec = WorkloadSpec(64, 8, 16, 2, 2, 2, "balanced", seed=0, dtype="float16")
    plan = plans_for_spec(spec, tile_m=16, mgb=1)[0][0]
    for bad in (0, GROUP_CODE):
        with pytest.raises(ValueError, match="cap must be in"):
            producer_groups(plan, None, bad)


def test_plan_difference_names_the_first_field_in_which_two_plans_differ():
    from dataclasses import replace

    from systems.overlap.plan import plan_difference, plan_from_rows

    rows = [[3, 5], [0, 7]]  # rows[e][s] of rank 0's two experts from two owners
    knobs = dict(rank=0, tile_m=4, mgb=2, order="expert", group_cap=2)
    plan = plan_from_rows(rows, **knobs)
    assert plan_difference(plan, plan_from_rows(rows, **knobs)) is None
    other = plan_from_rows(rows, rank=0, tile_m=4, mgb=2)
    assert plan_difference(plan, other) == "order"
    moved = plan.band_offset.clone()
    moved[-1] += 1
    assert plan_difference(plan, replace(plan, band_offset=moved)) == "band_offset"
    assert plan_difference(plan, replace(plan, visit=None)) == "visit"
