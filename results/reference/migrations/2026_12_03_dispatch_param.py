"""One-off migration (2026-12-03, issue 39): serial and overlap gained the param `dispatch`
(auto | device | nccl, harness/dispatch_device.py), so every cell of theirs hashes anew.

Per row of serial or overlap without p_dispatch in every table under results/reference/: the
cell is rebuilt from the row's columns (the row helpers of 2026_12_03_params_rehash.py, the
step before this one) with today's params but dispatch, hashed as the harness does; where that
gives the stored hash, the row takes dispatch = what it ran (nccl for a layer row: until now
every layer dispatched with NCCL and its host sync; auto for an operator row, whose timed region
has no dispatch) and the hash of that cell, so an eager re-run (measure.graph=false) resumes on
it. Other rows are left as they are; no row is dropped; a second run changes nothing.

Run once from the repository root:
  python3 results/reference/migrations/2026_12_03_dispatch_param.py [table.parquet ...]
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

SYSTEMS = ("serial", "overlap")
#: overlap knobs added after this migration and still in the product (dispatch_overlap came
#: and left: 2026_12_03_dispatch_overlap_removed.py)
LATER: tuple[str, ...] = ()


def dispatch_of(row: dict) -> str:
    """What the row's cell ran: nccl in the layer scope, auto (no dispatch) in the operator's."""
    return "nccl" if int(row.get("ffn") or 0) > 0 else "auto"


def rehash(row: dict) -> tuple[str, str]:
    """(status, hash): "migrated" with the new hash, "done" (has p_dispatch, or not serial or
    overlap) or "unmatched" (the stored hash not rebuilt: kept)."""
    if row["system"] not in SYSTEMS or not rows._missing(row.get("p_dispatch")):
        return "done", row["cell_hash"]
    later = ("dispatch", *LATER)  # the knob, and those added after this migration
    keys = [k for k in get_system(row["system"]).load().PARAMS if k not in later]
    if row["system"] == "overlap":  # a knob a row has no column for: as the step before read it
        held = rows.old_params(row, rows.OLD_OVERLAP, rows.OLD_OPTIONAL)
    else:
        held = rows.old_params(row, dict(get_system(row["system"]).load().PARAMS), {})
    before = {k: held[k] for k in keys}
    seeds = {0} | {int(s) for s in re.findall(r"(?<![.\w])seed=([0-9]+)", str(row["command"]))}
    for seed, run in itertools.product(sorted(seeds), rows.runs_of(row)):
        for cell in rows.cells_of(row, seed, before):
            if rows.new_hash(cell, run) == row["cell_hash"]:
                cell = {**cell, "params": {**cell["params"], "dispatch": dispatch_of(row)}}
                return "migrated", rows.new_hash(cell, run)
    return "unmatched", row["cell_hash"]


def migrate(path: Path) -> dict[str, int]:
    """Re-hash one table in place; the count of rows per status."""
    df = pd.read_parquet(path)
    need = {"cell_hash", "system", "experiment", "hardware", "warmup", "iters", "tol"}
    if not need <= set(df.columns):
        return {}
    records = df.to_dict("records")
    results = [rehash(r) for r in records]
    counts = pd.Series([s for s, _ in results], dtype=object).value_counts().to_dict()
    if counts.get("migrated"):
        moved = [s == "migrated" for s, _ in results]
        if "p_dispatch" not in df.columns:
            df["p_dispatch"] = None
        df["p_dispatch"] = df["p_dispatch"].astype(object)
        df.loc[moved, "p_dispatch"] = [dispatch_of(r) for r, m in zip(records, moved) if m]
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
