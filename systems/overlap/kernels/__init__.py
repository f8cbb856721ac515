"""Stage B's Triton kernels and thin launchers (producer.py, consumer.py), stage A's (plan.py)
and their shared device functions (primitives.py). Importing this package imports triton.
"""

from systems.overlap.kernels.consumer import launch_wait_signals
from systems.overlap.kernels.producer import launch_producer

__all__ = ["launch_producer", "launch_wait_signals"]
