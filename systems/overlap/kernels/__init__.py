"""Stage B's Triton kernels and thin launchers: producer.py (the persistent grouped GEMM with
per-band ready counters), consumer.py (waits for bands, copies valid rows, signals), plan.py
(stage A's kernels; host glue: systems/overlap/plan_device.py), primitives.py (shared device
functions). Host state: systems/overlap/runner.py. Importing this package imports triton.
"""

from __future__ import annotations

from systems.overlap.kernels.consumer import launch_wait_signals
from systems.overlap.kernels.producer import launch_producer

__all__ = ["launch_producer", "launch_wait_signals"]
