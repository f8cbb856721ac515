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


def busy_union(intervals: list[tuple[float, float]]) -> float:
    """Total length covered by [start, end) intervals (any order, overlaps counted once)."""
    total, end = 0.0, float("-inf")
    for s, e in sorted(intervals):
        if e <= end:
            continue
        total += e - max(s, end)
        end = e
    return total


def idle_gaps(kernels: list[tuple[float, float, str]], top: int = 6) -> dict:
    """Device idle time of a kernel timeline [(start_us, end_us, name)] (every stream):
    span (first start to last end), busy (union of the kernels), idle = span - busy, and the
    `top` longest gaps as (us, kernel before, kernel after)."""
    if not kernels:
        return {"span_us": 0.0, "busy_us": 0.0, "idle_us": 0.0, "gaps": []}
    ks = sorted(kernels)
    span = max(e for _, e, _ in ks) - ks[0][0]
    busy = busy_union([(s, e) for s, e, _ in ks])
    gaps, end, before = [], ks[0][1], ks[0][2]
    for s, e, name in ks[1:]:
        if s > end:
            gaps.append((s - end, before, name))
        if e > end:
            end, before = e, name
    gaps.sort(reverse=True)
    return {"span_us": span, "busy_us": busy, "idle_us": span - busy, "gaps": gaps[:top]}


def device_idle(step: Callable[[], object], reps: int, warmup: int = 3, top: int = 6) -> dict:
    """idle_gaps over `reps` back-to-back steps (torch.profiler, device activity only), per
    step: span_us, busy_us, idle_us divided by reps; gaps are the longest single gaps."""
    from torch.autograd import DeviceType

    for _ in range(warmup):
        step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            step()
        torch.cuda.synchronize()
    ks = [
        (e.time_range.start, e.time_range.end, e.name)
        for e in prof.events()
        if e.device_type == DeviceType.CUDA and e.time_range.end > e.time_range.start
    ]
    out = idle_gaps(ks, top)
    for k in ("span_us", "busy_us", "idle_us"):
        out[k] /= reps
    return out
