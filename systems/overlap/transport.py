"""Transports of the combine (the kinds: docs/method.md, Stage B, Transports).

One interface (Transport) drives the SAME consumer kernel (kernels/consumer.py) through two [W]
int64 address tables: recv (row 0 of d's combine receive buffer [rows, N]) and signal (d's
receive counters [W] int64, one per source). The consumer writes a band's valid rows at recv[d] +
band_offset * N and, once per segment, adds the segment's rows to signal[d][rank] (release).
Receiver d has all of source s's rows of run r (1-based) when its counter s reaches
r * rows_from_s (epoch values: never reset). Loopback (LoopbackFabric): regions of one buffer,
counters [W, W], scope "gpu"; peer memory: scope "sys". Every peer is load/store reachable
(NVLink or one GPU): the consumer stores, no NVSHMEM put (docs/measurements.md, Retired variants).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field

import torch


@dataclass
class Transport:
    """How this rank's consumer reaches every destination.

    recv        [rows, N]  this rank's combine receive buffer (what the others write into)
    signal      [W] int64  this rank's receive counters, one per source rank
    recv_ptrs   [W] int64  directly writable address of each destination's receive buffer
    signal_ptrs [W] int64  directly writable address of each destination's counters
    scope       "gpu" (loopback) or "sys" (peer memory): scope of the release atomics
    aligned     every table address is 16-byte aligned (known on the host: no table read-back)
    """

    rank: int
    world: int
    recv: torch.Tensor
    signal: torch.Tensor
    recv_ptrs: torch.Tensor
    signal_ptrs: torch.Tensor
    scope: str = "gpu"
    aligned: bool = True
    keep: list = field(default_factory=list)  # owners of the memory (tensors, handles)


def _ptr_table(ptrs: list[int], device: torch.device) -> torch.Tensor:
    return torch.tensor(ptrs, dtype=torch.int64, device=device)


def _aligned(ptrs: list[int]) -> bool:
    return all(p % 16 == 0 for p in ptrs)


class LoopbackFabric:
    """W simulated ranks on one device: one receive buffer with per-destination regions.
    recv_rows [W]: rows of each destination's combine receive buffer (T * top_k of that rank);
    recv(d) is d's buffer [recv_rows[d], N]; counters [W, W] (destination, source)."""

    def __init__(
        self,
        recv_rows: list[int],
        n: int,
        dtype: torch.dtype,
        device: torch.device | str,
    ) -> None:
        self.world = len(recv_rows)
        self.starts = starts = [0, *itertools.accumulate(int(r) for r in recv_rows)]
        self.buffer = torch.zeros(max(starts[-1], 1), n, dtype=dtype, device=device)
        self.counters = torch.zeros(self.world, self.world, dtype=torch.int64, device=device)
        dev = self.buffer.device
        row_bytes = n * self.buffer.element_size()
        recv = [self.buffer.data_ptr() + s * row_bytes for s in starts[:-1]]
        self.aligned = _aligned(recv)
        self.recv_ptrs = _ptr_table(recv, dev)
        self.signal_ptrs = _ptr_table([self.counters[d].data_ptr() for d in range(self.world)], dev)

    def recv(self, d: int) -> torch.Tensor:
        """Destination d's combine receive buffer [recv_rows[d], N] (a view)."""
        return self.buffer[self.starts[d] : self.starts[d + 1]]

    def transport(self, rank: int) -> Transport:
        return Transport(
            rank=rank,
            world=self.world,
            recv=self.recv(rank),
            signal=self.counters[rank],
            recv_ptrs=self.recv_ptrs,
            signal_ptrs=self.signal_ptrs,
            scope="gpu",
            aligned=self.aligned,
            keep=[self],
        )


def _symm_backend(name: str, device: torch.device) -> None:
    import torch.distributed._symmetric_memory as symm_mem

    try:
        current = symm_mem.get_backend(device)
    except Exception:  # noqa: BLE001 - older torch: no get_backend
        current = None
    if current != name:
        symm_mem.set_backend(name)


#: the torch symmetric-memory backend of each transport between GPU processes
_BACKENDS = {"p2p": "CUDA", "nvshmem": "NVSHMEM"}


def _symmetric_transport(
    name: str, group, recv_rows: int, n: int, dtype: torch.dtype, device: torch.device
) -> Transport:
    import torch.distributed as dist
    import torch.distributed._symmetric_memory as symm_mem

    world = dist.get_world_size(group)
    rank = dist.get_rank(group)
    if world < 2:
        raise ValueError(f"{name} transport needs >= 2 processes (symm_mem.rendezvous refuses 1)")
    rows = torch.tensor([max(int(recv_rows), 1)], device=device)
    dist.all_reduce(rows, op=dist.ReduceOp.MAX, group=group)
    rows_max = int(rows.item())
    _symm_backend(_BACKENDS[name], device)
    buf = symm_mem.empty(rows_max * n, dtype=dtype, device=device)
    sig = symm_mem.empty(world, dtype=torch.int64, device=device)
    buf.zero_()
    sig.zero_()
    torch.cuda.synchronize(device)
    group_name = group.group_name if group is not None else dist.group.WORLD.group_name
    h_buf = symm_mem.rendezvous(buf, group_name)
    h_sig = symm_mem.rendezvous(sig, group_name)
    recv_ptrs = [h_buf.get_buffer(p, [rows_max * n], dtype).data_ptr() for p in range(world)]
    signal_ptrs = [h_sig.get_buffer(p, [world], torch.int64).data_ptr() for p in range(world)]
    dist.barrier(group=group)
    return Transport(
        rank=rank,
        world=world,
        recv=buf.view(rows_max, n)[:recv_rows],
        signal=sig,
        recv_ptrs=_ptr_table(recv_ptrs, device),
        signal_ptrs=_ptr_table(signal_ptrs, device),
        scope="sys",
        aligned=_aligned(recv_ptrs),
        keep=[buf, sig, h_buf, h_sig],
    )


def p2p_transport(
    group, recv_rows: int, n: int, dtype: torch.dtype, device: torch.device
) -> Transport:
    """Peer-pointer transport over torch symmetric memory (CUDA backend), W >= 2 processes.
    recv_rows: rows of THIS rank's combine receive buffer (T * top_k); every rank allocates the
    maximum over ranks (symmetric allocations have one size). Collective over `group`."""
    return _symmetric_transport("p2p", group, recv_rows, n, dtype, device)


def nvshmem_transport(
    group, recv_rows: int, n: int, dtype: torch.dtype, device: torch.device
) -> Transport:
    """NVSHMEM-backed symmetric memory transport, W >= 2 processes (collective over `group`):
    stores through the peers' heap addresses."""
    return _symmetric_transport("nvshmem", group, recv_rows, n, dtype, device)


def peer_transport(
    name: str, group, recv_rows: int, n: int, dtype: torch.dtype, device: torch.device
) -> Transport:
    """This rank's transport to its peers in `group`: p2p or nvshmem (GPUs) or shm (CPU
    processes); a receive buffer [recv_rows, n]. Collective over `group`."""
    if name == "shm":
        from systems.overlap.shm import shm_transport

        return shm_transport(group, recv_rows, n, dtype)
    if name not in _BACKENDS:
        raise ValueError(f"{name}: not a transport between processes (p2p, nvshmem, shm)")
    return _symmetric_transport(name, group, recv_rows, n, dtype, device)
