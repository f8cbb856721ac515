"""One-off migration (2026-12-03, issue 39): megatron_cutlass and megatron_te gained the param
`capacity` (dropless | padded, systems/megatron_cutlass.py), so every cell of theirs hashes anew.

Per row of either system without p_capacity in every table under results/reference/: the cell
is rebuilt from the row's columns (the row helpers of 2026_12_03_params_rehash.py) with today's
params but capacity, hashed as the harness does; where that gives the stored hash, the row
takes capacity = dropless (what every row before the param ran) and the hash of that cell.
Other rows (a models row, whose cell the helpers do not rebuild) keep theirs; no row is
dropped; a second run changes nothing.

Run once from the repository root:
  python3 results/reference/migrations/2026_12_03_megatron_capacity.py [table.parquet ...]
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

SYSTEMS = ("megatron_cutlass", "megatron_te")
KNOB, RAN = "capacity", "dropless"


def runs_of(row: dict) -> list[dict]:
    """rows.runs_of's run settings, each also under measure.graph auto and true on a GPU (rows
    made since the setting existed hash it there)."""
    out = []
    for run in rows.runs_of(row):
        out.append(run)
        if run["hardware"]["device"] == "cuda":
            out += [{**run, "measure": {**run["measure"], "graph": g}} for g in ("auto", "true")]
    return out


def rehash(row: dict, systems=SYSTEMS, knob: str = KNOB, ran: str = RAN) -> tuple[str, str]:
    """(status, hash): "migrated" with the new hash, "done" (has p_<knob>, or another system)
    or "unmatched" (the stored hash not rebuilt: kept)."""
    if row["system"] not in systems or not rows._missing(row.get(f"p_{knob}")):
        return "done", row["cell_hash"]
    defaults = {k: v for k, v in get_system(row["system"]).load().PARAMS.items() if k != knob}
    # a knob a row has no column for holds what it stood for before that knob (overlap's order:
    # remote_first), as the earlier migrations read it; Megatron has none of them
    optional = {k: rows.OLD_OPTIONAL[k] for k in defaults if k in rows.OLD_OPTIONAL}
    before = rows.old_params(row, defaults, optional)
    seeds = {0} | {int(s) for s in re.findall(r"(?<![.\w])seed=([0-9]+)", str(row["command"]))}
    for seed, run in itertools.product(sorted(seeds), runs_of(row)):
        for cell in rows.cells_of(row, seed, before):
            if rows.new_hash(cell, run) == row["cell_hash"]:
                cell = {**cell, "params": {**cell["params"], knob: ran}}
                return "migrated", rows.new_hash(cell, run)
    return "unmatched", row["cell_hash"]


def migrate(path: Path, systems=SYSTEMS, knob: str = KNOB, ran: str = RAN) -> dict[str, int]:
    """Re-hash one table in place; the count of rows per status."""
    df = pd.read_parquet(path)
    need = {"cell_hash", "system", "experiment", "hardware", "warmup", "iters", "tol"}
    if not need <= set(df.columns):
        return {}
    results = [rehash(r, systems, knob, ran) for r in df.to_dict("records")]
    counts = pd.Series([s for s, _ in results], dtype=object).value_counts().to_dict()
    if counts.get("migrated"):
        moved = [s == "migrated" for s, _ in results]
        col = f"p_{knob}"
        if col not in df.columns:
            df[col] = None
        df[col] = df[col].astype(object)
        df.loc[moved, col] = ran
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
