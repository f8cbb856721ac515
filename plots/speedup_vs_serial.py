"""Speedup of every system against `serial` on the same workload (same table, same run):
latency(serial) / latency(system), against experts per rank, one panel per routing, the best
cCTA/mgb of each system per workload. Higher is better; 1 = as fast as serial.
"""

from __future__ import annotations

from pathlib import Path

import matplotlib.pyplot as plt
import pandas as pd

from plots.common import label, load, main, save, transport_note

WORKLOAD = [
    "world_size",
    "tokens_per_rank",
    "hidden",
    "out",
    "experts_per_rank",
    "top_k",
    "routing",
    "dtype",
]


def speedups(df: pd.DataFrame) -> pd.DataFrame:
    """One row per (workload, system): best latency over its cCTA/mgb cells and the speedup."""
    best = df.groupby(WORKLOAD + ["system"], as_index=False)["latency_ms"].min()
    serial = best[best["system"] == "serial"][WORKLOAD + ["latency_ms"]]
    out = best.merge(serial, on=WORKLOAD, suffixes=("", "_serial"))
    out["speedup"] = out["latency_ms_serial"] / out["latency_ms"]
    return out


def plot(table: str | Path, out_dir: str | Path, name: str) -> list[Path]:
    df = load(table)
    if "serial" not in set(df["system"]):
        raise ValueError(f"{table}: no ok serial rows to compare against")
    sp = speedups(df)
    routings = sorted(sp["routing"].unique())
    fig, axes = plt.subplots(1, len(routings), figsize=(4.5 * len(routings), 3.8), squeeze=False)
    for ax, routing in zip(axes[0], routings):
        sub = sp[sp["routing"] == routing]
        for (system, tpr, n), s in sub.groupby(["system", "tokens_per_rank", "out"]):
            s = s.sort_values("experts_per_rank")
            ax.plot(
                s["experts_per_rank"],
                s["speedup"],
                marker="o",
                ms=3,
                label=f"{label(system)} T={tpr} N={n}",
            )
        ax.axhline(1.0, color="k", lw=0.8)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("experts per rank")
        ax.set_ylabel("speedup vs serial (higher is better)")
        ax.set_title(routing, fontsize=9)
    axes[0][-1].legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.02, 1.0))
    fig.suptitle(f"Speedup against serial\n{transport_note(df)}", fontsize=9, y=1.06)
    return save(fig, out_dir, name)


if __name__ == "__main__":
    main(plot, "results/overlap_sweep.parquet", "speedup_vs_serial")
