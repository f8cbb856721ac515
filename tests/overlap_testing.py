"""Synthetic plans and pure-torch expectations shared by the kernel tests.

`synthetic_plan(rows, rank=, tile_m=, ...)` is systems.overlap.plan.plan_from_rows (group sizes
through THE stage-A builder, so every plan a test uses is a real plan) plus the receive-buffer
rows each destination needs (dst_rows).

Expectations (pure torch, independent of the kernels):
  expected_sends  what the consumer must leave in every destination buffer
  rows_sent       valid rows a plan sends to each rank
  reference_y     the producer's output Y in float32
  balanced_rows   group sizes of a balanced problem
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields

import torch

from systems.overlap.plan import CombinePlan, plan_from_rows, plan_pieces, rows_of_sizes


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
