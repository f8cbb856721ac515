"""Stage A of the method: remote-aligned row layout, remote-first schedule, combine plan.

Pure torch, vectorised, identical on CPU and GPU; every tensor of a plan lives on the inputs'
device. ONE host synchronisation per plan: the `.tolist()` of five sizes (padded rows P, bands B,
remote bands, segments S, local rows L) in `build_plan`, needed to size the outputs. Everything
after it passes `output_size` to repeat_interleave and uses scatter/index_add instead of
bincount/nonzero/boolean masks, so nothing else waits for the device.

Terms (W ranks, E local experts, tile height tile_m, this rank = `rank`):
  row      one (token, slot) pair this rank's experts compute: x_recv[i], i in [0, R)
  group    the rows of one (local expert e, owner rank s); rows of a group occupy CONSECUTIVE
           positions of the owner's combine receive buffer (harness/layout.py), so a group is
           laid out in the order of those positions (recv_dst_index ascending)
  layout   per expert e, X_e = [remote groups, owners ascending, each padded with zero rows to a
           multiple of tile_m][local group last, NOT padded]; experts concatenated (e ascending)
           into the padded GEMM input X [P, K]; expert e holds rows expert_row_start[e:e+2]
  band     tile_m consecutive rows of one group (all N output columns); a remote band is
           owner-uniform and its valid rows are contiguous in both X and the owner's buffer;
           only a group's last band has padding (remote) or fewer rows (local)
  schedule the producer's order: rule (i) every remote band before any local band; rule (ii)
           experts with more remote bands first (ties: lower expert index), within an expert in
           layout order (owners ascending); then the local bands, experts ascending
  segment  the unit of one put: consecutive REMOTE schedule entries. The first and the last
           segment hold one band each; the middle ones hold mgb bands, counted from the start
           of each group.
           CUT RULE: a segment never spans two groups. Where the group (expert, destination)
           changes inside a would-be segment, the segment is cut there and the next one starts
           at the new group. So a segment never spans two destinations, and, stricter, never
           two experts: its valid rows are then ONE contiguous range of X's output Y
           (seg_src_row ...) and ONE contiguous range of the destination's receive buffer
           (seg_offset ...). A middle segment can hold fewer than mgb bands at a cut.

Local rows are never sent: they are copied from Y into this rank's own receive buffer at
local_dst_index. The scale step is harness.reference.scale over that full buffer [S_rows, N].

layout="packed" (beyond the paper; build_plan(..., layout="packed")): per expert e,
X_e = [ALL remote groups back to back, owners ascending, padded ONCE with zero rows to a
multiple of tile_m][local group last, NOT padded], so an expert pads at most tile_m - 1 rows
(packed_padding_rows counts them). A remote band may then hold rows of several owners; a
*piece* is the rows of one owner in one band (contiguous in Y and, since an owner's rows of an
expert are consecutive in its buffer, contiguous at the destination). Pieces are ordered like
the send: remote bands in schedule order, owners ascending inside a band; the pieces of one
group are consecutive in that order. Segments are built over pieces exactly as over bands in
the aligned layout (first / last single, middle mgb, cut where the group changes), so a segment
is still one contiguous range of Y and of one destination. Local bands never mix with remote
rows (the remote part is padded before the local group), so the local copy is unchanged.

layout="compact" (beyond the paper): per expert e, X_e = [ALL remote groups back to back, owners
ascending][local group], with NO zero rows at all (P = R): the local rows fill what the packed
layout pads. The expert's bands are then exactly torch._grouped_mm's row tiles of that expert
(ceil((remote + local) / tile_m) of them; only the expert's last band can be short). The band
that holds an expert's last remote rows may hold its first local rows too: such a *mixed* band
is a remote band (in the remote schedule, signalled); its pieces cover its remote rows only,
and its local rows are copied (or stored by the producer's epilogue, local=direct) like every
other local row. Pieces, segments and the local-row arrays are built as in the packed layout.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

import torch

from harness.layout import RankLayout, rank_layout
from harness.workload import WorkloadSpec
from systems.overlap.modes import GROUP_CODE


@dataclass
class CombinePlan:
    """The combine plan of one rank. Tensors are int64 on the build device.

    Host ints: world_size W, rank, experts_per_rank E, tile_m, mgb, out_cols N, elem_bytes,
    n_rows R, n_padded P, n_bands B, n_remote_bands, n_segments S, n_local L.

    Rows and layout:
      row_pos          [R]    padded GEMM row of each x_recv row
      gather_index     [P]    x_recv row of each padded GEMM row, -1 for a zero padding row
      expert_row_start [E+1]  expert e occupies padded rows [start[e], start[e+1])
      group_rows       [E, W] valid rows of (expert e, owner s)
      group_padded     [E, W] GEMM rows of (expert e, owner s): remote padded to tile_m
    Bands (b in layout order, band_row ascending):
      band_expert [B]  local expert
      band_row    [B]  first padded GEMM row
      band_rows   [B]  GEMM rows in the band (tile_m; fewer only for a local last band)
      band_dst    [B]  destination (owner) rank
      band_valid  [B]  non-padding rows (the first band_valid rows of the band)
      band_offset [B]  row of its first valid row in the destination's combine receive buffer;
                       valid rows land at band_offset .. band_offset + band_valid - 1
      band_segment [B] segment of a remote band, -1 for a local band
    Schedule:
      schedule [B]  band ids in producer order; schedule[:n_remote_bands] are the remote bands
    Segments (s in send order, over the remote schedule):
      seg_start   [S]  index into schedule of its first band
      seg_count   [S]  bands in the segment
      seg_dst     [S]  destination rank
      seg_rows    [S]  valid rows sent
      seg_bytes   [S]  seg_rows * N * elem_bytes
      seg_src_row [S]  padded GEMM row of its first row (valid rows are contiguous from there)
      seg_offset  [S]  row of its first row in the destination's receive buffer
      sent_rows     [W]  valid rows sent to each rank (0 for this rank)
      sent_segments [W]  segments sent to each rank
    Receive side (this rank's combine receive buffer [S_rows, N], the owner layout):
      recv_rows      [W]  rows coming back from each rank (send_counts; [rank] = local copies),
                          None when build_plan got no send_counts
      recv_row_start [W]  rank s's rows land at recv_row_start[s] .. + recv_rows[s] - 1
      local_src_row   [L]  padded GEMM row of each local row
      local_dst_index [L]  its position in this rank's own receive buffer
    Layout (host str) "aligned" (the paper's, above), "packed" or "compact" (module docstring).
    In a packed or compact plan these fields change meaning:
      group_padded  = group_rows (no per-group padding: expert e pads once, with
                      expert_row_start[e+1] - expert_row_start[e] - group_rows[e].sum() zero rows)
      band_dst      owner of the band's FIRST valid row (a remote band may hold several owners)
      band_offset   destination row of that first valid row (in band_dst's buffer)
      band_segment  segment of the band's first piece (-1 for a local band)
      seg_start     index into the PIECES (not into schedule) of the segment's first piece;
      seg_count     pieces in the segment (each piece in its own band; at mgb=1 one segment
                    per (band, owner) piece)
      n_remote_bands bands holding any remote row (packed: all full tile_m bands; compact:
                    an expert's last one may be short, or hold local rows after its remote rows)
      band_rows     compact: tile_m but for an expert's last band (remote or local)
      band_valid    packed: rows before the padding; compact: = band_rows (no padding)
    and the pieces (None in an aligned plan; plan_pieces() gives them for any layout):
      piece_band   [Q]  band of the piece (whose ready counter the consumer waits for)
      piece_row    [Q]  padded GEMM row of its first row
      piece_rows   [Q]  its rows (all valid, one owner)
      piece_offset [Q]  row of its first row in the destination's receive buffer
      piece_dst    [Q]  destination (owner) rank
    """

    world_size: int
    rank: int
    experts_per_rank: int
    tile_m: int
    mgb: int
    out_cols: int
    elem_bytes: int
    n_rows: int
    n_padded: int
    n_bands: int
    n_remote_bands: int
    n_segments: int
    n_local: int
    row_pos: torch.Tensor
    gather_index: torch.Tensor
    expert_row_start: torch.Tensor
    group_rows: torch.Tensor
    group_padded: torch.Tensor
    band_expert: torch.Tensor
    band_row: torch.Tensor
    band_rows: torch.Tensor
    band_dst: torch.Tensor
    band_valid: torch.Tensor
    band_offset: torch.Tensor
    band_segment: torch.Tensor
    schedule: torch.Tensor
    seg_start: torch.Tensor
    seg_count: torch.Tensor
    seg_dst: torch.Tensor
    seg_rows: torch.Tensor
    seg_bytes: torch.Tensor
    seg_src_row: torch.Tensor
    seg_offset: torch.Tensor
    sent_rows: torch.Tensor
    sent_segments: torch.Tensor
    recv_rows: torch.Tensor | None
    recv_row_start: torch.Tensor | None
    local_src_row: torch.Tensor
    local_dst_index: torch.Tensor
    layout: str = "aligned"
    piece_band: torch.Tensor | None = None
    piece_row: torch.Tensor | None = None
    piece_rows: torch.Tensor | None = None
    piece_offset: torch.Tensor | None = None
    piece_dst: torch.Tensor | None = None

    @property
    def n_padding(self) -> int:
        """Zero padding rows of the layout (P - R)."""
        return self.n_padded - self.n_rows

    def to(self, device: torch.device | str) -> CombinePlan:
        """A copy (of the same class) with every tensor on `device`."""
        kw = {}
        for f in fields(self):
            v = getattr(self, f.name)
            kw[f.name] = v.to(device) if isinstance(v, torch.Tensor) else v
        return type(self)(**kw)


def _excl_cumsum(x: torch.Tensor) -> torch.Tensor:
    return torch.cumsum(x, 0) - x


#: row layouts of stage A: the paper's remote-aligned one, and the packed and compact ones
#: (beyond the paper; module docstring)
LAYOUTS = ("aligned", "packed", "compact")
#: the layouts plan_device.build_plan_device builds (the layer scope's stage A)
DEVICE_LAYOUTS = ("aligned", "compact")


def _segments(unit_start: torch.Tensor, mgb: int, n_segments: int):
    """The segment rule over n units in send order (remote bands, or packed pieces).

    unit_start [n] int64: position of the first unit of each unit's group. A segment starts at
    the first and the last unit and every mgb units of the middle ones (so the first and last
    segments hold one unit). Returns seg_id [n], seg_start [S], seg_count [S].
    """
    n = unit_start.numel()
    p = torch.arange(n, dtype=torch.int64, device=unit_start.device)
    q_mid = p - unit_start.clamp(min=1)
    is_start = (p == 0) | (p == n - 1) | (q_mid % mgb == 0)
    seg_id = torch.cumsum(is_start.long(), 0) - 1
    seg_start = torch.full((n_segments,), n, dtype=torch.int64, device=p.device)
    seg_start.scatter_reduce_(0, seg_id, p, "amin")
    seg_count = torch.zeros(n_segments, dtype=torch.int64, device=p.device)
    seg_count.index_add_(0, seg_id, torch.ones_like(p))
    return seg_id, seg_start, seg_count


def _receive_side(send_counts: torch.Tensor | None, device: torch.device):
    """recv_rows [W] (rows coming back from each rank) and recv_row_start [W] on `device`, or
    (None, None) without send_counts."""
    if send_counts is None:
        return None, None
    recv_rows = send_counts.to(dtype=torch.int64, device=device)
    return recv_rows, _excl_cumsum(recv_rows)


def slot_ranks(world_size: int, rank: int, device: torch.device | None = None) -> torch.Tensor:
    """Owner rank of each group slot [W]: the remote ranks ascending, then `rank` last."""
    j = torch.arange(world_size, dtype=torch.int64, device=device)
    return torch.where(j == world_size - 1, rank, j + (j >= rank).long())


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
) -> CombinePlan:
    """The combine plan of `rank` from its expert-side rows (harness.layout.RankLayout).

    recv_src [R] owner rank, recv_expert [R] local expert, recv_dst_index [R] position in the
    owner's combine receive buffer (consecutive within each (owner, expert) group), any order.
    send_counts [W] (optional): rows this rank sent to each rank in the dispatch, for the
    receive-side fields. layout: "aligned" (the paper's) or "packed" (module docstring).
    One host sync (see the module docstring).
    """
    W, E, tm = world_size, experts_per_rank, tile_m
    if not 0 <= rank < W:
        raise ValueError(f"rank {rank} not in [0, {W})")
    if E < 1 or tm < 1 or mgb < 1:
        raise ValueError(f"experts_per_rank, tile_m, mgb must be >= 1; got {E}, {tm}, {mgb}")
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {', '.join(LAYOUTS)}, got {layout!r}")
    if layout in ("packed", "compact"):
        return _build_packed(
            recv_src,
            recv_expert,
            recv_dst_index,
            world_size=W,
            rank=rank,
            experts_per_rank=E,
            tile_m=tm,
            mgb=mgb,
            out_cols=out_cols,
            elem_bytes=elem_bytes,
            send_counts=send_counts,
            compact=layout == "compact",
        )
    dev = recv_src.device
    i64 = {"dtype": torch.int64, "device": dev}
    src = recv_src.to(torch.int64)
    expert = recv_expert.to(**i64)
    dst = recv_dst_index.to(**i64)
    R, G = src.numel(), E * W

    # Groups: g = e * W + slot, slot = owner's position (remote owners ascending, self last).
    slot = torch.where(src == rank, W - 1, src - (src > rank).long())
    grp = expert * W + slot  # [R]
    order = torch.sort(dst, stable=True).indices  # rows by (group, dst position)
    order = order[torch.sort(grp[order], stable=True).indices]
    cnt = torch.zeros(G, **i64).index_add_(0, grp, torch.ones_like(grp))  # [G]
    is_local_g = torch.arange(G, device=dev) % W == W - 1
    nb = (cnt + tm - 1) // tm  # bands per group
    padded = torch.where(is_local_g, cnt, nb * tm)
    grp_row = _excl_cumsum(padded)  # first padded row of each group
    grp_dst = torch.zeros(G, **i64).scatter_reduce_(0, grp, dst, "amin", include_self=False)

    # Schedule of groups: remote groups of experts by (-remote bands, e), then local groups.
    rb = nb.view(E, W)[:, : W - 1].sum(1)  # [E] remote bands per expert
    exp_order = torch.sort(-rb * E + torch.arange(E, device=dev)).indices
    remote_slots = torch.arange(W - 1, device=dev)
    sched_groups = torch.cat(
        [
            (exp_order[:, None] * W + remote_slots).reshape(-1),
            torch.arange(E, device=dev) * W + W - 1,
        ]
    )  # [G]
    nb_sched = nb[sched_groups]
    n_remote = rb.sum()

    # Segment count, group by group (first / last band single, middle chunks of mgb per group).
    nb_r = nb_sched[: E * (W - 1)]
    a = _excl_cumsum(nb_r)  # first remote schedule position of each remote group
    lo = a.clamp(min=1)
    hi = torch.minimum(a + nb_r - 1, n_remote - 2)
    mid = (hi - lo + 1).clamp(min=0)
    n_seg = (n_remote >= 1).long() + (n_remote >= 2).long() + ((mid + mgb - 1) // mgb).sum()
    n_loc = cnt.view(E, W)[:, W - 1].sum()
    sizes = torch.stack([padded.sum(), nb.sum(), n_remote, n_seg, n_loc])
    P, B, NR, S, L = sizes.tolist()  # THE one host synchronisation

    # Rows -> padded positions.
    k = torch.arange(R, **i64)
    g_sorted = grp[order]
    row_pos = torch.empty(R, **i64)
    row_pos[order] = grp_row[g_sorted] + (k - _excl_cumsum(cnt)[g_sorted])
    gather_index = torch.full((P,), -1, **i64).scatter_(0, row_pos, k)
    expert_row_start = torch.cat([torch.zeros(1, **i64), torch.cumsum(padded.view(E, W).sum(1), 0)])

    # Bands in layout order.
    band_first = _excl_cumsum(nb)
    band_group = torch.repeat_interleave(torch.arange(G, device=dev), nb, output_size=B)
    q = torch.arange(B, **i64) - band_first[band_group]
    band_slot = band_group % W
    band_valid = (cnt[band_group] - q * tm).clamp(max=tm)
    band_rows = torch.where(band_slot == W - 1, band_valid, tm)

    # Schedule of bands.
    sg = torch.repeat_interleave(sched_groups, nb_sched, output_size=B)
    q_s = torch.arange(B, **i64) - torch.repeat_interleave(
        _excl_cumsum(nb_sched), nb_sched, output_size=B
    )
    schedule = band_first[sg] + q_s

    # Segments over the remote schedule.
    unit_start = torch.repeat_interleave(a, nb_r, output_size=NR)
    seg_id, seg_start, seg_count = _segments(unit_start, mgb, S)
    remote_sched = schedule[:NR]
    band_dst = slot_ranks(W, rank, dev)[band_slot]
    band_row = grp_row[band_group] + q * tm
    band_offset = grp_dst[band_group] + q * tm
    seg_rows = torch.zeros(S, **i64).index_add_(0, seg_id, band_valid[remote_sched])
    first = schedule[seg_start]
    seg_dst = band_dst[first]
    band_segment = torch.full((B,), -1, **i64).scatter_(0, remote_sched, seg_id)

    # Local rows (never sent) and the receive side.
    loc = torch.sort((slot != W - 1).long(), stable=True).indices[:L]
    recv_rows, recv_start = _receive_side(send_counts, dev)
    return CombinePlan(
        world_size=W,
        rank=rank,
        experts_per_rank=E,
        tile_m=tm,
        mgb=mgb,
        out_cols=out_cols,
        elem_bytes=elem_bytes,
        n_rows=R,
        n_padded=P,
        n_bands=B,
        n_remote_bands=NR,
        n_segments=S,
        n_local=L,
        row_pos=row_pos,
        gather_index=gather_index,
        expert_row_start=expert_row_start,
        group_rows=_by_owner(cnt.view(E, W), W, rank),
        group_padded=_by_owner(padded.view(E, W), W, rank),
        band_expert=band_group // W,
        band_row=band_row,
        band_rows=band_rows,
        band_dst=band_dst,
        band_valid=band_valid,
        band_offset=band_offset,
        band_segment=band_segment,
        schedule=schedule,
        seg_start=seg_start,
        seg_count=seg_count,
        seg_dst=seg_dst,
        seg_rows=seg_rows,
        seg_bytes=seg_rows * (out_cols * elem_bytes),
        seg_src_row=band_row[first],
        seg_offset=band_offset[first],
        sent_rows=torch.zeros(W, **i64).index_add_(0, seg_dst, seg_rows),
        sent_segments=torch.zeros(W, **i64).index_add_(0, seg_dst, torch.ones_like(seg_dst)),
        recv_rows=recv_rows,
        recv_row_start=recv_start,
        local_src_row=row_pos[loc],
        local_dst_index=dst[loc],
    )


def _build_packed(
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
    send_counts: torch.Tensor | None,
    compact: bool = False,
) -> CombinePlan:
    """build_plan with layout="packed": per expert [remote rows of all owners back to back,
    padded once to tile_m][local rows]; pieces = (band, owner) runs; segments over the pieces.
    compact=True (layout="compact"): no padding at all, the local rows follow the remote rows
    directly, so the expert's band that holds its last remote rows holds local rows too (a
    *mixed* band: remote, signalled, its pieces cover its remote rows only).
    Inputs as build_plan's; one host sync (six sizes)."""
    W, E, tm = world_size, experts_per_rank, tile_m
    dev = recv_src.device
    i64 = {"dtype": torch.int64, "device": dev}
    src = recv_src.to(torch.int64)
    expert = recv_expert.to(**i64)
    dst = recv_dst_index.to(**i64)
    R, G = src.numel(), E * W

    # Groups as in the aligned layout: g = e * W + slot (remote owners ascending, self last).
    slot = torch.where(src == rank, W - 1, src - (src > rank).long())
    grp = expert * W + slot  # [R]
    order = torch.sort(dst, stable=True).indices
    order = order[torch.sort(grp[order], stable=True).indices]
    cnt = torch.zeros(G, **i64).index_add_(0, grp, torch.ones_like(grp))  # [G]
    cnt2 = cnt.view(E, W)
    rem, loc = cnt2[:, : W - 1].sum(1), cnt2[:, W - 1]  # [E] remote / local rows per expert
    nbr = (rem + tm - 1) // tm  # [E] bands holding remote rows
    within = torch.cumsum(cnt2, 1) - cnt2  # [E, W] group start inside its expert
    if compact:  # [E] GEMM rows of the remote section (its bands) and of the local section
        rsec = torch.minimum(nbr * tm, rem + loc)  # the mixed band's local rows included
        lsec = rem + loc - rsec
        rvalid = rsec  # no zero rows
    else:
        rsec, lsec, rvalid = nbr * tm, loc, rem
        within[:, W - 1] = rsec  # the local group after the padded remote part
    nbl = (lsec + tm - 1) // tm  # [E] local-only bands
    exp_start = _excl_cumsum(rsec + lsec)  # [E]
    grp_row = (exp_start[:, None] + within).reshape(-1)  # [G] first padded row of each group
    grp_dst = torch.zeros(G, **i64).scatter_reduce_(0, grp, dst, "amin", include_self=False)

    # Sections: (expert, remote part | local part); their bands tile the layout in order. A
    # band holds min(tile_m, section rows left) GEMM rows, the first band_valid of them valid.
    sec_nb = torch.stack([nbr, nbl], 1).reshape(-1)  # [2E]
    sec_rows = torch.stack([rsec, lsec], 1).reshape(-1)
    sec_valid = torch.stack([rvalid, lsec], 1).reshape(-1)
    sec_row = torch.stack([exp_start, exp_start + rsec], 1).reshape(-1)
    sec_first = _excl_cumsum(sec_nb)  # first band id of each section
    exp_order = torch.sort(-nbr * E + torch.arange(E, device=dev)).indices  # rule (ii)
    sched_secs = torch.cat([exp_order * 2, torch.arange(E, device=dev) * 2 + 1])  # [2E]
    nb_sched = sec_nb[sched_secs]

    # Pieces: remote groups in send order (experts by rule (ii), owners ascending); a group
    # starting at row ws of its expert's remote part spans bands ws // tm .. (ws + c - 1) // tm.
    rg = (exp_order[:, None] * W + torch.arange(W - 1, device=dev)).reshape(-1)  # [E(W-1)]
    ws, c = within.reshape(-1)[rg], cnt[rg]
    fb = ws // tm
    npc = torch.where(c > 0, (ws + c - 1) // tm - fb + 1, 0)  # pieces per remote group
    a = _excl_cumsum(npc)  # first piece of each remote group
    n_pieces = npc.sum()
    lo = a.clamp(min=1)
    hi = torch.minimum(a + npc - 1, n_pieces - 2)
    mid = (hi - lo + 1).clamp(min=0)
    n_seg = (n_pieces >= 1).long() + (n_pieces >= 2).long() + ((mid + mgb - 1) // mgb).sum()
    sizes = torch.stack([(rsec + lsec).sum(), sec_nb.sum(), nbr.sum(), n_pieces, n_seg, loc.sum()])
    P, B, NR, Q, S, L = sizes.tolist()  # THE one host synchronisation

    # Rows -> padded positions.
    k = torch.arange(R, **i64)
    g_sorted = grp[order]
    row_pos = torch.empty(R, **i64)
    row_pos[order] = grp_row[g_sorted] + (k - _excl_cumsum(cnt)[g_sorted])
    gather_index = torch.full((P,), -1, **i64).scatter_(0, row_pos, k)
    expert_row_start = torch.cat([torch.zeros(1, **i64), torch.cumsum(rsec + lsec, 0)])

    # Bands in layout order.
    band_sec = torch.repeat_interleave(torch.arange(2 * E, device=dev), sec_nb, output_size=B)
    q = torch.arange(B, **i64) - sec_first[band_sec]
    band_row = sec_row[band_sec] + q * tm
    band_valid = (sec_valid[band_sec] - q * tm).clamp(max=tm)
    is_local = band_sec % 2 == 1
    band_rows = (sec_rows[band_sec] - q * tm).clamp(max=tm)
    first_row = gather_index[band_row]  # x_recv row of each band's first row (always valid)
    band_dst = torch.where(is_local, rank, src[first_row])
    band_offset = dst[first_row]

    # Schedule of bands: remote sections by rule (ii), then local sections, experts ascending.
    sb = torch.repeat_interleave(sched_secs, nb_sched, output_size=B)
    q_s = torch.arange(B, **i64) - torch.repeat_interleave(
        _excl_cumsum(nb_sched), nb_sched, output_size=B
    )
    schedule = sec_first[sb] + q_s

    # Pieces in send order.
    pg = torch.repeat_interleave(torch.arange(rg.numel(), device=dev), npc, output_size=Q)
    j = torch.arange(Q, **i64) - a[pg]
    g = rg[pg]
    e = g // W
    piece_band = sec_first[e * 2] + fb[pg] + j
    gs = grp_row[g]
    piece_row = torch.maximum(gs, band_row[piece_band])
    piece_end = torch.minimum(gs + cnt[g], band_row[piece_band] + tm)
    piece_rows = piece_end - piece_row
    piece_offset = grp_dst[g] + (piece_row - gs)
    piece_dst = slot_ranks(W, rank, dev)[g % W]

    # Segments over the pieces (the aligned rule, with pieces in place of bands).
    seg_id, seg_start, seg_count = _segments(a[pg], mgb, S)
    seg_rows = torch.zeros(S, **i64).index_add_(0, seg_id, piece_rows)
    seg_dst = piece_dst[seg_start]
    band_segment = torch.full((B,), -1, **i64).scatter_reduce_(
        0, piece_band, seg_id, "amin", include_self=False
    )

    # Local rows (never sent) and the receive side.
    loc_rows = torch.sort((slot != W - 1).long(), stable=True).indices[:L]
    recv_rows, recv_start = _receive_side(send_counts, dev)
    return CombinePlan(
        world_size=W,
        rank=rank,
        experts_per_rank=E,
        tile_m=tm,
        mgb=mgb,
        out_cols=out_cols,
        elem_bytes=elem_bytes,
        n_rows=R,
        n_padded=P,
        n_bands=B,
        n_remote_bands=NR,
        n_segments=S,
        n_local=L,
        row_pos=row_pos,
        gather_index=gather_index,
        expert_row_start=expert_row_start,
        group_rows=_by_owner(cnt2, W, rank),
        group_padded=_by_owner(cnt2, W, rank),
        band_expert=band_sec // 2,
        band_row=band_row,
        band_rows=band_rows,
        band_dst=band_dst,
        band_valid=band_valid,
        band_offset=band_offset,
        band_segment=band_segment,
        schedule=schedule,
        seg_start=seg_start,
        seg_count=seg_count,
        seg_dst=seg_dst,
        seg_rows=seg_rows,
        seg_bytes=seg_rows * (out_cols * elem_bytes),
        seg_src_row=piece_row[seg_start],
        seg_offset=piece_offset[seg_start],
        sent_rows=torch.zeros(W, **i64).index_add_(0, seg_dst, seg_rows),
        sent_segments=torch.zeros(W, **i64).index_add_(0, seg_dst, torch.ones_like(seg_dst)),
        recv_rows=recv_rows,
        recv_row_start=recv_start,
        local_src_row=row_pos[loc_rows],
        local_dst_index=dst[loc_rows],
        layout="compact" if compact else "packed",
        piece_band=piece_band,
        piece_row=piece_row,
        piece_rows=piece_rows,
        piece_offset=piece_offset,
        piece_dst=piece_dst,
    )


@dataclass
class Pieces:
    """The consumer's units of one plan, in send order [Q]: band (its ready counter), row
    (first padded GEMM row), rows, offset (destination row), dst. Segment s covers units
    seg_start[s] .. + seg_count[s]."""

    band: torch.Tensor
    row: torch.Tensor
    rows: torch.Tensor
    offset: torch.Tensor
    dst: torch.Tensor


def plan_pieces(plan: CombinePlan) -> Pieces:
    """Pieces of a packed or compact plan; of an aligned plan, its remote bands in schedule
    order (one piece per band: schedule[:n_remote_bands] with their band_row, band_valid,
    band_offset, band_dst). Either way segment s sends units seg_start[s] .. + seg_count[s]."""
    if plan.piece_band is not None:
        return Pieces(
            plan.piece_band, plan.piece_row, plan.piece_rows, plan.piece_offset, plan.piece_dst
        )
    b = plan.schedule[: plan.n_remote_bands]
    return Pieces(b, plan.band_row[b], plan.band_valid[b], plan.band_offset[b], plan.band_dst[b])


def _by_owner(per_slot: torch.Tensor, world_size: int, rank: int) -> torch.Tensor:
    """[E, W] indexed by group slot -> [E, W] indexed by owner rank."""
    out = torch.empty_like(per_slot)
    out[:, slot_ranks(world_size, rank, per_slot.device)] = per_slot
    return out


def plan_for_layout(
    lay: RankLayout,
    *,
    world_size: int,
    experts_per_rank: int,
    tile_m: int,
    mgb: int,
    out_cols: int,
    elem_bytes: int,
    device: torch.device | None = None,
    layout: str = "aligned",
) -> CombinePlan:
    """build_plan on a harness.layout.RankLayout (moved to `device` first), in `layout`."""
    dev = device or lay.recv_src.device
    return build_plan(
        lay.recv_src.to(dev),
        lay.recv_expert.to(dev),
        lay.recv_dst_index.to(dev),
        world_size=world_size,
        rank=lay.rank,
        experts_per_rank=experts_per_rank,
        tile_m=tile_m,
        mgb=mgb,
        out_cols=out_cols,
        elem_bytes=elem_bytes,
        send_counts=lay.send_counts.to(dev),
        layout=layout,
    )


def padded_input(x_recv: torch.Tensor, gather_index: torch.Tensor) -> torch.Tensor:
    """The padded GEMM input X [P, K] from x_recv [R, K] (the layout step of stage A).

    Row p = x_recv[gather_index[p]], zero where gather_index[p] == -1 (a padding row);
    gather_index is CombinePlan.gather_index [P]. Pure torch, on x_recv's device.
    """
    idx = gather_index.to(device=x_recv.device, dtype=torch.int64)
    out = x_recv.index_select(0, idx.clamp(min=0))
    out.masked_fill_((idx < 0)[:, None], 0)
    return out


def owner_expert_counts(expert_ids: torch.Tensor, experts_per_rank: int) -> torch.Tensor:
    """C [W, W*E]: C[s, g] = rows owner s sends to global expert g. expert_ids [W, T, k]."""
    W = expert_ids.shape[0]
    n_exp = W * experts_per_rank
    src = torch.arange(W, device=expert_ids.device).view(W, 1, 1).expand_as(expert_ids)
    key = (src * n_exp + expert_ids).reshape(-1)
    return torch.bincount(key, minlength=W * n_exp).view(W, n_exp)


def padding_rows(counts: torch.Tensor, experts_per_rank: int, tile_m: int) -> torch.Tensor:
    """Exact zero padding rows of every rank's layout [W] from C [W, W*E] (owner_expert_counts).

    Rank r pads each remote group (owner s != r, expert g of r) to a multiple of tile_m:
    sum over s != r and g of (-C[s, g]) mod tile_m. Equals build_plan(...).n_padding.
    """
    W = counts.shape[0]
    pad = (-counts).remainder(tile_m).view(W, W, experts_per_rank)  # [s, r, e]
    pad = pad * (1 - torch.eye(W, dtype=pad.dtype, device=pad.device))[:, :, None]
    return pad.sum((0, 2))


def packed_padding_rows(counts: torch.Tensor, experts_per_rank: int, tile_m: int) -> torch.Tensor:
    """Zero rows of every rank [W] if the remote rows of an expert were PACKED: all remote owners'
    rows of expert g back to back, padded once to a multiple of tile_m (a band may then hold rows
    of several owners). Rank r: sum over its experts g of (-sum_{s != r} C[s, g]) mod tile_m.
    Equals build_plan(..., layout="packed").n_padding (the local rows stay unpadded)."""
    W = counts.shape[0]
    c = counts.view(W, W, experts_per_rank)  # [s, r, e]
    remote = (c * (1 - torch.eye(W, dtype=c.dtype, device=c.device))[:, :, None]).sum(0)  # [r, e]
    return (-remote).remainder(tile_m).sum(1)


def row_tiles(
    counts: torch.Tensor, experts_per_rank: int, tile_m: int, layout: str = "aligned"
) -> torch.Tensor:
    """Row tiles (bands) the producer of every rank computes [W], from C [W, W*E]
    (owner_expert_counts), in `layout`: aligned sum over r's experts g of (sum over remote owners
    s of ceil(C[s, g] / tile_m)) + ceil(C[r, g] / tile_m); packed ceil(remote / tile_m) +
    ceil(local / tile_m); compact ceil((remote + local) / tile_m), which is what
    torch._grouped_mm tiles. Equals build_plan(..., layout=layout).n_bands."""
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {', '.join(LAYOUTS)}, got {layout!r}")
    W, tm = counts.shape[0], tile_m
    c = counts.view(W, W, experts_per_rank)  # [s, r, e]
    eye = torch.eye(W, dtype=torch.bool, device=c.device)[:, :, None]
    local = c.diagonal(dim1=0, dim2=1).t()  # [r, e]
    ceil = lambda n: (n + tm - 1) // tm  # noqa: E731
    if layout == "aligned":
        return (ceil(c) * ~eye).sum((0, 2)) + ceil(local).sum(1)
    remote = (c * ~eye).sum(0)  # [r, e]
    if layout == "packed":
        return (ceil(remote) + ceil(local)).sum(1)
    return ceil(remote + local).sum(1)


def plans_for_spec(
    spec: WorkloadSpec,
    *,
    tile_m: int,
    mgb: int,
    device: torch.device | None = None,
    layout: str = "aligned",
) -> tuple[list[CombinePlan], list[RankLayout]]:
    """Plans and RankLayouts of all W ranks of a spec (every rank can build every plan)."""
    lays = [rank_layout(spec, r) for r in range(spec.world_size)]
    elem = torch.empty(0, dtype=spec.torch_dtype).element_size()
    plans = [
        plan_for_layout(
            lay,
            world_size=spec.world_size,
            experts_per_rank=spec.experts_per_rank,
            tile_m=tile_m,
            mgb=mgb,
            out_cols=spec.out,
            elem_bytes=elem,
            device=device,
            layout=layout,
        )
        for lay in lays
    ]
    return plans, lays


def padded_bound(plan: Any) -> int:
    """Rows of the padded layout a kernel may touch: n_padded (a CombinePlan) or the bound
    max_padded (a DevicePlan)."""
    return plan.max_padded if getattr(plan, "counts_on_device", False) else int(plan.n_padded)


def local_row_map(plan: Any, out: torch.Tensor | None = None) -> torch.Tensor:
    """row_dst [P] int64 on the plan's device: the place in this rank's own receive buffer of
    each local valid row of the padded layout, -1 at every other row (remote rows, padding).

    P is n_padded (a CombinePlan) or the bound max_padded (a DevicePlan, whose local arrays
    hold -1 past n_local). Three device ops, no host synchronisation. The producer's epilogue
    uses it to store local rows where the local copy would put them (local=direct).
    out: an int64 [P + 1] buffer to write (its [:P] view is returned), e.g. the last call's
    buffer for a plan rewritten in place.
    """
    P = padded_bound(plan)
    src, dst = plan.local_src_row, plan.local_dst_index
    if out is None:
        out = torch.full((P + 1,), -1, dtype=torch.int64, device=src.device)
    elif out.shape != (P + 1,) or out.dtype != torch.int64:
        raise ValueError(f"local_row_map: out must be int64 [{P + 1}], got {tuple(out.shape)}")
    else:
        out.fill_(-1)
    out.scatter_(0, torch.where(src >= 0, src, P), dst.to(torch.int64))
    return out[:P]


#: the producer's visiting orders of the schedule (OverlapSystem's `order` knob)
ORDERS = ("remote_first", "expert")


def producer_order(plan: Any) -> torch.Tensor:
    """order [B] int32 on the plan's device: the schedule positions in the order the producer
    visits them for order="expert" (the default "remote_first" visits them 0, 1, ..., B-1).

    Each expert's remote bands (consecutive in the schedule) are directly followed by its local
    bands, experts in the order of their first remote band, experts without remote bands last;
    a DevicePlan's unused positions (>= n_bands) stay at the end. So the bands that read one
    expert's weights run together (concurrent tiles of the producer's swizzle share each
    weight strip in L2), while the remote bands keep their schedule order (the consumer never
    waits on a later band first). B is n_bands (a CombinePlan) or the bound B' (a DevicePlan);
    a handful of device ops, no host synchronisation.
    """
    sched = plan.schedule
    B, dev = sched.numel(), sched.device
    pos = torch.arange(B, dtype=torch.int64, device=dev)
    exp = plan.band_expert.to(torch.int64)[sched.to(torch.int64).clamp(0, max(B - 1, 0))]
    exp = exp.clamp(0, plan.experts_per_rank - 1)  # a DevicePlan's unused entries
    remote = pos < plan.n_remote_bands
    first = torch.full((plan.experts_per_rank,), B, dtype=torch.int64, device=dev)
    first.scatter_reduce_(0, exp, torch.where(remote, pos, B), "amin")
    key = torch.where(pos < plan.n_bands, first[exp], B + 1) * (B + 1) + pos
    return torch.sort(key).indices.to(torch.int32)


def check_group_cap(cap: int) -> None:
    """A one-line ValueError unless 1 <= cap < GROUP_CODE (a group's size must fit its code)."""
    if not 1 <= cap < GROUP_CODE:
        raise ValueError(f"producer_groups: cap must be in [1, {GROUP_CODE}), got {cap}")


def producer_groups(plan: Any, visit: torch.Tensor | None, cap: int) -> torch.Tensor:
    """groups [B] int32 on the plan's device: the producer's swizzle group of each visiting
    position v (TileConfig.expert_groups), encoded first * GROUP_CODE + size.

    A group is a run of consecutive visiting positions [first, first + size) whose bands all
    belong to one expert, at most `cap` long: each run of one expert is cut into
    ceil(run / cap) groups of near-equal size. The producer walks a group column tile by
    column tile, so each of that expert's weight strips is read from HBM once per group (a
    group that straddled two experts would read both experts' strips). visit [B]: the
    visiting order (producer_order; None: the schedule's own order). A DevicePlan's unused
    positions (>= n_bands) are groups of one. A handful of device ops, no host synchronisation.
    """
    check_group_cap(cap)
    sched = plan.schedule
    B, dev = sched.numel(), sched.device
    v = torch.arange(B, dtype=torch.int64, device=dev)
    pos = v if visit is None else visit.to(torch.int64).clamp(0, max(B - 1, 0))
    exp = plan.band_expert.to(torch.int64)[sched.to(torch.int64)[pos].clamp(0, max(B - 1, 0))]
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
    first = torch.where(
        o < big, o - o % (base + 1), big + (o - big) - (o - big) % base.clamp(min=1)
    )
    size = torch.where(o < big, base + 1, base)
    return ((run_first + first) * GROUP_CODE + size).to(torch.int32)


def split_tail_bands(
    plan: Any, visit: torch.Tensor | None, tail_m: int
) -> list[tuple[Any, torch.Tensor] | None]:
    """The plan's schedule cut in two producer launches: the bands with more than tail_m rows
    (the main launch, tile_m rows a tile) and the bands with at most tail_m rows (the tail
    launch, tiles of tail_m rows: a compact plan's last band of an expert often holds a few
    rows, and a tile_m-row tile computes the padding too).

    Returns [main, tail], each (sub_plan, sub_visit), or None where no band is of its kind. A
    sub_plan keeps the plan's band arrays (band ids, so the ready counters stay per band) with
    its own schedule [B_s] (its signalled bands first, as in the plan), n_remote_bands, n_bands
    and layout; sub_visit [B_s] int32 is the visiting order of its positions, the plan's
    visiting order (visit; None: the schedule's) restricted to it. A host plan's set-up step:
    it reads the band rows to the host."""
    from types import SimpleNamespace

    sched = plan.schedule.to("cpu", torch.int64)
    B = sched.numel()
    rows = plan.band_rows.to("cpu", torch.int64)[sched]  # rows of each schedule position
    order = torch.arange(B) if visit is None else visit.to("cpu", torch.int64)
    n_remote = int(plan.n_remote_bands)
    dev = plan.schedule.device
    out = []
    for tail in (False, True):
        vis = [int(p) for p in order if bool(rows[p] <= tail_m) == tail]
        if not vis:
            out.append(None)
            continue
        pos = sorted(p for p in vis if p < n_remote) + sorted(p for p in vis if p >= n_remote)
        where = {p: i for i, p in enumerate(pos)}
        sub = SimpleNamespace(
            schedule=sched[pos].to(device=dev, dtype=plan.schedule.dtype),
            band_expert=plan.band_expert,
            band_row=plan.band_row,
            band_rows=plan.band_rows,
            n_remote_bands=sum(p < n_remote for p in pos),
            n_bands=len(pos),
            experts_per_rank=plan.experts_per_rank,
            layout=getattr(plan, "layout", "aligned"),
        )
        sub_visit = torch.tensor([where[p] for p in vis], dtype=torch.int32, device=dev)
        out.append((sub, sub_visit))
    return out


def split_groups(sub: Any, visit: torch.Tensor, cap: int) -> torch.Tensor:
    """producer_groups of a split_tail_bands sub-plan (its band ids are the full plan's, which
    producer_groups would clamp to the sub-plan's length): the same runs of one expert, computed
    on the sub-plan's positions renumbered 0..B_s-1."""
    from types import SimpleNamespace

    n = sub.schedule.numel()
    exp = sub.band_expert[sub.schedule.to(torch.int64)]
    ids = torch.arange(n, dtype=sub.schedule.dtype, device=sub.schedule.device)
    view = SimpleNamespace(schedule=ids, band_expert=exp, n_bands=n)
    return producer_groups(view, visit, cap)
