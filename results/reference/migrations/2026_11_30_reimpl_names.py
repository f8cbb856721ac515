"""One-off migration (2026-11-30): the re-implemented baselines get their own system names.

`tutel` and `fastermoe` now name the native packages; our re-implementations are `tutel_reimpl`
and `fastermoe_reimpl`. Rows measured before the split carry system `tutel` / `fastermoe` with
impl "reimpl (...)": they are renamed, so the plots label them as re-implementations. Rows whose
impl says native keep their names. Nothing else changes.
Run once from the repository root.
"""

from pathlib import Path

import pandas as pd

RENAME = {"tutel": "tutel_reimpl", "fastermoe": "fastermoe_reimpl"}

for path in sorted(Path("results/reference").rglob("*.parquet")):
    df = pd.read_parquet(path)
    if "system" not in df or "impl" not in df:
        continue
    old = df["system"].isin(list(RENAME)) & df["impl"].astype(str).str.startswith("reimpl")
    if old.any():
        df.loc[old, "system"] = df.loc[old, "system"].map(RENAME)
        df.to_parquet(path, index=False)
        print(f"{path}: {int(old.sum())} rows renamed")
