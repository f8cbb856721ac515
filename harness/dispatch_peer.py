"""The host-free dispatch and combine with one process per rank; protocol and safety argument:
docs/method.md, "The host-free dispatch across processes". Address tables: systems/overlap/
transport.py peer_transport; device code: harness/kernels/peer.py.
  PeerDispatch  two count slots suffice: a fast source may publish step n+1 while a slow
                destination still reads step n, never n+2 (step n+1 waits for it).
  PeerCombine   the owner's counter per source is cumulative: it waits until each holds every
                row it sent so far.
"""

from __future__ import annotations

import torch

from harness import dispatch as ld


def transport_here(device: torch.device) -> str:
    """The transport of a system with no transport knob (serial): shm on the CPU; on a GPU
    nvshmem where this process's symmetric memory already is NVSHMEM's (torch keeps one backend
    a process), else p2p."""
    if device.type != "cuda":
        return "shm"
    import torch.distributed._symmetric_memory as symm_mem

    try:
        return "nvshmem" if symm_mem.get_backend(device) == "NVSHMEM" else "p2p"
    except Exception:  # noqa: BLE001 - no backend chosen yet (or an older torch)
        return "p2p"


class _Waits:
    """Base of the peer exchanges: their bounded device waits, with err [8] int64 (errors.py),
    the clock and the consumer's time-out."""

    def __init__(self, device: torch.device, rank: int) -> None:
        from systems.overlap import errors
        from systems.overlap.tuning import ConsumerConfig

        self.err, self.clock = errors.new_error_buffer(device), errors.new_clock(1, device)
        self.config = ConsumerConfig(use_timer=device.type == "cuda")
        self.rank = rank

    def until(self, signal: torch.Tensor, expected: torch.Tensor) -> None:
        """Block the stream until signal[s] >= expected[s] for every source s ([W] int64)."""
        from systems.overlap.kernels.consumer import launch_wait_signals

        args = (signal, expected, self.err, self.clock)
        launch_wait_signals(*args, rank=self.rank, config=self.config, scope="sys")

    def check(self) -> None:
        """Raise where a wait for a peer timed out (reads the device)."""
        from systems.overlap.errors import raise_if_error

        raise_if_error(self.err)


class PeerDispatch(_Waits):
    """dispatch(x [T, H], expert_ids [T, k]) -> harness.dispatch.Dispatched over `group` (W
    ranks, E local experts each), T <= tokens (or x [T*k, H], a row per pair: row t*k+j goes to
    expert_ids[t, j], the combine's adjoint): x_recv [W*T*k, H] with labels at that bound
    (rows past n_rows are junk, labels -1, expert_pos the identity), no host lists. transport:
    p2p, nvshmem or shm. Collective: every rank builds it and calls it in lockstep."""

    def __init__(self, world_size, experts_per_rank, tokens, top_k, like, group, transport):
        import torch.distributed as dist

        from systems.overlap.transport import peer_transport

        W, E, H, dev = world_size, experts_per_rank, like.shape[1], like.device
        self.W, self.E, self.T, self.k, self.group = W, E, tokens, top_k, group
        self.rank, self.bound = dist.get_rank(group), W * tokens * top_k
        # bytes a rank holds: the received rows (W*T*k), its own rows in send order and the
        # combine's receive region (T*k each)
        need = (W + 2) * tokens * top_k * H * like.element_size()
        if like.is_cuda and need > torch.cuda.mem_get_info(dev)[0]:
            raise ValueError(
                f"dispatch: W={W} x T*k={tokens * top_k} rows x H={H} need {need / 2**30:.1f} "
                "GiB a rank, more than the GPU has free"
            )
        self.recv_mib = need / 2**20
        self.counts = peer_transport(transport, group, 2 * W, 2 * E, torch.int64, dev)
        self.rows = peer_transport(transport, group, tokens * top_k, H, like.dtype, dev)
        self.x_recv = like.new_empty(self.bound, H)
        self.steps = torch.zeros(1, dtype=torch.int64, device=dev)  # steps published so far
        self.slot = torch.zeros(1, dtype=torch.int64, device=dev)
        self.expected = torch.zeros(W, dtype=torch.int64, device=dev)
        self.identity = torch.arange(self.bound, device=dev)
        super().__init__(dev, self.rank)

    def __call__(self, x: torch.Tensor, expert_ids: torch.Tensor) -> ld.Dispatched:
        from harness.kernels import peer
        from harness.kernels.dispatch import recv_rows, sort_meta, split_sizes

        W, E, k = self.W, self.E, self.k
        T = expert_ids.shape[0]
        if T > self.T:
            raise ValueError(f"dispatch: {T} tokens a rank, sized for at most {self.T}")
        if not x.is_cuda:  # torch's sort: no host read either, 100x faster than interpreted
            sort_meta, split_sizes = ld.sort_meta_torch, ld.split_sizes_torch
        order, pos, token, meta = sort_meta(expert_ids, W, E, k)  # [S] x3, [W, 2E]
        rows = token if x.shape[0] == T else order  # a row per token, or per pair
        torch.index_select(x, 0, rows, out=self.rows.recv[: T * k])  # rows in send order
        torch.remainder(self.steps, 2, out=self.slot)
        peer.publish(meta, self.slot, self.counts.recv_ptrs, self.counts.signal_ptrs, self.rank)
        self.steps.add_(1)
        self.until(self.counts.signal, self.expected.copy_(self.steps.expand(W)))
        got = self.counts.recv.view(2, W, 2 * E).index_select(0, self.slot)[0]  # [W_src, 2E]
        counts, off = got.view(W, E, 2)[..., 0], got.view(W, E, 2)[..., 1]
        sizes = split_sizes(meta, got, W, E)
        src, expert, dst, epos, offs = recv_rows(counts, off, self.bound, W > 1 and E > 1)
        peer.gather(self.x_recv, src, dst, sizes[2 * W + E :], self.rows.recv_ptrs)
        if epos is not None:  # the junk rows past n_rows stay where they are
            epos = torch.where(epos < 0, self.identity, epos)
        labels = (src, expert, dst, epos, offs)
        return ld.host_free(self.x_recv, (order, pos.view(T, k)), sizes, counts, labels, W, E)


class PeerCombine(_Waits):
    """combine(d, y [B, H] in d's received order) -> [T*k, H]: this rank's rows back from the
    experts' ranks, in its send order (a view of its receive region, rows past d's T*k junk).
    Collective like PeerDispatch."""

    def __init__(self, world_size, tokens, top_k, like, group, transport) -> None:
        from systems.overlap.transport import peer_transport

        H, dev = like.shape[1], like.device
        self.recv = peer_transport(transport, group, tokens * top_k, H, like.dtype, dev)
        self.expected = torch.zeros(world_size, dtype=torch.int64, device=dev)
        super().__init__(dev, self.recv.rank)

    def __call__(self, d: ld.Dispatched, y: torch.Tensor) -> torch.Tensor:
        from harness.kernels import peer

        t = self.recv
        n = d.received.n_rows
        peer.put(y, d.recv_src, d.recv_dst_index, n, t.recv_ptrs, t.signal_ptrs, t.rank)
        self.until(t.signal, self.expected.add_(d.send_counts))
        return t.recv
