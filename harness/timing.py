"""The one timing primitive.

GPU: a CUDA event pair around every iteration on the current stream (after a barrier and warm-up).
CPU: a host clock around every iteration, each iteration started after a barrier.
Each rank's per-iteration times are reduced with MAX over ranks (the slowest rank sets the
layer's latency), then summarised as median, p10 and p90 in milliseconds.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist

#: bootstrap resamples of the median's 95% interval (seeded: the same times give the same interval)
BOOTSTRAP = 1000


@dataclass(frozen=True)
class Timing:
    median_ms: float
    p10_ms: float
    p90_ms: float
    iters: int
    #: 95% bootstrap interval of the median (percentile method, BOOTSTRAP resamples)
    ci_lo_ms: float = float("nan")
    ci_hi_ms: float = float("nan")
    #: the per-iteration times (ms, MAX over ranks) behind the summary
    samples: tuple[float, ...] = ()


def summarize(ms: list[float] | tuple[float, ...]) -> Timing:
    """Median, p10, p90 and the median's bootstrap interval of per-iteration times (ms)."""
    t = torch.tensor(list(ms), dtype=torch.float64)
    q = torch.quantile(t, torch.tensor([0.5, 0.1, 0.9], dtype=torch.float64))
    lo, hi = median_interval(t)
    return Timing(float(q[0]), float(q[1]), float(q[2]), len(ms), lo, hi, tuple(ms))


def median_interval(ms: torch.Tensor, level: float = 0.95) -> tuple[float, float]:
    """95% bootstrap interval of the median of per-iteration times ms [n] (float64, CPU)."""
    n = ms.numel()
    if n < 2:
        return float("nan"), float("nan")
    gen = torch.Generator().manual_seed(0)
    idx = torch.randint(0, n, (BOOTSTRAP, n), generator=gen)
    medians = ms[idx].quantile(0.5, dim=1)
    a = (1 - level) / 2
    lo, hi = medians.quantile(torch.tensor([a, 1 - a], dtype=torch.float64))
    return float(lo), float(hi)


def barrier(group: dist.ProcessGroup | None, device: torch.device) -> None:
    """A barrier that also works for NCCL groups (an all-reduce of one element)."""
    if dist.is_available() and dist.is_initialized():
        t = torch.zeros(1, device=device)
        dist.all_reduce(t, group=group)
        if device.type == "cuda":
            torch.cuda.synchronize(device)


def time_fn(
    fn: Callable[[], object],
    *,
    device: torch.device,
    group: dist.ProcessGroup | None = None,
    warmup: int = 3,
    iters: int = 10,
) -> Timing:
    """Time fn() over `iters` iterations after `warmup` ones; max over ranks, then quantiles."""
    if iters < 1:
        raise ValueError("iters must be >= 1")
    for _ in range(warmup):
        fn()
    barrier(group, device)
    if device.type == "cuda":
        starts = [torch.cuda.Event(enable_timing=True) for _ in range(iters)]
        ends = [torch.cuda.Event(enable_timing=True) for _ in range(iters)]
        for s, e in zip(starts, ends):
            s.record()
            fn()
            e.record()
        torch.cuda.synchronize(device)
        ms = [s.elapsed_time(e) for s, e in zip(starts, ends)]
    else:
        ms = []
        for _ in range(iters):
            barrier(group, device)
            t0 = time.perf_counter()
            fn()
            ms.append((time.perf_counter() - t0) * 1e3)
    t = torch.tensor(ms, dtype=torch.float64, device=device)
    if dist.is_available() and dist.is_initialized():
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return summarize(t.cpu().tolist())
