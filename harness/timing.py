"""The one timing primitive (time_fn; protocol: docs/method.md, "Latency"), and STATE: what this
rank does, for the parent's heartbeat. queue_ahead=False: where the host launches slower than the
device runs, the events measure the host's launch time; queue_ahead=True: Timing.queued is False
where the host had not enqueued every iteration before the sleep ended. On the CPU each iteration
follows a barrier. Where fn raises on one rank, that rank still takes part in every collective of
time_fn and raises after the last, so its peers are not left waiting.
"""

from __future__ import annotations

import time
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, replace

import torch
import torch.distributed as dist

from harness.errors import is_comm_failure

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
    #: median host time to enqueue one iteration (ms, MAX over ranks; GPU only, else nan)
    host_ms: float = float("nan")
    #: queue_ahead: the sleep outlasted the host's enqueueing on every rank (None: not asked)
    queued: bool | None = None


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


class RankState:
    """What this rank does in its cell, for its heartbeat (harness.rank.Reporter): the stage
    (harness.measure.stage), since when (time.monotonic) it waits in a collective of the harness
    (None: it runs its own or a system's work), and its failure not agreed on yet."""

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        self.stage = ""
        self.waiting_since: float | None = None
        self.failure: str | None = None

    def report(self) -> tuple:
        """(stage, seconds waited or None, failure) for the heartbeat; () when idle."""
        since = self.waiting_since
        if not self.stage and since is None and self.failure is None:
            return ()
        waited = None if since is None else round(time.monotonic() - since, 3)
        return (self.stage, waited, self.failure)


STATE = RankState()


@contextmanager
def waiting() -> Iterator[None]:
    """Mark the block as a wait in a collective of the harness (a barrier, an agreement)."""
    before = STATE.waiting_since
    if before is None:
        STATE.waiting_since = time.monotonic()
    try:
        yield
    finally:
        STATE.waiting_since = before


def barrier(group: dist.ProcessGroup | None, device: torch.device) -> None:
    """A barrier that also works for NCCL groups (an all-reduce of one element)."""
    if dist.is_available() and dist.is_initialized():
        t = torch.zeros(1, device=device)
        with waiting():
            dist.all_reduce(t, group=group)
            if device.type == "cuda":
                torch.cuda.synchronize(device)


#: the text of torch's warning for one synchronising CUDA call (torch.cuda.set_sync_debug_mode)
SYNC_WARNING = "called a synchronizing CUDA operation"


def count_host_syncs(fn: Callable[[], object], device: torch.device) -> int | None:
    """How often one call of fn() makes the host wait for the device through torch: what
    torch.cuda.set_sync_debug_mode("warn") flags (.item(), a blocking copy, a synchronize...)
    and torch.cuda.Event.synchronize (which that mode does not flag; Megatron's dispatcher
    waits on one). Not counted: NCCL calls, polling with Event.query. None off CUDA."""
    if device.type != "cuda":
        return None
    before = torch.cuda.get_sync_debug_mode()
    event_sync = torch.cuda.Event.synchronize
    events = 0

    def counted(event: torch.cuda.Event) -> None:
        nonlocal events
        events += 1
        event_sync(event)

    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        torch.cuda.Event.synchronize = counted
        try:
            fn()
        finally:
            torch.cuda.Event.synchronize = event_sync
            torch.cuda.set_sync_debug_mode(before)
    torch.cuda.synchronize(device)
    return events + sum(SYNC_WARNING in str(w.message) for w in seen)


#: cycles of torch.cuda._sleep per millisecond, per device (measured once: _sleep_rate)
_SLEEP_RATE: dict[int, float] = {}
#: the queue-ahead sleep: this many times the host's enqueue time of the timed loop, plus a margin
SLEEP_FACTOR, SLEEP_MARGIN_MS, SLEEP_MAX_MS = 2.0, 2.0, 2000.0


def _sleep_rate(device: torch.device) -> float:
    """Cycles of torch.cuda._sleep per ms on `device` (the faster of two 5e6-cycle sleeps, warm)."""
    idx = device.index if device.index is not None else torch.cuda.current_device()
    if idx not in _SLEEP_RATE:
        torch.cuda._sleep(1000)  # the first launch loads the kernel: not timed
        torch.cuda.synchronize(device)
        ms = []
        for _ in range(2):
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            torch.cuda._sleep(5_000_000)
            b.record()
            b.synchronize()
            ms.append(a.elapsed_time(b))
        _SLEEP_RATE[idx] = 5_000_000 / max(min(ms), 1e-3)
    return _SLEEP_RATE[idx]


def _call(fn: Callable[[], object], failed: list[Exception]) -> None:
    """fn() unless it failed before; its exception is kept to raise after time_fn's
    collectives, a broken process group's at once (each collective left would time out)."""
    if failed:
        return
    try:
        fn()
    except Exception as exc:  # noqa: BLE001 - raised after the collectives
        if is_comm_failure(exc):
            raise
        failed.append(exc)


def time_fn(
    fn: Callable[[], object],
    *,
    device: torch.device,
    group: dist.ProcessGroup | None = None,
    warmup: int = 3,
    iters: int = 10,
    queue_ahead: bool = False,
) -> Timing:
    """Time fn() over `iters` iterations after `warmup` (module docstring; also a raising fn)."""
    if iters < 1:
        raise ValueError("iters must be >= 1")
    failed: list[Exception] = []
    warm_host = []
    for _ in range(warmup):
        t0 = time.perf_counter()
        _call(fn, failed)
        warm_host.append(time.perf_counter() - t0)
    barrier(group, device)
    if device.type == "cuda":
        starts = [torch.cuda.Event(enable_timing=True) for _ in range(iters)]
        ends = [torch.cuda.Event(enable_timing=True) for _ in range(iters)]
        host = []
        sleep_end = None
        if queue_ahead:
            # the fastest warm-up (the first may compile); 1 ms when there was none
            per_iter_ms = 1e3 * min(warm_host, default=1e-3)
            sleep_ms = min(SLEEP_FACTOR * per_iter_ms * iters + SLEEP_MARGIN_MS, SLEEP_MAX_MS)
            rate = _sleep_rate(device)  # measured once, before the barrier
            barrier(group, device)
            # keeps the stream busy: the launches after it wait on the device, not on the host
            torch.cuda._sleep(int(sleep_ms * rate))
            sleep_end = torch.cuda.Event()
            sleep_end.record()
        for s, e in zip(starts, ends):
            t0 = time.perf_counter()
            s.record()
            _call(fn, failed)
            e.record()
            host.append(time.perf_counter() - t0)
        # the device still sleeping now means every iteration was enqueued before it ran
        queued = None if sleep_end is None else not sleep_end.query()
        torch.cuda.synchronize(device)
        ms = [s.elapsed_time(e) for s, e in zip(starts, ends)]
        host_ms = 1e3 * float(torch.tensor(host, dtype=torch.float64).median())
        ms += [host_ms, float(queued is False)]  # reduced with the times (1: a rank not queued)
    else:
        ms = []
        for _ in range(iters):
            barrier(group, device)
            t0 = time.perf_counter()
            _call(fn, failed)
            ms.append((time.perf_counter() - t0) * 1e3)
    t = torch.tensor(ms, dtype=torch.float64, device=device)
    if dist.is_available() and dist.is_initialized():
        with waiting():
            dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    if failed:
        raise failed[0]
    agreed = t.cpu().tolist()
    out = summarize(agreed[:iters])
    if device.type != "cuda":
        return out
    return replace(out, host_ms=agreed[iters], queued=None if queued is None else agreed[-1] == 0)
