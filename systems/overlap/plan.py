"""Stage A: row layout, schedule and combine plan (terms: docs/method.md, Stage A).

build_plan (torch; ONE host sync, the `.tolist()` of the sizes that size every output: no boolean
masks) and plan_device.build_plan_device (Triton, no host sync) return the same CombinePlan.
What the code relies on beyond the docs (W ranks, E local experts, tile_m):
  row      x_recv[i], i in [0, R): one (token, slot) pair this rank's experts compute
  group    the rows of one (local expert, owner rank), CONSECUTIVE in the owner's receive buffer
           (harness/layout.py) and laid out in that order; expert e holds padded rows
           expert_row_start[e:e+2]
  schedule each expert's remote bands in layout order; the local bands, experts ascending
  segment  the middle ones take mgb units (bands, or pieces) from each group's start, fewer at
           a cut; local rows are stored by the producer's epilogue at row_dst
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import torch

from harness.layout import RankLayout
from systems.overlap.modes import GROUP_CODE
from systems.overlap.params import LAYOUTS, ORDERS

#: the plan's counts, in CombinePlan.counts order
COUNT_NAMES = ("n_rows", "n_padded", "n_bands", "n_remote_bands", "n_segments", "n_local")
COUNT_NAMES += ("n_pieces",)


@dataclass
class CombinePlan:
    """The combine plan of one rank: int64 tensors on the build device (groups: int32).

    Host fields: the builders' keywords (group_cap: swizzle groups of <= group_cap bands, 0:
    none). counts [7] int64 on the device, COUNT_NAMES (n_pieces 0 when aligned), also as 0-dim
    properties. The arrays are exactly that long (build_plan) or worst-case sized, -1 past
    the counts (build_plan_device; max_*: the sizes).
      row_pos [R]: padded row of each x_recv row; gather_index [P]: x_recv row of each padded
        row (-1: zero padding); row_dst [P]: own-receive-buffer row of each LOCAL row (-1
        elsewhere); expert_row_start [E+1]
      band_expert, band_row (first padded row), band_rows (GEMM rows), band_dst (owner of its
        first valid row), band_valid (valid rows, the first ones), band_offset (destination row
        of its first valid row) [B] each, bands in layout order (band_row ascending)
      schedule [B]: band ids in producer order, schedule[:n_remote_bands] the remote bands
      visit [B]: order="expert": schedule positions in visiting order (producer_order); else
        None (the schedule's order)
      groups [B] int32: group_cap > 0: each visiting position's swizzle group (producer_groups)
      seg_start (first unit: a schedule index, or a piece id when compact), seg_count (units),
        seg_dst [S], in send order; a unit's rows, first padded row and destination row are its
        band's (band_valid, band_row, band_offset) or its piece's
      recv_rows [W]: rows coming back from each rank (None without send_counts)
      piece_band, piece_row, piece_rows, piece_offset [Q] (compact; else None)
    """

    world_size: int
    rank: int
    experts_per_rank: int
    tile_m: int
    mgb: int
    out_cols: int
    elem_bytes: int
    layout: str
    order: str
    group_cap: int
    counts: torch.Tensor
    row_pos: torch.Tensor
    gather_index: torch.Tensor
    row_dst: torch.Tensor
    expert_row_start: torch.Tensor
    band_expert: torch.Tensor
    band_row: torch.Tensor
    band_rows: torch.Tensor
    band_dst: torch.Tensor
    band_valid: torch.Tensor
    band_offset: torch.Tensor
    schedule: torch.Tensor
    visit: torch.Tensor | None
    groups: torch.Tensor | None
    seg_start: torch.Tensor
    seg_count: torch.Tensor
    seg_dst: torch.Tensor
    recv_rows: torch.Tensor | None
    piece_band: torch.Tensor | None = None
    piece_row: torch.Tensor | None = None
    piece_rows: torch.Tensor | None = None
    piece_offset: torch.Tensor | None = None

    n_rows = property(lambda self: self.counts[0])
    n_padded = property(lambda self: self.counts[1])
    n_bands = property(lambda self: self.counts[2])
    n_remote_bands = property(lambda self: self.counts[3])
    n_segments = property(lambda self: self.counts[4])
    n_local = property(lambda self: self.counts[5])
    n_pieces = property(lambda self: self.counts[6])
    max_rows = property(lambda self: self.row_pos.numel())
    max_padded = property(lambda self: self.gather_index.numel())
    max_bands = property(lambda self: self.schedule.numel())
    max_segments = property(lambda self: self.seg_start.numel())

    def sizes(self) -> dict[str, int]:
        """The counts as host ints (synchronises: set-up, tests and reports only)."""
        return dict(zip(COUNT_NAMES, self.counts.tolist()))

    def trimmed(self) -> CombinePlan:
        """The plan with every array cut to its count (synchronises: tests and reports)."""
        n = self.sizes()
        cut = {"row_pos": "n_rows", "gather_index": "n_padded", "row_dst": "n_padded"}
        cut |= {"band": "n_bands", "schedule": "n_bands", "visit": "n_bands"}
        cut |= {"groups": "n_bands", "seg": "n_segments", "piece": "n_pieces"}
        kw = {}
        for f in fields(self):
            v = getattr(self, f.name)
            key = next((k for k in cut if f.name.startswith(k)), None)
            kw[f.name] = v[: n[cut[key]]] if key is not None and v is not None else v
        return type(self)(**kw)


def _excl_cumsum(x: torch.Tensor) -> torch.Tensor:
    return torch.cumsum(x, 0) - x


def check_plan_args(
    W: int, rank: int, E: int, tm: int, mgb: int, layout: str, order: str, group_cap: int
) -> None:
    """The builders' one-line ValueErrors for a plan's shape and knobs."""
    if not 0 <= rank < W:
        raise ValueError(f"rank {rank} not in [0, {W})")
    if E < 1 or tm < 1 or mgb < 1:
        raise ValueError(f"experts_per_rank, tile_m, mgb must be >= 1; got {E}, {tm}, {mgb}")
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {', '.join(LAYOUTS)}, got {layout!r}")
    if order not in ORDERS:
        raise ValueError(f"order must be one of {', '.join(ORDERS)}, got {order!r}")
    if not 0 <= group_cap < GROUP_CODE:
        raise ValueError(f"group_cap must be in [0, {GROUP_CODE}), got {group_cap}")


def _segments(unit_start: torch.Tensor, mgb: int, n_segments: int):
    """seg_start, seg_count [S]: the segment rule (module doc) over n units in send order (remote
    bands, or pieces); unit_start [n] int64: the position of each unit's group's first."""
    n = unit_start.numel()
    p = torch.arange(n, dtype=torch.int64, device=unit_start.device)
    q_mid = p - unit_start.clamp(min=1)
    is_start = (p == 0) | (p == n - 1) | (q_mid % mgb == 0)
    seg_id = torch.cumsum(is_start.long(), 0) - 1
    seg_start = torch.full((n_segments,), n, dtype=torch.int64, device=p.device)
    seg_start.scatter_reduce_(0, seg_id, p, "amin")
    return seg_start, torch.diff(seg_start, append=seg_start.new_full((1,), n))


def _n_segments(a: torch.Tensor, n: torch.Tensor, total: torch.Tensor, mgb: int) -> torch.Tensor:
    """Segments over `total` units whose groups hold n [G] units from a [G] on (cut rule)."""
    lo = a.clamp(min=1)
    hi = torch.minimum(a + n - 1, total - 2)
    mid = (hi - lo + 1).clamp(min=0)
    return (total >= 1).long() + (total >= 2).long() + ((mid + mgb - 1) // mgb).sum()


def slot_ranks(world_size: int, rank: int, device: torch.device | None = None) -> torch.Tensor:
    """Owner rank of each group slot [W]: the remote ranks ascending, then `rank` last."""
    j = torch.arange(world_size, dtype=torch.int64, device=device)
    return torch.where(j == world_size - 1, rank, j + (j >= rank).long())


@dataclass
class _Rows:
    """The rows of one build, grouped: g = e * W + slot (remote owners ascending, self last)."""

    src: torch.Tensor  # [R] owner rank
    dst: torch.Tensor  # [R] place in the owner's receive buffer
    slot: torch.Tensor  # [R] group slot
    grp: torch.Tensor  # [R] group
    order: torch.Tensor  # [R] rows by (group, dst)
    cnt: torch.Tensor  # [G] rows per group
    grp_dst: torch.Tensor  # [G] first destination row of each group


def _group_rows(src, expert, dst, W: int, rank: int, E: int) -> _Rows:
    i64 = {"dtype": torch.int64, "device": src.device}
    src, expert, dst = src.to(**i64), expert.to(**i64), dst.to(**i64)
    slot = torch.where(src == rank, W - 1, src - (src > rank).long())
    grp = expert * W + slot
    order = torch.sort(dst, stable=True).indices
    order = order[torch.sort(grp[order], stable=True).indices]
    cnt = torch.zeros(E * W, **i64).index_add_(0, grp, torch.ones_like(grp))
    grp_dst = torch.zeros(E * W, **i64).scatter_reduce_(0, grp, dst, "amin", include_self=False)
    return _Rows(src, dst, slot, grp, order, cnt, grp_dst)


def _row_positions(rows: _Rows, grp_row: torch.Tensor, P: int):
    """row_pos [R] and gather_index [P] of rows whose group g starts at padded row grp_row[g]."""
    R = rows.src.numel()
    k = torch.arange(R, dtype=torch.int64, device=rows.src.device)
    g_sorted = rows.grp[rows.order]
    row_pos = torch.empty_like(k)
    row_pos[rows.order] = grp_row[g_sorted] + (k - _excl_cumsum(rows.cnt)[g_sorted])
    gather_index = torch.full((P,), -1, dtype=torch.int64, device=k.device)
    return row_pos, gather_index.scatter_(0, row_pos, k)


def _unit_walk(units: torch.Tensor, n: torch.Tensor, first: torch.Tensor, B: int) -> torch.Tensor:
    """[B]: for units (groups or sections) in walk order holding n[u] bands from band first[u]
    on, the band ids in that order."""
    u = torch.repeat_interleave(units, n, output_size=B)
    q = torch.arange(B, dtype=torch.int64, device=n.device)
    return first[u] + q - torch.repeat_interleave(_excl_cumsum(n), n, output_size=B)


def _sizes(rows: _Rows, W: int, E: int, P, B, NR, S, Q=None) -> tuple[torch.Tensor, list]:
    """CombinePlan.counts [7] on the rows' device from the layout's 0-dim sizes, and the same as
    host ints: the build's one host sync."""
    dev = rows.cnt.device
    R = torch.full((), rows.src.numel(), dtype=torch.int64, device=dev)
    L = rows.cnt.view(E, W)[:, W - 1].sum()
    Q = torch.zeros((), dtype=torch.int64, device=dev) if Q is None else Q
    counts = torch.stack([R, P, B, NR, S, L, Q])
    return counts, counts.tolist()


def _aligned(rows: _Rows, W: int, rank: int, E: int, tm: int, mgb: int) -> tuple:
    """The aligned layout's counts [7] (on the device and as host ints) and arrays."""
    cnt, dev = rows.cnt, rows.cnt.device
    G = E * W
    nb = (cnt + tm - 1) // tm  # bands per group
    padded = torch.where(torch.arange(G, device=dev) % W == W - 1, cnt, nb * tm)
    grp_row = _excl_cumsum(padded)
    rb = nb.view(E, W)[:, : W - 1].sum(1)  # [E] remote bands per expert
    exp_order = torch.sort(-rb * E + torch.arange(E, device=dev)).indices  # rule (ii)
    remote_groups = (exp_order[:, None] * W + torch.arange(W - 1, device=dev)).reshape(-1)
    sched_groups = torch.cat([remote_groups, torch.arange(E, device=dev) * W + W - 1])
    nb_sched = nb[sched_groups]
    nb_r = nb_sched[: E * (W - 1)]
    a = _excl_cumsum(nb_r)  # first remote schedule position of each remote group
    n_seg = _n_segments(a, nb_r, rb.sum(), mgb)
    counts, host = _sizes(rows, W, E, padded.sum(), nb.sum(), rb.sum(), n_seg)
    P, B, NR, S = host[1:5]
    row_pos, gather_index = _row_positions(rows, grp_row, P)
    band_first = _excl_cumsum(nb)
    band_group = torch.repeat_interleave(torch.arange(G, device=dev), nb, output_size=B)
    q = torch.arange(B, dtype=torch.int64, device=dev) - band_first[band_group]
    band_valid = (cnt[band_group] - q * tm).clamp(max=tm)
    schedule = _unit_walk(sched_groups, nb_sched, band_first, B)
    seg_start, seg_count = _segments(torch.repeat_interleave(a, nb_r, output_size=NR), mgb, S)
    band_dst = slot_ranks(W, rank, dev)[band_group % W]
    out = dict(
        row_pos=row_pos,
        gather_index=gather_index,
        expert_row_start=padded.view(E, W).sum(1),
        band_expert=band_group // W,
        band_row=grp_row[band_group] + q * tm,
        band_rows=torch.where(band_group % W == W - 1, band_valid, tm),
        band_dst=band_dst,
        band_valid=band_valid,
        band_offset=rows.grp_dst[band_group] + q * tm,
        schedule=schedule,
        seg_start=seg_start,
        seg_count=seg_count,
        seg_dst=band_dst[schedule[seg_start]],
    )
    return counts, host, out


def _compact(rows: _Rows, W: int, rank: int, E: int, tm: int, mgb: int) -> tuple:
    """The compact layout's counts [7] (CombinePlan.counts) and arrays: per expert a remote
    section (bands holding remote rows; the last one may hold local rows too) and a local one."""
    cnt, dev = rows.cnt, rows.cnt.device
    i64 = {"dtype": torch.int64, "device": dev}
    cnt2 = cnt.view(E, W)
    rem, n_e = cnt2[:, : W - 1].sum(1), cnt2.sum(1)  # [E] remote / all rows per expert
    nbr = (rem + tm - 1) // tm  # [E] bands holding remote rows
    within = torch.cumsum(cnt2, 1) - cnt2  # [E, W] group start inside its expert
    rsec = torch.minimum(nbr * tm, n_e)  # [E] rows of the remote section
    nbl = (n_e - rsec + tm - 1) // tm  # [E] local-only bands
    exp_start = _excl_cumsum(n_e)
    grp_row = (exp_start[:, None] + within).reshape(-1)
    sec_nb = torch.stack([nbr, nbl], 1).reshape(-1)  # [2E] sections (expert, remote | local)
    sec_rows = torch.stack([rsec, n_e - rsec], 1).reshape(-1)
    sec_row = torch.stack([exp_start, exp_start + rsec], 1).reshape(-1)
    sec_first = _excl_cumsum(sec_nb)
    exp_order = torch.sort(-nbr * E + torch.arange(E, device=dev)).indices  # rule (ii)
    sched_secs = torch.cat([exp_order * 2, torch.arange(E, device=dev) * 2 + 1])
    # pieces: remote groups in send order; a group starting at row ws of its expert spans
    # bands ws // tm .. (ws + c - 1) // tm of the expert
    rg = (exp_order[:, None] * W + torch.arange(W - 1, device=dev)).reshape(-1)
    ws, c = within.reshape(-1)[rg], cnt[rg]
    fb = ws // tm
    npc = torch.where(c > 0, (ws + c - 1) // tm - fb + 1, 0)
    a = _excl_cumsum(npc)
    n_seg = _n_segments(a, npc, npc.sum(), mgb)
    sizes = (n_e.sum(), sec_nb.sum(), nbr.sum(), n_seg, npc.sum())
    counts, host = _sizes(rows, W, E, *sizes)
    P, B, _, S, Q = *host[1:5], host[6]
    row_pos, gather_index = _row_positions(rows, grp_row, P)
    band_sec = torch.repeat_interleave(torch.arange(2 * E, device=dev), sec_nb, output_size=B)
    q = torch.arange(B, **i64) - sec_first[band_sec]
    band_row = sec_row[band_sec] + q * tm
    band_rows = (sec_rows[band_sec] - q * tm).clamp(max=tm)
    first_row = gather_index[band_row]  # x_recv row of each band's first row
    pg = torch.repeat_interleave(torch.arange(rg.numel(), device=dev), npc, output_size=Q)
    g = rg[pg]
    piece_band = sec_first[(g // W) * 2] + fb[pg] + torch.arange(Q, **i64) - a[pg]
    gs = grp_row[g]
    piece_row = torch.maximum(gs, band_row[piece_band])
    piece_rows = torch.minimum(gs + cnt[g], band_row[piece_band] + tm) - piece_row
    seg_start, seg_count = _segments(a[pg], mgb, S)
    out = dict(
        row_pos=row_pos,
        gather_index=gather_index,
        expert_row_start=n_e,
        band_expert=band_sec // 2,
        band_row=band_row,
        band_rows=band_rows,
        band_dst=torch.where(band_sec % 2 == 1, rank, rows.src[first_row]),
        band_valid=band_rows,
        band_offset=rows.dst[first_row],
        schedule=_unit_walk(sched_secs, sec_nb[sched_secs], sec_first, B),
        seg_start=seg_start,
        seg_count=seg_count,
        seg_dst=slot_ranks(W, rank, dev)[g[seg_start] % W],
        piece_band=piece_band,
        piece_row=piece_row,
        piece_rows=piece_rows,
        piece_offset=rows.grp_dst[g] + (piece_row - gs),
    )
    return counts, host, out


def build_plan(
    recv_src: torch.Tensor,
    recv_expert: torch.Tensor,
    recv_dst_index: torch.Tensor,
    *,
    world_size: int,
    rank: int,
    experts_per_rank: int,
    tile_m: int,
    mgb: int,
    out_cols: int,
    elem_bytes: int,
    send_counts: torch.Tensor | None = None,
    layout: str = "aligned",
    order: str = "remote_first",
    group_cap: int = 0,
) -> CombinePlan:
    """The combine plan of `rank` from its expert-side rows (harness.layout.RankLayout), with
    one host sync: recv_src [R] owner rank, recv_expert [R] local expert, recv_dst_index [R]
    position in the owner's receive buffer (consecutive within each group), any order;
    send_counts [W] (optional): rows this rank sent each rank in the dispatch (recv_rows)."""
    W, E, tm = world_size, experts_per_rank, tile_m
    check_plan_args(W, rank, E, tm, mgb, layout, order, group_cap)
    i64 = {"dtype": torch.int64, "device": recv_src.device}
    rows = _group_rows(recv_src, recv_expert, recv_dst_index, W, rank, E)
    build = _aligned if layout == "aligned" else _compact
    counts, host, f = build(rows, W, rank, E, tm, mgb)
    P, L = host[1], host[5]
    loc = torch.sort((rows.slot != W - 1).long(), stable=True).indices[:L]  # the local rows
    n_e = f["expert_row_start"]  # [E] padded rows per expert
    f["expert_row_start"] = torch.cat([n_e.new_zeros(1), torch.cumsum(n_e, 0)])
    shape = dict(world_size=W, rank=rank, experts_per_rank=E, tile_m=tm, mgb=mgb, layout=layout)
    shape |= dict(out_cols=out_cols, elem_bytes=elem_bytes, order=order, group_cap=group_cap)
    plan = CombinePlan(
        **shape,
        counts=counts,
        row_dst=torch.full((P,), -1, **i64).scatter_(0, f["row_pos"][loc], rows.dst[loc]),
        recv_rows=None if send_counts is None else send_counts.to(**i64),
        visit=None,
        groups=None,
        **f,
    )
    if order == "expert":
        plan.visit = producer_order(plan)
    if group_cap:
        plan.groups = producer_groups(plan, plan.visit, group_cap)
    return plan


def plan_for_layout(lay: RankLayout, *, device: torch.device | None = None, **shape) -> CombinePlan:
    """build_plan on a harness.layout.RankLayout (moved to `device` first), with its rank and
    send_counts; shape: build_plan's other keywords."""
    dev = device or lay.recv_src.device
    rows = (t.to(dev) for t in (lay.recv_src, lay.recv_expert, lay.recv_dst_index))
    return build_plan(*rows, rank=lay.rank, send_counts=lay.send_counts.to(dev), **shape)


def plan_from_rows(
    rows: list[list[int]],
    *,
    rank: int,
    tile_m: int,
    mgb: int = 1,
    device: torch.device | str = "cpu",
    dst_base: list[int] | None = None,
    out_cols: int = 0,
    elem_bytes: int = 0,
    **knobs,
) -> CombinePlan:
    """build_plan on `device` from group sizes alone: rows[e][s] = valid rows of local expert e
    owned by rank s (knobs: layout, order, group_cap). x_recv row i is the i-th valid row in
    layout order; destination d receives this rank's rows consecutively from dst_base[d] on, in
    (expert, row) order."""
    ins = (t.to(device) for t in rows_of_sizes(rows, rank=rank, dst_base=dst_base))
    shape = dict(world_size=len(rows[0]), rank=rank, experts_per_rank=len(rows), tile_m=tile_m)
    return build_plan(*ins, **shape, mgb=mgb, out_cols=out_cols, elem_bytes=elem_bytes, **knobs)


def rows_of_sizes(rows: list[list[int]], *, rank: int, dst_base: list[int] | None = None):
    """build_plan's inputs recv_src, recv_expert, recv_dst_index [R] (int64, CPU) that group
    sizes rows[e][s] describe, in layout order (plan_from_rows)."""
    E, W = len(rows), len(rows[0])
    cnt = torch.tensor(rows, dtype=torch.int64).view(E, W)  # [E, W] by owner
    base = torch.tensor(list(dst_base) if dst_base is not None else [0] * W, dtype=torch.int64)
    owners = slot_ranks(W, rank)
    flat = cnt[:, owners].reshape(-1)  # [E * W] group sizes in layout order
    R = int(flat.sum())
    src = torch.repeat_interleave(owners.repeat(E), flat, output_size=R)
    expert = torch.repeat_interleave(torch.arange(E).repeat_interleave(W), flat, output_size=R)
    start = base + torch.cumsum(cnt, 0) - cnt  # [E, W]: first destination row of each group
    g = torch.repeat_interleave(torch.arange(E * W), flat, output_size=R)
    dst = start[:, owners].reshape(-1)[g] + torch.arange(R) - _excl_cumsum(flat)[g]
    return src, expert, dst


def padded_input(x_recv: torch.Tensor, gather_index: torch.Tensor) -> torch.Tensor:
    """The padded GEMM input X [P, K]: row p = x_recv[gather_index[p]] (x_recv [R, K],
    CombinePlan.gather_index [P]), zero where gather_index[p] == -1 (a padding row)."""
    idx = gather_index.to(device=x_recv.device, dtype=torch.int64)
    out = x_recv.index_select(0, idx.clamp(min=0))
    out.masked_fill_((idx < 0)[:, None], 0)
    return out


def padding_rows(counts: torch.Tensor, experts_per_rank: int, tile_m: int) -> torch.Tensor:
    """Exact zero padding rows of every rank [W] from C [W, W*E] (owner_expert_counts): each
    remote group (owner s != r, expert g of r) padded to a multiple of tile_m (build_plan's
    n_padded - n_rows)."""
    W = counts.shape[0]
    c = counts.view(W, W, experts_per_rank)  # [s, r, e]
    remote = c * (1 - torch.eye(W, dtype=c.dtype, device=c.device))[:, :, None]
    return (-remote).remainder(tile_m).sum((0, 2))


#: the plan layouts row_tiles counts
TILE_COUNT_LAYOUTS = ("aligned", "compact")


def row_tiles(
    counts: torch.Tensor, experts_per_rank: int, tile_m: int, layout: str = "aligned"
) -> torch.Tensor:
    """Row tiles (bands) the producer of every rank computes [W] from C [W, W*E]
    (owner_expert_counts): per expert g of r, aligned sum_{s != r} ceil(C[s, g] / tile_m) +
    ceil(C[r, g] / tile_m); compact ceil((remote + local) / tile_m), torch._grouped_mm's tiles
    (plan layouts: n_bands)."""
    if layout not in TILE_COUNT_LAYOUTS:
        raise ValueError(f"layout must be one of {', '.join(TILE_COUNT_LAYOUTS)}, got {layout!r}")
    W, tm = counts.shape[0], tile_m
    c = counts.view(W, W, experts_per_rank)  # [s, r, e]
    eye = torch.eye(W, dtype=torch.bool, device=c.device)[:, :, None]
    local = c.diagonal(dim1=0, dim2=1).t()  # [r, e]
    ceil = lambda n: (n + tm - 1) // tm  # noqa: E731
    if layout == "aligned":
        return (ceil(c) * ~eye).sum((0, 2)) + ceil(local).sum(1)
    return ceil(c.sum(0)).sum(1)  # compact: all owners' rows of an expert in one run


def producer_order(plan: CombinePlan) -> torch.Tensor:
    """visit [B] int64: the schedule positions in order="expert"'s visiting order, no host sync:
    each expert's remote bands (consecutive in the schedule) then its local bands, experts by
    their first remote band, those without remote bands last, positions past n_bands at the end
    (why: docs/method.md, Order)."""
    sched = plan.schedule
    B, dev = sched.numel(), sched.device
    pos = torch.arange(B, dtype=torch.int64, device=dev)
    exp = plan.band_expert[sched.clamp(0, max(B - 1, 0))].clamp(0, plan.experts_per_rank - 1)
    first = torch.full((plan.experts_per_rank,), B, dtype=torch.int64, device=dev)
    first.scatter_reduce_(0, exp, torch.where(pos < plan.n_remote_bands, pos, B), "amin")
    key = torch.where(pos < plan.n_bands, first[exp], B + 1) * (B + 1) + pos
    return torch.sort(key).indices


def producer_groups(plan: CombinePlan, visit: torch.Tensor | None, cap: int) -> torch.Tensor:
    """groups [B] int32: the producer's swizzle group of each visiting position, encoded
    first * GROUP_CODE + size: each run of one expert's bands in the visiting order (visit, None:
    the schedule's) cut into ceil(run / cap) near-equal groups; positions past n_bands are
    groups of one; the producer walks a group column tile by column tile. No host sync."""
    if not 1 <= cap < GROUP_CODE:
        raise ValueError(f"producer_groups: cap must be in [1, {GROUP_CODE}), got {cap}")
    sched = plan.schedule
    B, dev = sched.numel(), sched.device
    v = torch.arange(B, dtype=torch.int64, device=dev)
    pos = v if visit is None else visit.to(torch.int64).clamp(0, max(B - 1, 0))
    exp = plan.band_expert[sched.to(torch.int64)[pos].clamp(0, max(B - 1, 0))]
    key = torch.where(v < plan.n_bands, exp, -1 - v)  # unused positions: runs of one
    start = torch.ones(B, dtype=torch.bool, device=dev)
    start[1:] = key[1:] != key[:-1]
    run = torch.cumsum(start, 0) - 1  # run id of each position
    run_first = torch.cummax(torch.where(start, v, 0), 0).values
    run_len = torch.zeros(B, dtype=torch.int64, device=dev).scatter_add_(0, run, torch.ones_like(v))
    n = run_len[run]
    chunks = (n + cap - 1) // cap
    base, extra = n // chunks, n % chunks  # `extra` groups of base + 1, then groups of base
    o = v - run_first
    big = extra * (base + 1)
    ob = o - big
    first = torch.where(o < big, o - o % (base + 1), big + ob - ob % base.clamp(min=1))
    size = torch.where(o < big, base + 1, base)
    return ((run_first + first) * GROUP_CODE + size).to(torch.int32)


def plan_difference(ref, got) -> str | None:
    """The first field (dataclasses.fields) in which plan `got`, trimmed to its counts, differs
    from plan `ref`; None when they are equal."""
    got = got.trimmed()
    for f in fields(ref):
        a, b = getattr(ref, f.name), getattr(got, f.name)
        same = (b is not None and torch.equal(a, b)) if isinstance(a, torch.Tensor) else a == b
        if not same:
            return f.name
    return None
