"""Host-side cdiv and next_power_of_2 for launch grids: Triton 3.6's are constexpr functions,
about 3-4 us of host time per call from Python where these take 0.05 us (kernels keep tl.cdiv).
"""

from __future__ import annotations


def cdiv(a: int, b: int) -> int:
    """ceil(a / b) for ints, b > 0."""
    return -(-a // b)


def next_power_of_2(n: int) -> int:
    """The smallest power of two >= n for n >= 1 (0 for 0), as triton.next_power_of_2."""
    return 0 if n <= 0 else 1 << (n - 1).bit_length()
