"""One-off migration (2026-12-03, issue 40): overlap gained the param `dispatch_overlap`
(off | on, systems/overlap/dispatch_overlap.py), so every cell of its hashes anew.

Per overlap row without p_dispatch_overlap in every table under results/reference/: the cell is
rebuilt from the row's columns (2026_12_03_megatron_capacity.py's rehash, run for this knob)
with today's params but dispatch_overlap, hashed as the harness does; where that gives the
stored hash, the row takes dispatch_overlap = off (what every row before the param ran) and
the hash of that cell. Other rows (a models row, whose cell the helpers do not rebuild) keep
theirs; no row is dropped; a second run changes nothing.

Run once from the repository root:
  python3 results/reference/migrations/2026_12_03_dispatch_overlap.py [table.parquet ...]
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
_spec = importlib.util.spec_from_file_location(
    "megatron_capacity", Path(__file__).with_name("2026_12_03_megatron_capacity.py")
)
capacity = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(capacity)

SYSTEMS = ("overlap",)
KNOB, RAN = "dispatch_overlap", "off"


def migrate(path: Path) -> dict[str, int]:
    """Re-hash one table in place; the count of rows per status."""
    return capacity.migrate(path, SYSTEMS, KNOB, RAN)


if __name__ == "__main__":
    paths = [Path(p) for p in sys.argv[1:]] or sorted(
        (ROOT / "results/reference").rglob("*.parquet")
    )
    for p in paths:
        migrate(p)
