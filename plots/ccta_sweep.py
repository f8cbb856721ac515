"""cCTA sweep of the overlap system: overlapped latency against cCTA with its two bounds
(compute alone on all SMs, combine alone on cCTA SMs), one panel per routing, one line style per
mgb; below, the overlap ratio. Latency: lower is better; overlap ratio: higher is better.
"""

from __future__ import annotations

from pathlib import Path

import matplotlib.pyplot as plt

from plots.common import load, main, save, transport_note


def plot(table: str | Path, out_dir: str | Path, name: str) -> list[Path]:
    df = load(table)
    df = df[df["system"] == "overlap"]
    if df.empty:
        raise ValueError(f"{table}: no ok overlap rows")
    routings = sorted(df["routing"].unique())
    fig, axes = plt.subplots(2, len(routings), figsize=(4.5 * len(routings), 6.5), squeeze=False)
    for i, routing in enumerate(routings):
        sub = df[df["routing"] == routing]
        ax, ax2 = axes[0][i], axes[1][i]
        for mgb, s in sub.groupby("p_mgb"):
            s = s.sort_values("p_ccta")
            ax.plot(s["p_ccta"], s["latency_ms"], marker="o", label=f"overlapped, mgb={mgb:g}")
            ax2.plot(s["p_ccta"], s["overlap_ratio"], marker="o", label=f"mgb={mgb:g}")
        s = sub.sort_values("p_ccta").groupby("p_ccta").median(numeric_only=True).reset_index()
        ax.plot(s["p_ccta"], s["compute_ms"], "k--", label="compute alone (all SMs)")
        ax.plot(s["p_ccta"], s["comm_ms"], "k:", label="combine alone (cCTA SMs)")
        ax.set_title(f"{routing}", fontsize=9)
        ax.set_xlabel("cCTA (consumer SMs)")
        ax.set_ylabel("ms (lower is better)")
        ax.legend(fontsize=7)
        ax2.set_xlabel("cCTA (consumer SMs)")
        ax2.set_ylabel("overlap ratio (higher is better)")
        ax2.set_ylim(0, 1.05)
        ax2.legend(fontsize=7)
    r = df.iloc[0]
    shape = (
        f"T/rank={r['tokens_per_rank']} K={r['hidden']} N={r['out']} "
        f"E={r['experts_per_rank']} {r['dtype']}"
    )
    return save(fig, out_dir, name, f"Overlap cCTA sweep, {shape}\n{transport_note(df)}")


if __name__ == "__main__":
    main(plot, "results/overlap_ccta.parquet", "overlap_ccta")
