"""cCTA sweep of the overlap system, one panel per routing, one line per mgb: latency against
cCTA with its two bounds (compute alone on all SMs, combine alone on cCTA SMs; lower is better);
below, the overlap ratio (higher is better)."""

from __future__ import annotations

from pathlib import Path

from plots.common import grid, load, main, need, save, transport_note


def plot(table: str | Path, out_dir: str | Path, name: str) -> list[Path]:
    df = load(table)
    df = need(df[df["system"] == "overlap"], table, "ok overlap rows")
    routings = sorted(df["routing"].unique())
    fig, axes = grid(2, len(routings), 4.5, 3.25)
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
        ax.set(xlabel="cCTA (consumer SMs)", ylabel="ms (lower is better)")
        ax2.set(xlabel="cCTA (consumer SMs)", ylabel="overlap ratio (higher is better)")
        for a in (ax, ax2):
            a.legend(fontsize=7)
    r = df.iloc[0]
    shape = f"T/rank={r['tokens_per_rank']} K={r['hidden']} N={r['out']} E={r['experts_per_rank']}"
    title = f"Overlap cCTA sweep, {shape} {r['dtype']}\n{transport_note(df)}"
    return save(fig, out_dir, name, title)


if __name__ == "__main__":
    main(plot, "results/overlap_ccta.parquet", "overlap_ccta")
