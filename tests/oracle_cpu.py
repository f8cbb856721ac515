"""CPU oracle of the overlapped combine, driven by a CombinePlan (systems/overlap/plan.py).

What the GPU producer and consumer do, in plain torch and in the same order:
  1 pad     X [P, K] = x_recv rows at row_pos, zero padding rows elsewhere (plan.padded_input)
  2 produce walk the schedule band by band: Y[rows of b] = X[rows of b] @ B_{band_expert[b]}
  3 send    as soon as the last band of a segment is computed, send its valid rows
            Y[src_row : + rows] to seg_dst at offset (one message per segment, plan_segments;
            a compact plan's segments are made of pieces, plan_pieces)
  4 local   after the schedule, the local rows -> own buffer at row_dst (the GPU producer's
            epilogue stores them there directly: the same end state)
  5 scale   scale (below) over the combine receive buffer [S_rows, N]

Two transports: `overlap_forward` sends over a torch.distributed group (gloo: isend/irecv, tag =
the sender's segment index; each rank builds every peer's plan, since the routing is global and
deterministic), `overlap_loopback` plays all W ranks in one process and writes segments straight
into stand-in receive buffers. The loop over bands is the producer's walk (the thing being
modelled), not a loop over rows.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist

from harness.layout import RankLayout
from systems.overlap.plan import CombinePlan, padded_input
from tests.overlap_testing import local_rows, plan_pieces, plan_segments


def scale(y_back: torch.Tensor, lay: RankLayout, tokens: int) -> torch.Tensor:
    """Step 5: out [T, N] = sum_j gate[t, j] * y_back[send_pos[t, j]], from y_back [S, N]: a
    gather to [T, k, N], a product with the gates in y_back's dtype, a sum over k (torch
    accumulates it in float32)."""
    k = lay.send_pos.shape[1]
    rows = y_back.index_select(0, lay.send_pos.reshape(-1).to(y_back.device))
    w = lay.gate.to(device=y_back.device, dtype=y_back.dtype)
    return (rows.view(tokens, k, y_back.shape[1]) * w.unsqueeze(-1)).sum(1)


#: send(segment index, destination rank, destination row offset, rows [n, N])
SendFn = Callable[[int, int, int, torch.Tensor], None]


def produce(
    plan: CombinePlan, x: torch.Tensor, weights: torch.Tensor, send: SendFn
) -> torch.Tensor:
    """Walk the schedule: compute each band of X [P, K] with weights [E, K, N] into Y [P, N],
    send each segment once the band of its last unit is done (a unit: a remote band, or a
    piece of a compact plan, plan_pieces). Returns Y (padding rows are zero)."""
    y = x.new_zeros(plan.n_padded, weights.shape[2])
    sched = plan.schedule.tolist()
    b_exp, b_row, b_rows = (t.tolist() for t in (plan.band_expert, plan.band_row, plan.band_rows))
    pos = torch.empty_like(plan.schedule)
    pos[plan.schedule] = torch.arange(int(plan.n_bands))
    units = plan_pieces(plan)
    # schedule position after which each segment can go (segments come in that order)
    seg_ready = pos[units.band[plan.seg_start + plan.seg_count - 1]].tolist()
    seg_dst = plan.seg_dst.tolist()
    seg_src, seg_rows, seg_off = (t.tolist() for t in plan_segments(plan))
    s = 0
    for i, b in enumerate(sched):
        r0, n = b_row[b], b_rows[b]
        torch.matmul(x[r0 : r0 + n], weights[b_exp[b]], out=y[r0 : r0 + n])
        while s < len(seg_ready) and seg_ready[s] == i:
            send(s, seg_dst[s], seg_off[s], y[seg_src[s] : seg_src[s] + seg_rows[s]])
            s += 1
    return y


def _receive_buffer(lay: RankLayout, n_cols: int, like: torch.Tensor) -> torch.Tensor:
    return like.new_zeros(int(lay.send_counts.sum()), n_cols)


def _copy_local(plan: CombinePlan, y: torch.Tensor, back: torch.Tensor) -> None:
    src_row, dst_index = local_rows(plan)
    back[dst_index.to(back.device)] = y[src_row.to(y.device)]


def overlap_forward(
    plans: list[CombinePlan],
    x_recv: torch.Tensor,
    weights: torch.Tensor,
    lay: RankLayout,
    tokens: int,
    group: dist.ProcessGroup | None = None,
) -> torch.Tensor:
    """This rank's out [T, N] over a process group whose ranks are the layer's W ranks.

    plans: the plans of ALL W ranks (plans[lay.rank] is this rank's); x_recv [R, K];
    weights [E, K, N]. Receives are posted first, then the producer walk sends segments.
    """
    me = lay.rank
    plan = plans[me]
    back = _receive_buffer(lay, weights.shape[2], x_recv)
    reqs = []
    for s, peer in enumerate(plans):
        if s == me:
            continue
        _, rows, offs = (t.tolist() for t in plan_segments(peer))
        for j, (d, o, n) in enumerate(zip(peer.seg_dst.tolist(), offs, rows)):
            if d == me:
                reqs.append(dist.irecv(back[o : o + n], src=s, tag=j, group=group))

    def send(seg: int, dst: int, offset: int, rows: torch.Tensor) -> None:
        reqs.append(dist.isend(rows, dst=dst, tag=seg, group=group))

    y = produce(plan, padded_input(x_recv, plan.gather_index), weights, send)
    _copy_local(plan, y, back)
    for r in reqs:
        r.wait()
    return scale(back, lay, tokens)


def overlap_loopback(
    plans: list[CombinePlan],
    x_recvs: list[torch.Tensor],
    weights: list[torch.Tensor],
    lays: list[RankLayout],
    tokens: int,
) -> list[torch.Tensor]:
    """All W ranks in one process: out [T, N] of every rank, segments written into stand-in
    receive buffers. x_recvs[r] [R_r, K], weights[r] [E, K, N]."""
    n_cols = weights[0].shape[2]
    backs = [_receive_buffer(lay, n_cols, x_recvs[0]) for lay in lays]

    def send(seg: int, dst: int, offset: int, rows: torch.Tensor) -> None:
        backs[dst][offset : offset + rows.shape[0]] = rows

    for plan, x_recv, w in zip(plans, x_recvs, weights):
        y = produce(plan, padded_input(x_recv, plan.gather_index), w, send)
        _copy_local(plan, y, backs[plan.rank])
    return [scale(back, lay, tokens) for back, lay in zip(backs, lays)]
