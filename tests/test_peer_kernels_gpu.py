"""harness/kernels/peer.py on one GPU, the peers played by regions of local buffers (what a
p2p table holds on several GPUs are peer pointers): publish, gather and put do what
harness/dispatch_peer.py relies on, and a gather replays in a CUDA graph. The processes
themselves: tests/test_peer_dispatch.py (CPU, shm) and tests/test_multigpu_gpu.py (2+ GPUs)."""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.gpu

W, S, H = 3, 24, 96  # ranks, rows a source region holds, row width (not a power of 2)


def _table(t: torch.Tensor) -> torch.Tensor:
    """[W] int64: the address of t[d] for every played rank d."""
    return torch.tensor([t[d].data_ptr() for d in range(W)], device=t.device)


def test_gather_put_publish_through_address_tables():
    from harness.kernels import peer

    dev = torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(0)
    regions = torch.randn(W, S, H, device=dev, generator=g).bfloat16()
    B, n = 40, 37
    src = torch.randint(0, W, (B,), device=dev, generator=g)
    rows = torch.randint(0, S, (B,), device=dev, generator=g)
    n_rows = torch.tensor([n], device=dev)
    out = torch.full((B, H), float("nan"), device=dev, dtype=torch.bfloat16)
    peer.gather(out, src, rows, n_rows, _table(regions))
    assert torch.equal(out[:n], regions[src[:n], rows[:n]]) and out[n:].isnan().all()

    owners = torch.zeros(W, S, H, device=dev, dtype=torch.bfloat16)
    signal = torch.zeros(W, W, dtype=torch.int64, device=dev)
    pairs = torch.randperm(W * S, device=dev, generator=g)[:B]  # distinct (owner, row)
    dst, at = pairs // S, pairs % S
    y = torch.randn(B, H, device=dev, generator=g).bfloat16()
    peer.put(y, dst, at, n_rows, _table(owners), _table(signal), 1)
    assert torch.equal(owners[dst[:n], at[:n]], y[:n])
    assert torch.equal(signal[:, 1], torch.bincount(dst[:n], minlength=W))
    assert not signal[:, [0, 2]].any()

    C = 2 * 4
    counts = torch.arange(W * C, device=dev).view(W, C)
    region = torch.zeros(W, 2 * W, C, dtype=torch.int64, device=dev)
    slot = torch.ones(1, dtype=torch.int64, device=dev)
    peer.publish(counts, slot, _table(region), _table(signal), 2)
    assert torch.equal(region[:, W + 2], counts) and (signal[:, 2] == 1).all()
    assert region.sum() == counts.sum()


def test_a_gather_replays_in_a_cuda_graph():
    from harness.kernels import peer

    dev = torch.device("cuda")
    regions = torch.zeros(W, S, H, device=dev)
    src = torch.arange(S, device=dev) % W
    rows = torch.arange(S, device=dev)
    n_rows = torch.tensor([S], device=dev)
    out, table = torch.empty(S, H, device=dev), _table(regions)
    peer.gather(out, src, rows, n_rows, table)  # compiled before the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        peer.gather(out, src, rows, n_rows, table)
    regions.copy_(torch.randn_like(regions))
    n_rows.fill_(S - 5)  # a smaller step: no recapture
    out.fill_(-1.0)
    graph.replay()
    assert torch.equal(out[: S - 5], regions[src, rows][: S - 5]) and (out[S - 5 :] == -1).all()
