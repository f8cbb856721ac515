"""Device error records of the overlap kernels -> a host exception.

A wait that times out (the consumer's or the receiver's) writes ONE record into an int64 error
buffer [ERR_SLOTS] (the first writer wins a compare-and-swap on slot 0) and the kernel exits its
remaining work, so nothing spins without bound. Record: ErrorRecord's fields as int64 slots in
order; segment and band are plan ids (-1 for a receiver wait), rank the rank whose kernel timed
out, seen / want the counter value last read / waited for, source the source rank of a
receiver wait (-1 for a band wait).
"""

from __future__ import annotations

import atexit
import threading
import time
from dataclasses import dataclass

import torch

ERR_SLOTS = 8
CODE_NONE = 0
CODE_BAND_TIMEOUT = 1
CODE_SIGNAL_TIMEOUT = 2

_CODE_NAMES = {CODE_BAND_TIMEOUT: "band wait", CODE_SIGNAL_TIMEOUT: "receive wait"}


@dataclass(frozen=True)
class ErrorRecord:
    code: int
    segment: int
    band: int
    rank: int
    program: int
    seen: int
    want: int
    source: int

    def message(self) -> str:
        what = _CODE_NAMES.get(self.code, f"error code {self.code}")
        if self.code == CODE_SIGNAL_TIMEOUT:
            where = f"waiting for source rank {self.source}"
        else:
            where = f"segment {self.segment}, band {self.band}"
        return (
            f"overlap consumer {what} timed out on rank {self.rank}: {where} "
            f"(program {self.program}; counter {self.seen}, wanted {self.want})"
        )


class OverlapTimeoutError(RuntimeError):
    """A consumer or receiver wait timed out on the device. `.record` holds the details."""

    def __init__(self, record: ErrorRecord) -> None:
        super().__init__(record.message())
        self.record = record


def new_error_buffer(device: torch.device | str) -> torch.Tensor:
    """A zeroed int64 [ERR_SLOTS] error buffer."""
    return torch.zeros(ERR_SLOTS, dtype=torch.int64, device=device)


#: CPU: every clock tensor handed out, refreshed by one daemon thread per process
_host_clocks: list[torch.Tensor] = []
_ticker_lock = threading.Lock()
_ticker_stop = threading.Event()
#: how often the daemon refreshes the CPU clocks (seconds)
TICK_S = 0.001


def _tick() -> None:
    while not _ticker_stop.wait(TICK_S):
        now = time.monotonic_ns()
        for c in list(_host_clocks):
            c.fill_(now)


def _stop_ticker(thread: threading.Thread) -> None:
    """At exit: no torch op may run in a thread while the interpreter tears torch down."""
    _ticker_stop.set()
    thread.join()


def new_clock(n: int, device: torch.device | str) -> torch.Tensor:
    """The kernels' int64 [n] clock. On a GPU zeroed scratch (the spins read %globaltimer
    through it); on the CPU (Triton's interpreter, which has no timer) every slot holds
    time.monotonic_ns(), refreshed by a daemon thread, so an interpreted spin is bounded by time
    as a GPU one is (kernels/primitives.py poll_bound)."""
    clock = torch.zeros(max(n, 1), dtype=torch.int64, device=device)
    if clock.device.type == "cuda":
        return clock
    clock.fill_(time.monotonic_ns())
    with _ticker_lock:
        if not _host_clocks:
            ticker = threading.Thread(target=_tick, name="overlap-host-clock", daemon=True)
            ticker.start()
            atexit.register(_stop_ticker, ticker)
        _host_clocks.append(clock)
    return clock


def read_error(err: torch.Tensor) -> ErrorRecord | None:
    """The record in `err` (synchronises with the device), or None when no error was recorded."""
    vals = [int(v) for v in err[:ERR_SLOTS].tolist()]
    if vals[0] == CODE_NONE:
        return None
    return ErrorRecord(*vals)


def raise_if_error(err: torch.Tensor) -> None:
    """Raise OverlapTimeoutError when `err` holds a record."""
    rec = read_error(err)
    if rec is not None:
        raise OverlapTimeoutError(rec)
