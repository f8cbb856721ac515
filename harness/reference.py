"""The reference MoE layer: the oracle every system is checked against. Pure torch.

Rank r's five steps (rows in harness/layout.py's order):
  1 route     seeded global routing (harness/routing.py)
  2 dispatch  all_to_all_single of the rows x[send_token]               [S, K] -> [R, K]
  3 expert    Y_e = X_e @ B_e per local expert (harness/experts.py)     [R, K] -> [R, N]
              (FFN cells: Y_e = gelu(X_e @ W1_e) @ W2_e                   [R, H] -> [R, H])
  4 combine   all_to_all_single back to the owners, same row positions   [R, N] -> [S, N]
  5 scale     out[t] = sum_j w[t, j] * y[t, j]                           [S, N] -> [T, N]
The oracle, `reference_local`, computes the output in float32 in one process, no communication.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from harness.experts import activation
from harness.layout import RankLayout
from harness.workload import (
    WorkloadSpec,
    make_expert_weight,
    make_fc1_weight,
    make_fc2_weight,
    make_grad,
    make_tokens,
    routing_of,
)


def _all_to_all(rows: torch.Tensor, recv_counts, send_counts, group) -> torch.Tensor:
    """rows [sum(send_counts), N] -> [sum(recv_counts), N] (counts [W] int64 CPU tensors)."""
    out = rows.new_empty(int(recv_counts.sum()), rows.shape[1])
    dist.all_to_all_single(out, rows, recv_counts.tolist(), send_counts.tolist(), group=group)
    return out


def dispatch(x: torch.Tensor, lay: RankLayout, group: dist.ProcessGroup | None) -> torch.Tensor:
    """Step 2: x [T, K] of this rank -> x_recv [R, K] (rows grouped by source rank)."""
    send = x.index_select(0, lay.send_token.to(x.device))
    return _all_to_all(send, lay.recv_counts, lay.send_counts, group)


def dispatch_local(spec: WorkloadSpec, lay: RankLayout, device: torch.device) -> torch.Tensor:
    """Step 2 without communication: x_recv [R, K] built from every source's seeded tokens."""
    out = torch.empty(lay.recv_src.numel(), spec.hidden, dtype=spec.torch_dtype, device=device)
    for s in range(spec.world_size):
        sel = (lay.recv_src == s).nonzero().squeeze(1)
        if sel.numel():
            xs = make_tokens(spec, s, device)
            out[sel.to(device)] = xs.index_select(0, lay.recv_token[sel].to(device))
    return out


def combine(y_recv: torch.Tensor, lay: RankLayout, group: dist.ProcessGroup | None) -> torch.Tensor:
    """Step 4: y_recv [R, N] (grouped by source) -> y_back [S, N] in this rank's send order."""
    return _all_to_all(y_recv, lay.send_counts, lay.recv_counts, group)


def reference_local(spec: WorkloadSpec, rank: int, device: torch.device) -> torch.Tensor:
    """The oracle: out [T, N] float32 of `rank`, with no communication: out[t] = sum_j
    w[t, j] * (x[t] @ B_{g(t, j)}) in float32 from spec.dtype inputs (FFN cells: gelu(x[t] @
    W1_g) @ W2_g)."""
    routing = routing_of(spec)
    x = make_tokens(spec, rank, device).float()
    ids = routing.expert_ids[rank]  # [T, k]
    gw = routing.gate_weights[rank].to(device)  # [T, k]
    out = torch.zeros(spec.tokens_per_rank, spec.out, dtype=torch.float32, device=device)
    for g in torch.unique(ids).tolist():
        t, j = (ids == g).nonzero(as_tuple=True)
        t, j = t.to(device), j.to(device)
        xg = x.index_select(0, t)
        if spec.ffn:
            h = activation(xg @ make_fc1_weight(spec, g, device).float())
            y = h @ make_fc2_weight(spec, g, device).float()
        else:
            y = xg @ make_expert_weight(spec, g, device).float()
        out.index_add_(0, t, y * gw[t, j][:, None])
    return out


def moe_torch(x, expert_ids, gate, w1, w2) -> torch.Tensor:
    """out [T, H] = sum_j gate[t, j] * gelu(x[t] @ w1[g]) @ w2[g], g = expert_ids[t, j], over every
    global expert's w1 [G, H, F] and w2 [G, F, H]: plain differentiable torch."""
    out = x.new_zeros(x.shape[0], w2.shape[2])
    for g in torch.unique(expert_ids).tolist():
        t, j = (expert_ids == g).nonzero(as_tuple=True)
        y = activation(x.index_select(0, t) @ w1[g]) @ w2[g]
        out = out.index_add(0, t, y * gate[t, j].unsqueeze(1))
    return out


def reference_train(spec: WorkloadSpec, played: list[int], device: torch.device) -> dict:
    """The train scope's oracle: torch autograd in float32 of every rank's layer with the loss
    sum_r <out_r, dy_r> (dy_r: make_grad). The played ranks' out [T, H], dx [T, H], dgate [T, k]
    and their experts' dw1 [E, H, F], dw2 [E, F, H], each stacked in `played` order."""
    routing, E = routing_of(spec), spec.experts_per_rank
    w1 = torch.stack([make_fc1_weight(spec, g, device) for g in range(spec.n_experts)])
    w2 = torch.stack([make_fc2_weight(spec, g, device) for g in range(spec.n_experts)])
    w1, w2 = w1.float().requires_grad_(), w2.float().requires_grad_()
    xs, gates, outs = [], [], []
    for r in range(spec.world_size):
        xs.append(make_tokens(spec, r, device).float().requires_grad_())
        gates.append(routing.gate_weights[r].to(device).float().requires_grad_())
        outs.append(moe_torch(xs[r], routing.expert_ids[r].to(device), gates[r], w1, w2))
    dys = [make_grad(spec, r, device).float() for r in range(spec.world_size)]
    torch.autograd.backward(outs, dys)
    mine = [slice(r * E, (r + 1) * E) for r in played]
    return {
        "out": torch.cat([outs[r].detach() for r in played]),
        "dx": torch.cat([xs[r].grad for r in played]),
        "dgate": torch.cat([gates[r].grad for r in played]),
        "dw1": torch.cat([w1.grad[s] for s in mine]),
        "dw2": torch.cat([w2.grad[s] for s in mine]),
    }
