"""The layer table (scope `layer`): latency and the speedup against serial, per routing, one
panel row per shape (T, H).

Left block: latency (ms) of every system against experts per rank, one column per routing.
Right block: latency(serial) / latency(system) on the same workload (same table). The overlap
system's rows are split by variant (transport; local copy where rows ran it): each its own
line, never a best-of.
"""

from __future__ import annotations

from pathlib import Path

import matplotlib.pyplot as plt
import pandas as pd
from matplotlib.ticker import NullFormatter, ScalarFormatter

from plots.common import line_label, load, main, save, transport_note

SHAPE = ["tokens_per_rank", "hidden"]
WORKLOAD = ["world_size", *SHAPE, "ffn", "experts_per_rank", "top_k", "routing", "dtype"]


def series(df: pd.DataFrame) -> pd.DataFrame:
    """One row per (workload, line): latency_ms and speedup against serial. A line is a system,
    the overlap system per variant: transport and non-default knobs ("... (p2p, local copy)")."""
    df = df.copy()
    df["line"] = line_label(df)
    lat = df.groupby(WORKLOAD + ["system", "line"], as_index=False)["latency_ms"].median()
    serial = lat[lat["system"] == "serial"][WORKLOAD + ["latency_ms"]]
    out = lat.merge(serial, on=WORKLOAD, suffixes=("", "_serial"))
    out["speedup"] = out["latency_ms_serial"] / out["latency_ms"]
    return out


def plot(table: str | Path, out_dir: str | Path, name: str) -> list[Path]:
    df = load(table)
    df = df[df["ffn"].fillna(0) > 0] if "ffn" in df else df.iloc[0:0]
    if "serial" not in set(df["system"]):
        raise ValueError(f"{table}: no ok serial layer rows to compare against")
    sp = series(df)
    shapes = sorted(sp.groupby(SHAPE).groups)
    routings = sorted(sp["routing"].unique())
    n_r = len(routings)
    fig, axes = plt.subplots(
        len(shapes), 2 * n_r, figsize=(3.6 * 2 * n_r, 2.9 * len(shapes)), squeeze=False
    )
    lines = sorted(sp["line"].unique())
    colors = {ln: f"C{i % 10}" for i, ln in enumerate(lines)}
    for i, (tpr, h) in enumerate(shapes):
        for j, routing in enumerate(routings):
            sub = sp[
                (sp["tokens_per_rank"] == tpr) & (sp["hidden"] == h) & (sp["routing"] == routing)
            ]
            for line, s in sub.groupby("line"):
                s = s.sort_values("experts_per_rank")
                kw = dict(marker="o", ms=3, color=colors[line], label=line)
                axes[i][j].plot(s["experts_per_rank"], s["latency_ms"], **kw)
                axes[i][n_r + j].plot(s["experts_per_rank"], s["speedup"], **kw)
            panels = (
                (axes[i][j], "latency (ms), lower is better"),
                (axes[i][n_r + j], "speedup vs serial, higher is better"),
            )
            for ax, what in panels:
                ax.set_xscale("log", base=2)
                ax.set_title(f"T={tpr} H={h} {routing}", fontsize=8)
                ax.set_ylabel(what, fontsize=8)
                ax.tick_params(labelsize=7)
            axes[i][j].set_yscale("log")
            axes[i][j].yaxis.set_major_formatter(ScalarFormatter())
            axes[i][j].yaxis.set_minor_formatter(NullFormatter())
            axes[i][n_r + j].axhline(1.0, color="k", lw=0.8)
    for ax in axes[-1]:
        ax.set_xlabel("experts per rank", fontsize=8)
    handles, labels_ = axes[0][0].get_legend_handles_labels()
    fig.legend(handles, labels_, fontsize=8, loc="upper center", ncol=min(len(lines), 7),
               bbox_to_anchor=(0.5, 1.01))  # fmt: skip
    fig.suptitle(
        f"The MoE layer (scope layer): latency and speedup against serial\n{transport_note(df)}",
        fontsize=9,
        y=1.04,
    )
    return save(fig, out_dir, name)


if __name__ == "__main__":
    main(plot, "results/layer.parquet", "layer")
