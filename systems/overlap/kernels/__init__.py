"""Stage B of the method, device side: the Triton kernels and their thin launchers: producer.py
(the persistent grouped GEMM with per-band ready counters), consumer.py (the kernel that waits
for bands, copies valid rows and signals), plan.py (stage A's kernels, launched by
systems/overlap/plan_device.py) and primitives.py (their shared device functions). The host
state that pairs them is systems/overlap/runner.py. Importing this package imports triton.
"""

from __future__ import annotations

from systems.overlap.kernels.consumer import launch_wait_signals
from systems.overlap.kernels.producer import launch_producer

__all__ = ["launch_producer", "launch_wait_signals"]
