"""Named modes of the overlap kernels, importable without Triton (transports, harness, tests).

Consumer put modes (kernels/consumer.py, the constexpr PUT_MODE; transport.py says which
transport uses which):
  PUT_STORE (0)          Triton vectorised loads/stores to directly writable destination addresses
  PUT_NVSHMEM (1)        nvshmemx_putmem_block per band, nvshmem_quiet, then the release atomic
  PUT_NVSHMEM_SIGNAL (2) nvshmemx_putmem_block per band, putmem_signal_block for a segment's last
NVSHMEM_SIGNAL_ADD: NVSHMEM 3.x's NVSHMEM_SIGNAL_ADD (torch's docstrings say 5: wrong).

Producer flag modes (kernels/producer.py, the constexpr FLAG; TileConfig.flag names them):
  FLAG_NONE (0) no flags (signal=False): the compute-only bound; FLAG_CODES maps the names
  "cta" (1), "thread" (2), "deferred" (3) to the codes.
GROUP_CODE: a producer swizzle group (plan.producer_groups) is encoded first * GROUP_CODE + size.
Error codes of the device error record are in errors.py.
"""

from __future__ import annotations

PUT_STORE = 0
PUT_NVSHMEM = 1
PUT_NVSHMEM_SIGNAL = 2
PUT_MODE_NAMES = {PUT_STORE: "store", PUT_NVSHMEM: "put", PUT_NVSHMEM_SIGNAL: "put_signal"}
NVSHMEM_SIGNAL_ADD = 10

FLAG_NONE = 0
FLAG_CTA = 1
FLAG_THREAD = 2
FLAG_DEFERRED = 3
FLAG_CODES = {"cta": FLAG_CTA, "thread": FLAG_THREAD, "deferred": FLAG_DEFERRED}

GROUP_CODE = 1024
