"""Join the per-run tables of an A/B (benchmarks/layer_ab.sh, operator_ab.sh) into one table.

Each run's table is named <tree>_r<run>.parquet (e.g. old_r1, new_r2); the joined table keeps
every row with its run number in `ab_rep` (the revisions are told apart by `git_rev`).
Usage: python -m benchmarks.ab_table PARTS_DIR OUT_TABLE
"""

from __future__ import annotations

import sys
from pathlib import Path

import pandas as pd


def join_runs(parts: Path) -> pd.DataFrame:
    """Every *_r<n>.parquet under `parts`, in name order, with ab_rep = n."""
    rows = []
    for f in sorted(Path(parts).glob("*_r*.parquet")):
        d = pd.read_parquet(f)
        d["ab_rep"] = int(f.stem.rsplit("_r", 1)[1])
        rows.append(d)
    if not rows:
        raise SystemExit(f"ab_table: no *_r<n>.parquet under {parts}")
    return pd.concat(rows, ignore_index=True)


if __name__ == "__main__":
    parts, out = sys.argv[1:3]
    join_runs(Path(parts)).to_parquet(out)
