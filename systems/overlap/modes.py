"""Named modes of the overlap kernels, importable without Triton (transports, harness, tests).

Producer flag modes (the constexpr FLAG): FLAG_NONE (0, signal=False) and FLAG_CODES, the codes
of TileConfig.flag. GROUP_CODE: a producer swizzle group is encoded first * GROUP_CODE + size.
"""

from __future__ import annotations

FLAG_NONE = 0
FLAG_CTA = 1
FLAG_THREAD = 2
FLAG_DEFERRED = 3
FLAG_CODES = {"cta": FLAG_CTA, "thread": FLAG_THREAD, "deferred": FLAG_DEFERRED}

GROUP_CODE = 1024
