"""Synthetic plans and pure-torch expectations shared by the kernel tests and the benchmarks.

`synthetic_plan(rows, rank=, tile_m=, ...)` makes a combine plan from group sizes alone (no
routing, no tokens): rows[e][s] = valid rows of local expert e owned by rank s. It writes the
expert-side rows those sizes describe (what harness.layout.RankLayout holds for a real routing)
and hands them to THE stage-A builder, systems.overlap.plan.build_plan, so every plan a test or
benchmark uses is a real plan. Destination d receives this rank's rows consecutively from
dst_base[d] on, in (expert, row) order.

Expectations (pure torch, independent of the kernels):
  expected_sends  what the consumer must leave in every destination buffer
  rows_sent       valid rows a plan sends to each rank
  reference_y     the producer's output Y in float32
  balanced_rows   group sizes of a balanced problem
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields

import torch

from systems.overlap.plan import CombinePlan, build_plan, plan_pieces, slot_ranks


@dataclass
class SyntheticPlan(CombinePlan):
    """A CombinePlan (from build_plan) plus dst_rows [W] (host ints): the receive-buffer rows
    each destination needs for this plan's rows (dst_base + rows sent there, at least 1)."""

    dst_rows: list[int] = field(default_factory=list)


def synthetic_rows(
    rows: list[list[int]], *, rank: int, dst_base: list[int] | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, list[int]]:
    """The expert-side rows that group sizes rows[e][s] describe, in layout order.

    Returns recv_src, recv_expert, recv_dst_index [R] (int64, CPU; build_plan's inputs) and
    dst_rows [W]. Row order: experts ascending, within an expert the remote owners ascending,
    then `rank`; destination d's rows are consecutive from dst_base[d] in (expert, row) order.
    """
    E, W = len(rows), len(rows[0])
    cnt = torch.tensor(rows, dtype=torch.int64).view(E, W)  # [E, W] by owner
    base = torch.tensor(list(dst_base) if dst_base is not None else [0] * W, dtype=torch.int64)
    owners = slot_ranks(W, rank)  # owner of each group slot: remote ascending, `rank` last
    flat = cnt[:, owners].reshape(-1)  # [E * W] group sizes in layout order
    R = int(flat.sum())
    src = torch.repeat_interleave(owners.repeat(E), flat, output_size=R)
    expert = torch.repeat_interleave(torch.arange(E).repeat_interleave(W), flat, output_size=R)
    start = base + torch.cumsum(cnt, 0) - cnt  # [E, W]: first destination row of each group
    first = torch.cumsum(flat, 0) - flat  # first layout row of each group
    g = torch.repeat_interleave(torch.arange(E * W), flat, output_size=R)
    dst = start[:, owners].reshape(-1)[g] + torch.arange(R) - first[g]
    dst_rows = (base + cnt.sum(0)).clamp(min=1).tolist()
    return src, expert, dst, dst_rows


def synthetic_plan(
    rows: list[list[int]],
    *,
    rank: int,
    tile_m: int,
    mgb: int = 1,
    device: torch.device | str = "cpu",
    dst_base: list[int] | None = None,
    out_cols: int = 0,
    elem_bytes: int = 0,
    layout: str = "aligned",
) -> SyntheticPlan:
    """A combine plan of `rank` from group sizes rows[e][s] (valid rows of local expert e owned
    by rank s), built by systems.overlap.plan.build_plan on `device`.

    x_recv row i is the i-th valid row in layout order (experts ascending, remote owners
    ascending, then the local group), so plan.n_rows rows of any x_recv fit. out_cols and
    elem_bytes only size seg_bytes. layout: build_plan's. dst_rows: see SyntheticPlan.
    """
    src, expert, dst, dst_rows = synthetic_rows(rows, rank=rank, dst_base=dst_base)
    plan = build_plan(
        src.to(device),
        expert.to(device),
        dst.to(device),
        world_size=len(rows[0]),
        rank=rank,
        experts_per_rank=len(rows),
        tile_m=tile_m,
        mgb=mgb,
        out_cols=out_cols,
        elem_bytes=elem_bytes,
        layout=layout,
    )
    return SyntheticPlan(**{f.name: getattr(plan, f.name) for f in fields(plan)}, dst_rows=dst_rows)


def expected_sends(plan, y: torch.Tensor, recv: list[torch.Tensor]) -> list[torch.Tensor]:
    """What the consumer must leave in each destination buffer: copies of recv with every
    unit's rows of y [P, N] written at its offset (units: remote bands of an aligned plan,
    pieces of a packed one; plan_pieces). Pure torch."""
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
    for b in range(plan.n_bands):
        y[rows[b] : rows[b] + n[b]] = x[rows[b] : rows[b] + n[b]].float() @ w[e[b]].float()
    return y


def balanced_rows(experts: int, rows_per_expert: int, world: int) -> list[list[int]]:
    """rows[e][s]: each expert's rows split evenly over `world` owners."""
    share = rows_per_expert // world
    return [[share] * world for _ in range(experts)]
