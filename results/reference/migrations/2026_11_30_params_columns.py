"""One-off migration (2026-11-30, the architecture step): system knobs become p_<name> columns.

Before, every Row carried the overlap system's knobs as core columns (ccta, mgb, tile_m, tile_n,
tile_k; 0 where a system had none). Now a row carries its system's own parameters as p_<name>.
This rewrites the committed Row-schema tables under results/reference/ in place:
  overlap rows   ccta, mgb, tile_m, tile_n, tile_k -> p_ccta, p_mgb, p_tile_m, p_tile_n, p_tile_k
                 (padding rows: tile_m -> p_tile_m only; they never had the others)
  tutel rows     extra["degree"] -> p_degree_tuned (the degree it picked)
  other systems  no p_ columns (their knobs were not recorded in the old rows)
The old core columns are dropped. Measured values, statuses and cell_hash are kept as they were
(the old hash covered the old grid; reference tables are read, never resumed into).
Benchmark tables (bandwidth, kernels_h200, plan_time) have their own schema and are untouched.

Run once from the repository root: python3 results/reference/migrations/2026_11_30_params_columns.py
"""

from __future__ import annotations

import json
from pathlib import Path

import pandas as pd

OLD = ["ccta", "mgb", "tile_m", "tile_n", "tile_k"]


def migrate(path: Path) -> None:
    df = pd.read_parquet(path)
    if "cell_hash" not in df or not set(OLD) <= set(df.columns):
        print(f"{path}: not an old Row-schema table, left as it is")
        return
    is_overlap = df["system"] == "overlap"
    padding = df["experiment"].eq("padding").all()
    for col in ["tile_m"] if padding else OLD:
        df[f"p_{col}"] = df[col].where(is_overlap).astype("float64")
    tutel = df["system"] == "tutel"
    if tutel.any():
        deg = df.loc[tutel, "extra"].map(lambda e: json.loads(e or "{}").get("degree"))
        df["p_degree_tuned"] = deg.reindex(df.index).astype("float64")
    df = df.drop(columns=OLD)
    df.to_parquet(path, index=False)
    print(f"{path}: {len(df)} rows migrated")


if __name__ == "__main__":
    for p in sorted(Path("results/reference").rglob("*.parquet")):
        migrate(p)
