"""Named modes of the overlap kernels, importable without Triton (transports, harness, tests).

Consumer put modes (kernels/consumer.py, the constexpr PUT_MODE; transport.py says which
transport uses which):
  PUT_STORE (0)          Triton vectorised loads/stores to directly writable destination addresses
  PUT_NVSHMEM (1)        nvshmemx_putmem_block per band, nvshmem_quiet, then the release atomic
  PUT_NVSHMEM_SIGNAL (2) nvshmemx_putmem_block per band, putmem_signal_block for a segment's last
NVSHMEM_SIGNAL_ADD: NVSHMEM 3.x's NVSHMEM_SIGNAL_ADD (torch's docstrings say 5: wrong).

Producer flag modes (kernels/producer.py, the constexpr FLAG; TileConfig.flag names them):
  FLAG_NONE (0) no flags (signal=False): the compute-only bound; FLAG_CODES maps the names
  "cta" (1), "thread" (2), "deferred" (3), "warp" (4), "mid" (5) to the codes.
Producer swizzle groups (TileConfig.group_m / expert_groups; the overlap system's `swizzle`):
  "table" (the tile table's own), "fixed<m>" (groups of m consecutive visiting positions),
  "expert<cap>" (runs of one expert's bands, at most cap long: plan.producer_groups, which
  encodes a group as first * GROUP_CODE + size, so cap < GROUP_CODE).
Error codes of the device error record are in errors.py.
"""

from __future__ import annotations

import re

PUT_STORE = 0
PUT_NVSHMEM = 1
PUT_NVSHMEM_SIGNAL = 2
PUT_MODE_NAMES = {PUT_STORE: "store", PUT_NVSHMEM: "put", PUT_NVSHMEM_SIGNAL: "put_signal"}
NVSHMEM_SIGNAL_ADD = 10

FLAG_NONE = 0
FLAG_CTA = 1
FLAG_THREAD = 2
FLAG_DEFERRED = 3
FLAG_WARP = 4
FLAG_MID = 5
FLAG_CODES = {
    "cta": FLAG_CTA,
    "thread": FLAG_THREAD,
    "deferred": FLAG_DEFERRED,
    "warp": FLAG_WARP,
    "mid": FLAG_MID,
}


GROUP_CODE = 1024
SWIZZLES = ("table", "fixed<m>", "expert<cap>")
CONSUMER_SMS = ("own", "shared")


def parse_swizzle(swizzle: str) -> tuple[bool, int] | None:
    """ "table" -> None; "fixed<m>" -> (False, m); "expert<cap>" -> (True, cap); else a one-line
    ValueError (m and cap in [1, GROUP_CODE))."""
    m = re.fullmatch(r"(table)|(fixed|expert)([0-9]+)", str(swizzle))
    if m is None or (m.group(3) is not None and not 1 <= int(m.group(3)) < GROUP_CODE):
        raise ValueError(
            f"swizzle must be one of {', '.join(SWIZZLES)} with m and cap in [1, {GROUP_CODE}), "
            f"got {swizzle!r}"
        )
    return None if m.group(1) else (m.group(2) == "expert", int(m.group(3)))
