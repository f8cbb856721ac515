"""Where the host's time per timed step goes: cProfile over harness cells' timed region.

Every cell of the composed grid (the Hydra overrides of harness.run; one process, W > 1 played
on one GPU: loopback) is set up and checked as harness.measure does, then its timed region runs
`--steps` times while the device sleeps, so no launch waits for the device: the host's own time.
Per cell: host ms per step, device ms per step (the same steps back to back) and the functions
with the most own time. The device's idle time per eager step: step_profile.py --idle.
Usage: python -m benchmarks.host_profile [--steps 20] [--top 25] -- <overrides>
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import time

import torch

from benchmarks.step_profile import fail, prepared_cells
from harness.records import Row
from harness.timing import sleep_device


def profile_cell(fn, steps: int, top: int) -> str:
    """Host ms per step, device ms per step and the top functions of fn, a cell's timed step."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    sleep_device(torch.device("cuda", torch.cuda.current_device()), 3000)  # launches queue
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    prof = cProfile.Profile()
    t0 = time.perf_counter()
    a.record()
    prof.enable()
    for _ in range(steps):
        fn()
    prof.disable()
    b.record()
    host_ms = (time.perf_counter() - t0) * 1e3 / steps
    late = a.query()  # the sleep ended before the host was done: host time includes waiting
    torch.cuda.synchronize()
    dev_ms = a.elapsed_time(b) / steps
    out = io.StringIO()
    pstats.Stats(prof, stream=out).sort_stats("tottime").print_stats(top)
    head = f"host {host_ms:.3f} ms/step (profiled), device {dev_ms:.3f} ms/step"
    return head + (" [LATE: not queued]" if late else "") + "\n" + out.getvalue()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument("overrides", nargs="*")
    args = ap.parse_args()
    if args.steps < 1:
        fail(f"--steps must be >= 1, got {args.steps}")
    for _, _, name, _, p in prepared_cells(args.overrides, "host_profile"):
        if isinstance(p, Row):
            print(f"== {name}: {p.status} {p.reason}", flush=True)
        else:
            print(f"== {name}\n{profile_cell(p.system.timed, args.steps, args.top)}", flush=True)


if __name__ == "__main__":
    main()
