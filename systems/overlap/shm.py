"""`shm`: the combine's transport between CPU processes (docs/method.md, Transports).

The file is torch.from_file(shared=True) on /dev/shm. One writer per counter slot (a source writes
only its own), so the interpreter's non-atomic read-modify-write is race-free; x86 keeps stores in
order, so a reader that sees a counter sees the rows before it. gloo carries control (the file's
name, barriers). File layout, W ranks, R rows of N elements: W receive regions [R, N] then W
counter rows [W] int64, each region padded to 64 bytes.
"""

from __future__ import annotations

import os
import uuid

import torch

from systems.overlap.transport import Transport

#: where the shared files live (a tmpfs on Linux)
SHM_DIR = "/dev/shm" if os.path.isdir("/dev/shm") else None


def _pad64(n: int) -> int:
    return -(-n // 64) * 64


def _shared_file(group, nbytes: int) -> torch.Tensor:
    """uint8 [nbytes] mapped by every rank of `group` from one file (removed once all mapped)."""
    import tempfile

    import torch.distributed as dist

    name = [None]
    if dist.get_rank(group) == 0:
        folder = SHM_DIR or tempfile.gettempdir()
        name[0] = os.path.join(folder, f"moe_overlap_shm_{uuid.uuid4().hex}")
        with open(name[0], "wb") as f:
            f.truncate(nbytes)
    dist.broadcast_object_list(name, src=dist.get_global_rank(group, 0), group=group)
    mem = torch.from_file(name[0], shared=True, size=nbytes, dtype=torch.uint8)
    dist.barrier(group=group)
    if dist.get_rank(group) == 0:
        os.unlink(name[0])  # the mappings stay; nothing is left behind on any exit
    return mem


def shm_transport(group, recv_rows: int, n: int, dtype: torch.dtype) -> Transport:
    """This rank's shm transport: a receive buffer [recv_rows, N] and counters [W] int64 in a
    file every rank of `group` maps (every rank sizes its buffer at the maximum over ranks).
    Collective over `group`."""
    import torch.distributed as dist

    world, rank = dist.get_world_size(group), dist.get_rank(group)
    rows = torch.tensor([max(int(recv_rows), 1)])
    dist.all_reduce(rows, op=dist.ReduceOp.MAX, group=group)
    esize = torch.empty(0, dtype=dtype).element_size()
    region, sig_region = _pad64(int(rows) * n * esize), _pad64(world * 8)
    mem = _shared_file(group, world * (region + sig_region))
    base = mem.data_ptr()
    recv_ptrs = [base + d * region for d in range(world)]
    signal_ptrs = [base + world * region + d * sig_region for d in range(world)]
    own = mem[rank * region : (rank + 1) * region].view(dtype)[: int(rows) * n]
    recv = own.view(-1, n)
    start = world * region + rank * sig_region
    signal = mem[start : start + world * 8].view(torch.int64)
    recv.zero_()
    signal.zero_()
    dist.barrier(group=group)  # every rank's region is zero before anyone puts
    return Transport(
        rank=rank,
        world=world,
        recv=recv[:recv_rows],
        signal=signal,
        recv_ptrs=torch.tensor(recv_ptrs, dtype=torch.int64),
        signal_ptrs=torch.tensor(signal_ptrs, dtype=torch.int64),
        scope="sys",
        aligned=all(p % 16 == 0 for p in recv_ptrs),
        keep=[mem],
    )
