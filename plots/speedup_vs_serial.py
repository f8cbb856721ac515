"""latency(serial) / latency(system) on the same workload against experts per rank, one panel
per (T, N, routing), one line per system (its best cCTA/mgb per workload). Higher is better."""

from __future__ import annotations

from pathlib import Path

import pandas as pd

from plots.common import WORKLOAD_KD, against, label, load, main, panel_grid, save, transport_note


def speedups(df: pd.DataFrame) -> pd.DataFrame:
    """One row per (workload, system): best latency over its cCTA/mgb cells and the speedup."""
    out = against(df, WORKLOAD_KD, ["system"])
    return out[out["ref_ms"].notna()]


def plot(table: str | Path, out_dir: str | Path, name: str) -> list[Path]:
    df = load(table)
    if "serial" not in set(df["system"]):
        raise ValueError(f"{table}: no ok serial rows to compare against")
    sp = speedups(df)
    sp["line"] = sp["system"].map(label)
    title = f"Speedup against serial (higher is better)\n{transport_note(df)}"
    fig = panel_grid(sp, "line", "speedup", "speedup vs serial", title,
                     rows={"tokens_per_rank": "T", "out": "N"})  # fmt: skip
    return save(fig, out_dir, name)


if __name__ == "__main__":
    main(plot, "results/overlap_sweep.parquet", "speedup_vs_serial")
