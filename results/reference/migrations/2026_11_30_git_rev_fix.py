"""One-off fix (2026-11-30, third session): the revision of rows measured without HARNESS_GIT_REV.

The device machine's git reports a stale revision ("3b0f141-dirty"): rows are stamped right only
when the call passes HARNESS_GIT_REV. Three calls did not; the tree each ran is known from the
session's log (the device copies the working tree of the revision named):
  operator.parquet     the overlap rows over nvshmem (step operator_x2_nvshmem)  -> 8621bbf
  experts.parquet      the rows of the resumed `experts` call                     -> ea53eab
  correctness.parquet  both calls (p2p and nvshmem)                               -> ea53eab
Only git_rev changes; nothing measured does. Run once from the repository root:
python3 results/reference/migrations/2026_11_30_git_rev_fix.py
"""

from __future__ import annotations

from pathlib import Path

import pandas as pd

STALE = "3b0f141-dirty"
FIXES = {"operator": "8621bbf", "experts": "ea53eab", "correctness": "ea53eab"}


def main() -> None:
    for name, rev in FIXES.items():
        path = Path("results/reference/h200x2") / f"{name}.parquet"
        df = pd.read_parquet(path)
        stale = df["git_rev"] == STALE
        df.loc[stale, "git_rev"] = rev
        df.to_parquet(path, index=False)
        print(f"{path}: {int(stale.sum())} row(s) -> {rev}")


if __name__ == "__main__":
    main()
