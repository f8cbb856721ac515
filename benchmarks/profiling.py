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


def idle_gaps(kernels: list[tuple[float, float, str]], top: int = 8) -> dict:
    """Device idle time of one step's kernel timeline [(start_us, end_us, name)] (every
    stream): span (first start to last end), busy (union of the kernels), idle = span - busy,
    and `gaps`: {kernel name: idle us just before it}, longest first (the `top` longest)."""
    if not kernels:
        return {"span_us": 0.0, "busy_us": 0.0, "idle_us": 0.0, "gaps": {}}
    ks = sorted(kernels)
    span = max(e for _, e, _ in ks) - ks[0][0]
    busy = busy_union([(s, e) for s, e, _ in ks])
    gaps: dict[str, float] = {}
    end = ks[0][1]
    for s, e, name in ks[1:]:
        if s > end:
            gaps[name] = gaps.get(name, 0.0) + s - end
        end = max(end, e)
    top_gaps = dict(sorted(gaps.items(), key=lambda kv: -kv[1])[:top])
    return {"span_us": span, "busy_us": busy, "idle_us": span - busy, "gaps": top_gaps}


#: torch.cuda._sleep's kernel (demangled "at::cuda::(anonymous namespace)::spin_kernel(long)"):
#: the step boundaries of device_idle
MARKER = "spin_kernel"


def split_steps(kernels: list[tuple[float, float, str]]) -> list[list[tuple[float, float, str]]]:
    """One list per step: its MARKER kernel, the kernels up to the next marker, and that next
    marker renamed "(next step)" (so the host's time between steps counts as idle there);
    kernels before the first marker and after the last are dropped."""
    steps: list[list] = []
    for k in sorted(kernels):
        if MARKER in k[2]:
            if steps:
                steps[-1].append((k[0], k[1], "(next step)"))
            steps.append([k])
        elif steps:
            steps[-1].append(k)
    return steps[:-1]


def marked_kernels(
    step: Callable[[], object], calls: int, warmup: int = 3
) -> list[tuple[float, float, str]]:
    """Every device kernel [(start_us, end_us, name)] of `calls` back-to-back calls of `step`
    under torch.profiler, each behind a 1-cycle MARKER kernel (split_steps cuts them), after
    `warmup` unprofiled calls."""
    from torch.autograd import DeviceType

    def marked():
        torch.cuda._sleep(1)
        step()

    for _ in range(warmup):
        marked()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            marked()
        torch.cuda.synchronize()
    return [
        (e.time_range.start, e.time_range.end, e.name)
        for e in prof.events()
        if e.device_type == DeviceType.CUDA
    ]


def device_idle(step: Callable[[], object], reps: int, warmup: int = 3, top: int = 8) -> dict:
    """idle_gaps of `reps` back-to-back steps (torch.profiler, device activity only; a 1-cycle
    marker kernel starts each step): the median step's span_us, busy_us, idle_us, and gaps
    summed over the steps and divided by reps (us per step before each kernel name)."""
    ks = marked_kernels(step, reps + 1, warmup)  # the last marker closes the last step
    per = [idle_gaps(k, top=10**6) for k in split_steps(ks)[1:]]  # the 1st: profiler start
    if not per:
        names = sorted({k[2][:80] for k in ks})[:12]
        raise RuntimeError(f"device_idle: no {MARKER} step markers among the kernels {names}")
    mid = sorted(per, key=lambda r: r["idle_us"])[len(per) // 2]
    gaps: dict[str, float] = {}
    for r in per:
        for name, us in r["gaps"].items():
            gaps[name] = gaps.get(name, 0.0) + us / len(per)
    out = {k: mid[k] for k in ("span_us", "busy_us", "idle_us")}
    out["gaps"] = dict(sorted(gaps.items(), key=lambda kv: -kv[1])[:top])
    out["steps"] = len(per)
    return out
