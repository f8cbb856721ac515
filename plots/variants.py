"""The overlap system's variants at operator scope (gemm+combine): speedup against serial per
experts per rank, one panel per (N, routing), one line per variant (local copy | direct x layout
aligned | packed, order remote_first | expert), serial measured in the same table.

speedup = latency(serial) / latency(variant) on the same workload. Rows without p_local ran
`copy` (tables from before the knob); without p_layout, `aligned`; without p_order,
`remote_first`.
"""

from __future__ import annotations

from pathlib import Path

import matplotlib.pyplot as plt
import pandas as pd

from plots.common import cli, load, save, transport_note

WORKLOAD = ["world_size", "tokens_per_rank", "hidden", "out", "experts_per_rank", "routing"]


def _knob(v) -> str:
    """A knob as asked, for a label: 16.0 -> "16" (parquet may store ints as floats), "auto"."""
    try:
        f = float(v)
    except (TypeError, ValueError):
        return str(v)
    return str(int(f)) if f.is_integer() else str(v)


def speedups(df: pd.DataFrame) -> pd.DataFrame:
    """One row per (workload, variant): latency_ms, serial_ms and speedup; variant is
    "local/layout" (e.g. "direct/aligned"), "/expert" after it for order=expert, plus the
    cCTA and mgb asked where they are not the defaults ("direct/aligned, cCTA auto, mgb auto")."""
    o = df[df["system"] == "overlap"].copy()
    if o.empty or "serial" not in set(df["system"]):
        raise ValueError("a variants table needs ok overlap and serial rows")
    local = o["p_local"] if "p_local" in o else pd.Series(None, index=o.index, dtype=object)
    layout = o["p_layout"] if "p_layout" in o else pd.Series(None, index=o.index, dtype=object)
    o["variant"] = local.fillna("copy").astype(str) + "/" + layout.fillna("aligned").astype(str)
    if "p_order" in o:  # the producer's visiting order, where not the paper's
        other = o["p_order"].fillna("remote_first") != "remote_first"
        o.loc[other, "variant"] = o.loc[other, "variant"] + "/" + o.loc[other, "p_order"]
    if "p_ccta" in o and "p_mgb" in o:  # cCTA and mgb as asked, where not the defaults (16, 1)
        ccta, mgb = o["p_ccta"].map(_knob), o["p_mgb"].map(_knob)
        knobs = "cCTA " + ccta + ", mgb " + mgb
        other = (ccta != "16") | (mgb != "1")
        o.loc[other, "variant"] = o.loc[other, "variant"] + ", " + knobs[other]
    lat = o.groupby(WORKLOAD + ["variant"], as_index=False)["latency_ms"].median()
    ser = df[df["system"] == "serial"].groupby(WORKLOAD, as_index=False)["latency_ms"].median()
    out = lat.merge(ser.rename(columns={"latency_ms": "serial_ms"}), on=WORKLOAD)
    out["speedup"] = out["serial_ms"] / out["latency_ms"]
    return out


def plot(table: str | Path, out_dir: str | Path, name: str) -> list[Path]:
    df = load(table)
    sp = speedups(df)
    ns, routings = sorted(sp["out"].unique()), sorted(sp["routing"].unique())
    fig, axes = plt.subplots(
        len(ns), len(routings), figsize=(3.6 * len(routings), 2.9 * len(ns)), squeeze=False
    )
    variants = sorted(sp["variant"].unique())
    for i, n in enumerate(ns):
        for j, routing in enumerate(routings):
            ax = axes[i][j]
            sub = sp[(sp["out"] == n) & (sp["routing"] == routing)]
            for k, v in enumerate(variants):
                s = sub[sub["variant"] == v].sort_values("experts_per_rank")
                ax.plot(s["experts_per_rank"], s["speedup"], marker="o", ms=3, label=v,
                        color=f"C{k}")  # fmt: skip
            ax.axhline(1.0, color="k", lw=0.8)
            ax.set_xscale("log", base=2)
            ax.set_title(f"N={n} {routing}", fontsize=8)
            ax.set_ylabel("speedup vs serial (higher is better)", fontsize=8)
            ax.tick_params(labelsize=7)
    for ax in axes[-1]:
        ax.set_xlabel("experts per rank", fontsize=8)
    handles, labels_ = axes[0][0].get_legend_handles_labels()
    fig.legend(handles, labels_, fontsize=8, loc="upper center", ncol=len(variants),
               bbox_to_anchor=(0.5, 1.01), title="local/layout[/order]",
               title_fontsize=8)  # fmt: skip
    fig.suptitle(
        f"The overlap system's variants (scope gemm+combine) against serial\n{transport_note(df)}",
        fontsize=9,
        y=1.06,
    )
    return save(fig, out_dir, name)


if __name__ == "__main__":
    args = cli("results/variants.parquet", "variants")
    for p in plot(args.table, args.out, args.name):
        print(p)
