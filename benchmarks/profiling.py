"""Kernel times of a step from torch.profiler: the loop the profile_* benchmarks share."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch.profiler import ProfilerActivity, profile


def kernel_times(step: Callable[[], object], reps: int, warmup: int = 3) -> list[dict]:
    """[{kernel, calls, us}] per device kernel of `step`: calls and microseconds per step,
    averaged over `reps` profiled steps after `warmup` unprofiled ones."""
    for _ in range(warmup):
        step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            step()
        torch.cuda.synchronize()
    rows = []
    for e in prof.key_averages():
        us = getattr(e, "device_time_total", getattr(e, "cuda_time_total", 0))
        if us > 0:
            rows.append({"kernel": e.key, "calls": e.count / reps, "us": us / reps})
    return rows
