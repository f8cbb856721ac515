"""Named modes of the overlap kernels, importable without Triton (transports, harness, tests).

Consumer put modes (the constexpr PUT_MODE; transport.py says which transport uses which):
PUT_STORE (0) Triton stores to directly writable addresses, PUT_NVSHMEM (1) putmem_block per
band + quiet + release atomic, PUT_NVSHMEM_SIGNAL (2) putmem_signal_block for a segment's last
band. NVSHMEM_SIGNAL_ADD: NVSHMEM 3.x's value (torch's docstrings say 5: wrong).
Producer flag modes (the constexpr FLAG): FLAG_NONE (0, signal=False) and FLAG_CODES, the codes
of TileConfig.flag. GROUP_CODE: a producer swizzle group is encoded first * GROUP_CODE + size.
"""

from __future__ import annotations

PUT_STORE = 0
PUT_NVSHMEM = 1
PUT_NVSHMEM_SIGNAL = 2
NVSHMEM_SIGNAL_ADD = 10

FLAG_NONE = 0
FLAG_CTA = 1
FLAG_THREAD = 2
FLAG_DEFERRED = 3
FLAG_CODES = {"cta": FLAG_CTA, "thread": FLAG_THREAD, "deferred": FLAG_DEFERRED}

GROUP_CODE = 1024
