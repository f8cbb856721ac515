"""Synthetic plans and pure-torch expectations shared by the kernel tests.

`synthetic_plan(rows, rank=, tile_m=, ...)` is systems.overlap.plan.plan_from_rows (group sizes
through THE stage-A builder, so every plan a test uses is a real plan) plus the receive-buffer
rows each destination needs (dst_rows); `plans_for_spec` the plans of every rank of a spec.

What a plan implies, derived from its arrays (the product reads only the arrays):
  plan_pieces     the consumer's units in send order (remote bands, or a compact plan's pieces)
  plan_segments   each segment's first padded row, rows and destination row
  local_rows      the local rows' padded rows and receive-buffer rows (from row_dst)

Expectations (pure torch, independent of the kernels):
  expected_sends  what the consumer must leave in every destination buffer
  rows_sent       valid rows a plan sends to each rank
  reference_y     the producer's output Y in float32
  balanced_rows   group sizes of a balanced problem
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields

import torch

from harness.layout import RankLayout, rank_layout
from harness.workload import WorkloadSpec
from systems.overlap.plan import CombinePlan, plan_for_layout, plan_from_rows, rows_of_sizes


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
    """Pieces of a compact plan (dst: their segment's); of an aligned plan, its remote bands in
    schedule order (one piece per band). Either way segment s sends units seg_start[s] ..
    + seg_count[s]. Of the plan's valid prefixes (trimmed)."""
    plan = plan.trimmed()
    if plan.layout == "compact":
        dst = torch.repeat_interleave(plan.seg_dst, plan.seg_count)
        return Pieces(plan.piece_band, plan.piece_row, plan.piece_rows, plan.piece_offset, dst)
    b = plan.schedule[: plan.n_remote_bands]
    return Pieces(b, plan.band_row[b], plan.band_valid[b], plan.band_offset[b], plan.band_dst[b])


def plan_segments(plan: CombinePlan) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(src_row, rows, offset) [S]: each segment's first padded row, its valid rows (one
    contiguous range of Y) and its destination row (the cut rule makes both contiguous)."""
    u, plan = plan_pieces(plan), plan.trimmed()
    seg_of = torch.repeat_interleave(torch.arange(plan.seg_start.numel()), plan.seg_count.cpu())
    rows = torch.zeros_like(plan.seg_start).index_add_(0, seg_of.to(u.rows.device), u.rows)
    return u.row[plan.seg_start], rows, u.offset[plan.seg_start]


def local_rows(plan: CombinePlan) -> tuple[torch.Tensor, torch.Tensor]:
    """(src_row, dst_index) [L]: the padded row and the own receive-buffer row of each local
    row, in x_recv row order (from row_dst)."""
    plan = plan.trimmed()
    p = torch.nonzero(plan.row_dst >= 0).squeeze(1)
    p = p[torch.argsort(plan.gather_index[p])]
    return p, plan.row_dst[p]


def plans_for_spec(
    spec: WorkloadSpec, *, tile_m: int, mgb: int, device: torch.device | None = None, **knobs
) -> tuple[list[CombinePlan], list[RankLayout]]:
    """Plans and RankLayouts of all W ranks of a spec (every rank can build every plan);
    knobs: plan_for_layout's layout, order, group_cap."""
    lays = [rank_layout(spec, r) for r in range(spec.world_size)]
    elem = torch.empty(0, dtype=spec.torch_dtype).element_size()
    shape = dict(world_size=spec.world_size, experts_per_rank=spec.experts_per_rank)
    shape |= dict(tile_m=tile_m, mgb=mgb, out_cols=spec.out, elem_bytes=elem, device=device)
    return [plan_for_layout(lay, **shape, **knobs) for lay in lays], lays


@dataclass
class SyntheticPlan(CombinePlan):
    """A CombinePlan plus dst_rows [W] (host ints): the receive-buffer rows each destination
    needs for this plan's rows (dst_base + rows sent there, at least 1)."""

    dst_rows: list[int] = field(default_factory=list)


def _dst_rows(rows, dst_base) -> list[int]:
    base = torch.tensor(list(dst_base) if dst_base is not None else [0] * len(rows[0]))
    return (base + torch.tensor(rows).sum(0)).clamp(min=1).tolist()


def synthetic_rows(rows: list[list[int]], *, rank: int, dst_base: list[int] | None = None):
    """plan.rows_of_sizes's (recv_src, recv_expert, recv_dst_index) and dst_rows [W]."""
    return (*rows_of_sizes(rows, rank=rank, dst_base=dst_base), _dst_rows(rows, dst_base))


def synthetic_plan(
    rows: list[list[int]], *, rank: int, dst_base: list[int] | None = None, **kw
) -> SyntheticPlan:
    """plan_from_rows(rows, rank=rank, dst_base=dst_base, **kw) with its dst_rows."""
    plan = plan_from_rows(rows, rank=rank, dst_base=dst_base, **kw)
    fs = {f.name: getattr(p, f.name) for p in [plan] for f in fields(p)}
    return SyntheticPlan(**fs, dst_rows=_dst_rows(rows, dst_base))


def expected_sends(plan, y: torch.Tensor, recv: list[torch.Tensor]) -> list[torch.Tensor]:
    """What the consumer must leave in each destination buffer: copies of recv with every
    unit's rows of y [P, N] written at its offset (units: remote bands of an aligned plan,
    pieces of a compact one; plan_pieces). Pure torch."""
    out = [r.clone() for r in recv]
    u = plan_pieces(plan)
    for r0, n, off, d in zip(*(t.tolist() for t in (u.row, u.rows, u.offset, u.dst))):
        out[d][off : off + n] = y[r0 : r0 + n]
    return out


def rows_sent(plan) -> list[int]:
    """Valid rows this plan sends to each rank [W]."""
    u = plan_pieces(plan)
    sent = torch.zeros(plan.world_size, dtype=torch.int64, device=u.dst.device)
    return sent.index_add_(0, u.dst, u.rows.to(torch.int64)).tolist()


def reference_y(plan, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """Y [P, N] in float32 for padded input x [P, K] and weights [E, K, N]."""
    y = torch.zeros(x.shape[0], w.shape[2], dtype=torch.float32, device=x.device)
    rows, n, e = plan.band_row.tolist(), plan.band_rows.tolist(), plan.band_expert.tolist()
    for b in range(int(plan.n_bands)):
        y[rows[b] : rows[b] + n[b]] = x[rows[b] : rows[b] + n[b]].float() @ w[e[b]].float()
    return y


def balanced_rows(experts: int, rows_per_expert: int, world: int) -> list[list[int]]:
    """rows[e][s]: each expert's rows split evenly over `world` owners."""
    share = rows_per_expert // world
    return [[share] * world for _ in range(experts)]


def nvshmem_self_transport(recv_rows: int, n: int, dtype: torch.dtype, device: torch.device):
    """W = 1 NVSHMEM transport without rendezvous (torch refuses a rendezvous of one rank): the
    consumer stores into this process's NVSHMEM heap, on one GPU. Needs
    torch.distributed initialised with one rank (NVSHMEM bootstraps from it)."""
    import torch.distributed._symmetric_memory as symm_mem

    from systems.overlap.transport import Transport, _symm_backend

    _symm_backend("NVSHMEM", device)
    buf = symm_mem.empty(max(recv_rows, 1) * n, dtype=dtype, device=device)
    sig = symm_mem.empty(1, dtype=torch.int64, device=device)
    buf.zero_()
    sig.zero_()
    t_buf = torch.tensor([buf.data_ptr()], dtype=torch.int64, device=device)
    t_sig = torch.tensor([sig.data_ptr()], dtype=torch.int64, device=device)
    return Transport(
        rank=0,
        world=1,
        recv=buf.view(-1, n)[:recv_rows],
        signal=sig,
        recv_ptrs=t_buf,
        signal_ptrs=t_sig,
        scope="sys",
        aligned=buf.data_ptr() % 16 == 0,
        keep=[buf, sig],
    )
