"""The layer's NCCL dispatch (all_to_all_single), shared by the layer-scope systems; terms:
docs/method.md, "The layer" and "The layer's stage A". Its one host sync is a `.tolist()` of the
2W + E + 1 split sizes after the counts exchange. On a GPU the bookkeeping is Triton kernels
(harness/kernels/dispatch.py; the `*_torch` functions are the CPU path and their references),
the labels launched before the sync: a launch after it idles the device until the host makes it.
Rows follow harness/layout.py's order (send: by global expert, stable; recv: by source rank,
then local expert, then the source's send order).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist


def _excl_cumsum(x: torch.Tensor) -> torch.Tensor:
    return torch.cumsum(x, 0) - x


def blocks(recv_counts: torch.Tensor, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    """For rows in (source, expert) blocks of recv_counts [W, E]: each row's block s*E+e [R]
    and its index within the block [R]."""
    c = recv_counts.reshape(-1)
    block = torch.repeat_interleave(torch.arange(c.numel(), device=c.device), c, output_size=rows)
    return block, torch.arange(rows, device=c.device) - _excl_cumsum(c)[block]


def expert_positions(
    recv_counts: torch.Tensor, block: torch.Tensor, idx: torch.Tensor
) -> torch.Tensor:
    """Each row's position [R] when the (source, expert) blocks are reordered to (expert,
    source): no sort, a gather from the blocks' expert-major starts."""
    W, E = recv_counts.shape
    em_start = _excl_cumsum(recv_counts.t().reshape(-1)).view(E, W).t().reshape(-1)
    return em_start[block] + idx


def sort_meta_torch(
    expert_ids: torch.Tensor, world_size: int, experts: int, top_k: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(order [S], pos [S], token [S], meta [W, 2E]) of the stable sort of the routing's
    global experts expert_ids [T, k] (pair i = token * top_k + slot): send row j holds pair
    order[j], pos[order[j]] = j, token[j] = order[j] // top_k, and per global expert the rows
    sent to it and the rows sent to the experts before it, interleaved (the counts exchange's
    payload). The reference of harness/kernels/dispatch.py sort_meta (the CPU path)."""
    keys, order = torch.sort(expert_ids.reshape(-1), stable=True)
    pos = torch.empty_like(order)
    pos[order] = torch.arange(order.numel(), device=order.device)
    cnt = torch.bincount(keys, minlength=world_size * experts)  # [G] rows per global expert
    meta = torch.stack([cnt, _excl_cumsum(cnt)], 1).view(world_size, experts * 2)
    return order, pos, order // top_k, meta


def split_sizes_torch(
    meta: torch.Tensor, got: torch.Tensor, world_size: int, experts: int
) -> torch.Tensor:
    """sizes [2W + E + 1]: rows sent to each rank (meta's counts), received from each rank,
    received for each local expert (got's counts) and received in all. The reference of
    split_sizes."""
    sent = meta.view(world_size, experts, 2)[..., 0]
    recv = got.view(world_size, experts, 2)[..., 0]
    return torch.cat([sent.sum(1), recv.sum(1), recv.sum(0), recv.sum().view(1)])


def recv_rows_torch(
    recv_counts: torch.Tensor, recv_off: torch.Tensor, rows: int, expert_pos: bool
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """(recv_src, recv_expert, recv_dst_index [rows], expert_pos [rows] or None, offs [E]
    int32) of rows received in recv_counts' [W, E] blocks, with torch ops (the reference of
    harness/kernels/dispatch.py recv_rows, which returns the same in one launch)."""
    E = recv_counts.shape[1]
    block, idx = blocks(recv_counts, rows)
    pos = expert_positions(recv_counts, block, idx) if expert_pos else None
    offs = torch.cumsum(recv_counts.sum(0), 0).to(torch.int32)
    return block // E, block % E, recv_off.reshape(-1)[block] + idx, pos, offs


@dataclass
class Received:
    """The received rows' labels as the dispatch has them before its host sync (device tensors).
    recv_src, recv_expert, recv_dst_index [B] int64: rows [0, R) as in Dispatched, rows past R
    -1; B >= R (on a GPU B = LayerDispatch.bound, one size every step until a step receives
    more; on the CPU B = R)."""

    recv_src: torch.Tensor
    recv_expert: torch.Tensor
    recv_dst_index: torch.Tensor
    n_rows: torch.Tensor  # [1] int64: R
    send_counts: torch.Tensor  # [W] int64: rows this rank sends to each destination


@dataclass
class Dispatched:
    """One forward's dispatch on one rank (device tensors unless noted; S = T*k)."""

    x_recv: torch.Tensor  # [R, H] received rows (source, local expert, token order)
    send_order: torch.Tensor  # [S] pair index t*k+j of each send row
    pos: torch.Tensor  # [T, k] send row of (token t, slot j): the scale's gather index
    send_counts: torch.Tensor  # [W] rows this rank sends to each destination
    recv_counts: torch.Tensor  # [W, E] rows from source s for local expert e
    recv_expert: torch.Tensor  # [R] local expert of each received row
    recv_src: torch.Tensor  # [R] source rank of each received row
    recv_dst_index: torch.Tensor  # [R] position in the source's combine receive buffer
    #: [R] row's position with the rows grouped by local expert (expert, then source); None
    #: where the received order already is (W=1 or E=1)
    expert_pos: torch.Tensor | None
    offs: torch.Tensor  # [E] int32 cumulative rows per local expert (torch._grouped_mm's offs)
    send_splits: list[int]  # host [W]
    recv_splits: list[int]  # host [W]
    expert_rows: list[int]  # host [E]: rows per local expert
    received: Received | None = None  # the labels before the host sync, at their bound
    #: (harness/dispatch_device.py only) the played ranks' tokens stacked [W*T, H] and each
    #: received row's row of them [bound]; x_recv is None where the caller gathers (gather=False)
    tokens: torch.Tensor | None = None
    token_rows: torch.Tensor | None = None


def _dispatched(
    x_recv, send, send_counts, recv_counts, labels, received, host=(None,) * 3, **extra
):
    """A Dispatched from send = (order [S], pos [T, k]), labels = recv_rows' (src, expert,
    dst_index, expert_pos, offs) and host = (send_splits, recv_splits, expert_rows)."""
    src, expert, dst, expert_pos, offs = labels
    return Dispatched(
        x_recv=x_recv,
        send_order=send[0],
        pos=send[1],
        send_counts=send_counts,
        recv_counts=recv_counts,
        recv_expert=expert,
        recv_src=src,
        recv_dst_index=dst,
        expert_pos=expert_pos,
        offs=offs,
        send_splits=host[0],
        recv_splits=host[1],
        expert_rows=host[2],
        received=received,
        **extra,
    )


def host_free(x_recv, send, sizes, recv_counts, labels, world_size, experts, **extra):
    """The Dispatched of a dispatch with no host sync (harness/dispatch_device.py,
    harness/dispatch_peer.py): sizes the split sizes on the device [2W + E + 1], labels at the
    bound, no host lists (else as _dispatched). extra: tokens, token_rows."""
    W, E = world_size, experts
    received = Received(*labels[:3], sizes[2 * W + E :], sizes[:W])
    return _dispatched(x_recv, send, sizes[:W], recv_counts, labels, received, **extra)


class LayerDispatch:
    """dispatch(x [T, H], expert_ids [T, k]) -> Dispatched, over `group` (W ranks, E local
    experts each).

    before_sync(Received), if given, gets the received rows' labels as soon as they exist: on a
    GPU before the host sync, so device work it enqueues (a plan built from them) is off the
    step's critical path; on the CPU after it. A step that receives more than `bound` rows calls
    it again after the sync, at the grown bound (the earlier call's work is void).

    bound: rows the labels are sized for before the sync (None: min(W*T*k, HEADROOM*T*k) on the
    first call, so buffers sized from it do not grow with W); it only grows, to max(R, min(2 *
    bound, W*T*k)), when a step receives R > bound (counted in `regrown`). device_labels: tests
    set it (and bound) to take the GPU path, Triton kernels and labels before the sync, on the
    CPU (the interpreter).
    """

    #: the first bound is this many times the average rows a rank receives (T*k)
    HEADROOM = 2

    def __init__(self, world_size: int, experts_per_rank: int, group=None) -> None:
        self.W, self.E, self.group = world_size, experts_per_rank, group
        self.bound: int | None = None
        self.device_labels = False
        self.regrown = 0  # steps that received more rows than the bound

    def __call__(
        self,
        x: torch.Tensor,
        expert_ids: torch.Tensor,
        before_sync: Callable[[Received], object] | None = None,
    ) -> Dispatched:
        W, E = self.W, self.E
        T, k = expert_ids.shape
        on_device = x.device.type == "cuda" or self.device_labels
        if on_device:  # a few launches (harness/kernels/dispatch.py)
            from harness.kernels.dispatch import recv_rows, sort_meta, split_sizes
        else:
            sort_meta, split_sizes, recv_rows = sort_meta_torch, split_sizes_torch, recv_rows_torch
        send_order, pos, token, meta = sort_meta(expert_ids, W, E, k)  # [S] x3, [W, 2E]
        if W > 1:
            got = torch.empty_like(meta)
            dist.all_to_all_single(got, meta, group=self.group)
        else:
            got = meta  # read only from here on
        recv_counts = got.view(W, E, 2)[..., 0]  # [W, E]
        recv_off = got.view(W, E, 2)[..., 1]  # [W, E] offset in the source's send order
        sizes = split_sizes(meta, got, W, E)
        send_counts, n_rows = sizes[:W], sizes[2 * W + E :]
        epos = W > 1 and E > 1

        def label(rows: int):
            """The labels at `rows` rows (a bound, or R), handed to before_sync."""
            out = recv_rows(recv_counts, recv_off, rows, epos)
            received = Received(*out[:3], n_rows, send_counts)
            if before_sync is not None:
                before_sync(received)
            return out, received

        labels = None
        x_send = x.index_select(0, token) if W > 1 else None  # needs no split size either
        if on_device:  # before the sync, at the bound
            if self.bound is None:
                self.bound = min(W * T * k, self.HEADROOM * T * k)
            bound = self.bound
            labels, received = label(bound)
        host = sizes.tolist()  # THE host synchronisation (split sizes)
        send_splits, recv_splits = host[:W], host[W : 2 * W]
        expert_rows, R = host[2 * W : 2 * W + E], host[-1]
        if labels is not None and R > bound:  # more rows than the bound: label them again
            self.bound = max(R, min(2 * bound, W * T * k))
            self.regrown += 1
            labels, received = label(self.bound)
        x_recv = x.new_empty(R, x.shape[1])
        if W > 1:
            dist.all_to_all_single(x_recv, x_send, recv_splits, send_splits, group=self.group)
        else:  # every row stays: gathered straight into the receive buffer
            torch.index_select(x, 0, token, out=x_recv)
        if labels is None:  # the torch path needs R on the host
            labels, received = label(R)
        if labels[0].numel() != R:  # the rows of this step
            labels = [None if t is None else t[:R] for t in labels[:4]] + [labels[4]]
        lists = (send_splits, recv_splits, expert_rows)
        send = (send_order, pos.view(T, k))
        return _dispatched(x_recv, send, send_counts, recv_counts, labels, received, lists)


def to_expert_order(d: Dispatched, rows: torch.Tensor) -> torch.Tensor:
    """Received rows [R, *] -> grouped by local expert (a no-op where they already are)."""
    if d.expert_pos is None:
        return rows
    return torch.empty_like(rows).index_copy_(0, d.expert_pos, rows)


def from_expert_order(d: Dispatched, rows: torch.Tensor) -> torch.Tensor:
    """Rows grouped by local expert [R, *] -> the received order (the combine's send order)."""
    return rows if d.expert_pos is None else rows.index_select(0, d.expert_pos)


def redispatch(d: Dispatched, x: torch.Tensor, top_k: int, group=None) -> torch.Tensor:
    """The dispatch's row exchange alone, with a held dispatch's splits (a comm bound):
    x [T, H] -> rows [R, H] in the received order."""
    x_send = x.index_select(0, d.send_order // top_k)
    if d.send_splits is None or len(d.send_splits) == 1:  # W=1: every row stays
        return x_send
    recv = torch.empty_like(d.x_recv)
    dist.all_to_all_single(recv, x_send, d.recv_splits, d.send_splits, group=group)
    return recv


def combine(d: Dispatched, y_recv: torch.Tensor, group=None) -> torch.Tensor:
    """y_recv [R, N] in the received order -> y_back [S, N] in this rank's send order."""
    if d.send_splits is None:  # a host-free dispatch (harness/dispatch_device.py)
        if d.send_counts.numel() != 1:
            raise ValueError("combine: a host-free dispatch at W > 1 has no NCCL combine")
        return y_recv  # W=1: the received order is the send order
    back = y_recv.new_empty(sum(d.send_splits), y_recv.shape[1])
    if len(d.send_splits) > 1:
        dist.all_to_all_single(back, y_recv, d.send_splits, d.recv_splits, group=group)
    else:
        back.copy_(y_recv)
    return back
