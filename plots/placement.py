"""Where the consumer runs (the overlap system's `consumer`: own SMs, the paper's, or shared
with the producer): the overlapped step divided by compute on ALL SMs (the producer alone, no
consumer; the row's compute_ms) against experts per rank, one panel per (N, routing), one line
per placement ("own:16", "shared:132", "own:auto", ":b<ns>" with a poll backoff). 1.0 is the
compute bound; the dashed line is issue 12's 1.05x target (there the combine alone is shorter
than the compute, so max(C, M) = C)."""

from __future__ import annotations

from pathlib import Path

import matplotlib.pyplot as plt

from plots.common import cli, load, placements, save, transport_note


def plot(table: str | Path, out_dir: str | Path, name: str) -> list[Path]:
    o = placements(load(table, status=None))
    if o.empty:
        raise ValueError(f"{table}: no ok overlap rows")
    o["x_compute"] = o["latency_ms"] / o["compute_ms"]
    ns, routings = sorted(o["out"].unique()), sorted(o["routing"].unique())
    fig, axes = plt.subplots(
        len(ns), len(routings), figsize=(3.6 * len(routings), 2.9 * len(ns)), squeeze=False
    )
    names = sorted(o["placement"].unique())
    for i, n in enumerate(ns):
        for j, routing in enumerate(routings):
            ax = axes[i][j]
            sub = o[(o["out"] == n) & (o["routing"] == routing)]
            for k, pl in enumerate(names):
                s = sub[sub["placement"] == pl].groupby("experts_per_rank")["x_compute"].median()
                ax.plot(s.index, s.values, marker="o", ms=3, label=pl, color=f"C{k}")
            ax.axhline(1.0, color="k", lw=0.8)
            ax.axhline(1.05, color="k", lw=0.8, ls="--")
            ax.set_xscale("log", base=2)
            ax.set_title(f"N={n} {routing}", fontsize=8)
            ax.set_ylabel("step / compute on all SMs (lower is better)", fontsize=8)
            ax.tick_params(labelsize=7)
    for ax in axes[-1]:
        ax.set_xlabel("experts per rank", fontsize=8)
    handles, labels_ = axes[0][0].get_legend_handles_labels()
    fig.legend(handles, labels_, fontsize=8, loc="upper center", ncol=len(names),
               bbox_to_anchor=(0.5, -0.02), title="consumer:cCTA", title_fontsize=8)  # fmt: skip
    fig.suptitle(
        f"The overlapped step per consumer placement\n{transport_note(o)}", fontsize=9, y=1.04
    )
    fig.tight_layout()
    return save(fig, out_dir, name)


if __name__ == "__main__":
    args = cli("results/operator_consumer_x2.parquet", "placement")
    for p in plot(args.table, args.out, args.name):
        print(p)
