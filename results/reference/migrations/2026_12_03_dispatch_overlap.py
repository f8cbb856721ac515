"""One-off migration (2026-12-03, issue 40): overlap gained the param `dispatch_overlap`
(off | on, systems/overlap/dispatch_overlap.py), so every cell of its hashes anew.

Per overlap row without p_dispatch_overlap in every table under results/reference/: the cell is
rebuilt from the row's columns (the row helpers of 2026_12_03_params_rehash.py) with today's
params but dispatch_overlap, hashed as the harness does; where that gives the stored hash, the
row takes dispatch_overlap = off (what every row before the param ran) and the hash of that
cell. Other rows (a models row, whose cell the helpers do not rebuild) keep theirs; no row is
dropped; a second run changes nothing.

Run once from the repository root:
  python3 results/reference/migrations/2026_12_03_dispatch_overlap.py [table.parquet ...]
"""

from __future__ import annotations

import importlib.util
import itertools
import re
import sys
from pathlib import Path

import pandas as pd

ROOT = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(ROOT))
_spec = importlib.util.spec_from_file_location(
    "params_rehash", Path(__file__).with_name("2026_12_03_params_rehash.py")
)
rows = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(rows)

from harness.system import get_system  # noqa: E402

SYSTEMS = ("overlap",)
KNOB, RAN = "dispatch_overlap", "off"


def runs_of(row: dict) -> list[dict]:
    """rows.runs_of's run settings, each also under measure.graph auto and true on a GPU (rows
    made since the setting existed hash it there)."""
    out = []
    for run in rows.runs_of(row):
        out.append(run)
        if run["hardware"]["device"] == "cuda":
            out += [{**run, "measure": {**run["measure"], "graph": g}} for g in ("auto", "true")]
    return out


def rehash(row: dict) -> tuple[str, str]:
    """(status, hash): "migrated" with the new hash, "done" (has the knob's column, or another
    system) or "unmatched" (the stored hash not rebuilt: kept)."""
    if row["system"] not in SYSTEMS or not rows._missing(row.get(f"p_{KNOB}")):
        return "done", row["cell_hash"]
    defaults = {k: v for k, v in get_system(row["system"]).load().PARAMS.items() if k != KNOB}
    # a knob a row has no column for holds what it stood for before the knob (order:
    # remote_first), as the earlier migrations read it
    before = rows.old_params(row, defaults, {k: rows.OLD_OPTIONAL[k] for k in defaults
                                             if k in rows.OLD_OPTIONAL})  # fmt: skip
    seeds = {0} | {int(s) for s in re.findall(r"(?<![.\w])seed=([0-9]+)", str(row["command"]))}
    for seed, run in itertools.product(sorted(seeds), runs_of(row)):
        for cell in rows.cells_of(row, seed, before):
            if rows.new_hash(cell, run) == row["cell_hash"]:
                cell = {**cell, "params": {**cell["params"], KNOB: RAN}}
                return "migrated", rows.new_hash(cell, run)
    return "unmatched", row["cell_hash"]


def migrate(path: Path) -> dict[str, int]:
    """Re-hash one table in place; the count of rows per status."""
    df = pd.read_parquet(path)
    need = {"cell_hash", "system", "experiment", "hardware", "warmup", "iters", "tol"}
    if not need <= set(df.columns):
        return {}
    results = [rehash(r) for r in df.to_dict("records")]
    counts = pd.Series([s for s, _ in results], dtype=object).value_counts().to_dict()
    if counts.get("migrated"):
        moved = [s == "migrated" for s, _ in results]
        col = f"p_{KNOB}"
        if col not in df.columns:
            df[col] = None
        df[col] = df[col].astype(object)
        df.loc[moved, col] = RAN
        df["cell_hash"] = [h for _, h in results]
        df.to_parquet(path, index=False)
    print(f"{path}: {len(df)} rows: {counts}")
    return counts


if __name__ == "__main__":
    paths = [Path(p) for p in sys.argv[1:]] or sorted(
        (ROOT / "results/reference").rglob("*.parquet")
    )
    for p in paths:
        migrate(p)
