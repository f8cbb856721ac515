"""Stage B of the method, device side: the Triton kernels and their thin launchers.

producer.py    ONE persistent Triton GEMM per rank over all local experts, per-band ready counters
consumer.py    ONE persistent Triton kernel of cCTA programs: wait for bands, copy valid rows,
               signal
plan.py        stage A's kernels (systems/overlap/plan_device.py launches them)
primitives.py  the device primitives both share (bounded spins, error record, timers, copies,
               flag publishing, NVSHMEM externs)
The host state that pairs them (counters, streams, epochs) is systems/overlap/runner.py; the
tile table is systems/overlap/tuning.py; the named modes are systems/overlap/modes.py.
Importing this package imports triton.
"""

from __future__ import annotations

from systems.overlap.kernels.consumer import launch_wait_signals
from systems.overlap.kernels.producer import launch_producer

__all__ = ["launch_producer", "launch_wait_signals"]
