"""One-off migration (2026-12-03, issue 40): overlap's param `dispatch_overlap` left the product
with its `on` variant (it lost on one H200: docs/measurements.md), so every overlap cell hashes
as it did before the param.

Per overlap row with p_dispatch_overlap in every table under results/reference/: the cell is
rebuilt from the row's columns with today's params (the helpers of
2026_12_03_megatron_capacity.py) plus dispatch_overlap as the row holds it, hashed as the
harness did; where that gives the stored hash, the row takes the hash of the cell without it.
The columns of the variant (p_dispatch_overlap, p_dispatch_overlap_used and its bounds
m_dispatch_alone_ms, m_fc1_alone_ms, m_dispatch_fc1_ms, m_dispatch_hidden) leave the table.
Other rows keep their hash; no row is dropped; a second run changes nothing.

Run once from the repository root:
  python3 results/reference/migrations/2026_12_03_dispatch_overlap_removed.py [table.parquet ...]
"""

from __future__ import annotations

import importlib.util
import itertools
import re
import sys
from pathlib import Path

import pandas as pd

ROOT = Path(__file__).resolve().parents[3]
_spec = importlib.util.spec_from_file_location(
    "megatron_capacity", Path(__file__).with_name("2026_12_03_megatron_capacity.py")
)
capacity = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(capacity)
rows = capacity.rows

KNOB = "dispatch_overlap"
COLUMNS = (f"p_{KNOB}", f"p_{KNOB}_used", "m_dispatch_alone_ms", "m_fc1_alone_ms",
           "m_dispatch_fc1_ms", "m_dispatch_hidden")  # fmt: skip


def rehash(row: dict) -> tuple[str, str]:
    """(status, hash): "migrated" with the hash of the cell without the knob, "done" (no
    p_dispatch_overlap, or another system) or "unmatched" (the stored hash not rebuilt: kept)."""
    held = row.get(f"p_{KNOB}")
    if row["system"] != "overlap" or rows._missing(held):
        return "done", row["cell_hash"]
    defaults = dict(capacity.get_system("overlap").load().PARAMS)
    optional = {k: rows.OLD_OPTIONAL[k] for k in defaults if k in rows.OLD_OPTIONAL}
    today = rows.old_params(row, defaults, optional)
    seeds = {0} | {int(s) for s in re.findall(r"(?<![.\w])seed=([0-9]+)", str(row["command"]))}
    for seed, run in itertools.product(sorted(seeds), capacity.runs_of(row)):
        for cell in rows.cells_of(row, seed, today):
            stored = {**cell, "params": {**cell["params"], KNOB: held}}
            if rows.new_hash(stored, run) == row["cell_hash"]:
                return "migrated", rows.new_hash(cell, run)
    return "unmatched", row["cell_hash"]


def migrate(path: Path) -> dict[str, int]:
    """Re-hash one table in place and drop the variant's columns; the count of rows per status."""
    df = pd.read_parquet(path)
    need = {"cell_hash", "system", "experiment", "hardware", "warmup", "iters", "tol"}
    if not need <= set(df.columns) or f"p_{KNOB}" not in df.columns:
        return {"done": len(df)} if need <= set(df.columns) else {}
    results = [rehash(r) for r in df.to_dict("records")]
    counts = pd.Series([s for s, _ in results], dtype=object).value_counts().to_dict()
    df["cell_hash"] = [h for _, h in results]
    df = df.drop(columns=[c for c in COLUMNS if c in df.columns])
    df.to_parquet(path, index=False)
    print(f"{path}: {len(df)} rows: {counts}")
    return counts


if __name__ == "__main__":
    paths = [Path(p) for p in sys.argv[1:]] or sorted(
        (ROOT / "results/reference").rglob("*.parquet")
    )
    for p in paths:
        migrate(p)
