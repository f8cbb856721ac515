"""What a system keeps across the cells of a run, released before the process group ends.

A system holding something for the whole run (deepep's NVSHMEM Buffer, whose destroy is a
collective over every rank) registers its release with at_run_end(fn); a rank calls run_end()
after its last cell, before dist.destroy_process_group(). A failed rank ends without it (a
broken process group can hang in a collective).
"""

from __future__ import annotations

import sys
from collections.abc import Callable

_pending: list[Callable[[], None]] = []


def at_run_end(fn: Callable[[], None]) -> None:
    """Have run_end() call fn (once, however often it is registered)."""
    if fn not in _pending:
        _pending.append(fn)


def run_end() -> list[str]:
    """Call every registered function, the last registered first, and forget them; the
    failures, one line each (also printed on stderr)."""
    failed = []
    while _pending:
        fn = _pending.pop()
        try:
            fn()
        except Exception as exc:  # noqa: BLE001 - the rows are written: report, release the rest
            line = f"[harness] releasing {getattr(fn, '__qualname__', fn)} failed: {exc}"
            failed.append(line.splitlines()[0][:300])
            print(failed[-1], file=sys.stderr, flush=True)
    return failed
