"""Dispatch / combine row layout of one rank from the global routing, no communication (rows and
send order: docs/method.md, "Row order"). The owner's combine receive buffer is y_back [T*k, N]:
out[t] = sum over rows i with send_token[i] == t of send_weight[i] * y_back[i]. The expert side
receives rows grouped by source rank, then (local expert, token, slot).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from harness.workload import WorkloadSpec, routing_of


@dataclass
class RankLayout:
    """Row layout of one rank (CPU int64 tensors unless noted): owner side (this rank's tokens,
    S = T * top_k rows) and expert side (the R rows this rank's experts compute)."""

    rank: int
    send_token: torch.Tensor  # [S] token index of each row in send order
    send_slot: torch.Tensor  # [S] top-k slot of each row
    send_weight: torch.Tensor  # [S] float32 gate weight
    send_counts: torch.Tensor  # [W] rows sent to each destination rank
    send_pos: torch.Tensor  # [T, k] position of (token t, slot j) in the send order
    gate: torch.Tensor  # [T, k] float32 gate weights of this rank's tokens
    recv_counts: torch.Tensor  # [W] rows received from each source rank
    recv_src: torch.Tensor  # [R] source (owner) rank of each row
    recv_expert: torch.Tensor  # [R] local expert index of each row
    recv_token: torch.Tensor  # [R] token index at the source
    recv_dst_index: torch.Tensor  # [R] position in the source's combine receive buffer
    expert_counts: torch.Tensor  # [E] rows per local expert


def send_order(spec: WorkloadSpec, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Flat pair index [S] of rank's rows in send order and their global expert ids [S]."""
    ids = routing_of(spec).expert_ids[rank].reshape(-1)  # [T*k], pair p = t*k + j
    order = torch.sort(ids, stable=True).indices  # dest-major, then local expert, then (t, j)
    return order, ids[order]


def counts_matrix(spec: WorkloadSpec) -> torch.Tensor:
    """C [W, W]: C[s, d] = rows that source s sends to destination d."""
    W, E = spec.world_size, spec.experts_per_rank
    dest = routing_of(spec).expert_ids.reshape(W, -1) // E
    return torch.stack([torch.bincount(dest[s], minlength=W) for s in range(W)])


def rank_layout(spec: WorkloadSpec, rank: int) -> RankLayout:
    """The full layout of one rank, computed identically on every rank."""
    W, E, k = spec.world_size, spec.experts_per_rank, spec.top_k
    routing = routing_of(spec)
    order, gid = send_order(spec, rank)
    C = counts_matrix(spec)

    # Expert side: all pairs of all sources whose expert lives on this rank.
    ids = routing.expert_ids.reshape(W, -1)  # [W, T*k]
    src, pair = torch.nonzero(ids // E == rank, as_tuple=True)  # src-major, pair-ascending
    local_e = ids[src, pair] % E
    key = src * E + local_e
    o = torch.sort(key, stable=True).indices
    src, pair, local_e = src[o], pair[o], local_e[o]
    # Position inside the source's send buffer: offset of destination `rank` there + rank within.
    dest_offset = torch.cumsum(C, 1)[:, rank] - C[:, rank]  # [W]
    recv_counts = C[:, rank].clone()
    first_of_src = torch.cumsum(recv_counts, 0) - recv_counts
    idx_in_src = torch.arange(src.numel()) - first_of_src[src]
    send_pos = torch.empty_like(order)
    send_pos[order] = torch.arange(order.numel())
    return RankLayout(
        rank=rank,
        send_token=order // k,
        send_slot=order % k,
        send_weight=routing.gate_weights[rank].reshape(-1)[order].float(),
        send_counts=C[rank].clone(),
        send_pos=send_pos.view(spec.tokens_per_rank, k),
        gate=routing.gate_weights[rank].float(),
        recv_counts=recv_counts,
        recv_src=src,
        recv_expert=local_e,
        recv_token=pair // k,
        recv_dst_index=dest_offset[src] + idx_in_src,
        expert_counts=torch.bincount(local_e, minlength=E),
    )
