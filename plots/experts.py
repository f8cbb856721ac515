"""Fig 5: the overlap system against every other system as experts per rank grow (4 to 64):
latency(system) / latency(overlap) of the layer rows (ffn > 0), higher is better, one line per
system, one panel per routing. A layer row has no overlap ratio (harness.measure.LAYER_RATIO_NOTE),
so the ratio panel below reads the operator-scope rows (ffn 0: the layer's fc2, K=F, N=H) of
`experiment=experts_operator`. Systems without an ok row are named in the caption with why."""

from __future__ import annotations

from pathlib import Path

import pandas as pd

from plots import common as pc
from plots.common import against, grid, label, main, need, prefer_graph, save, transport_note

#: what the operator pass runs, for the caption when it is missing
OPERATOR_PASS = "python -m harness.run experiment=experts_operator"


def _ffn(df: pd.DataFrame) -> pd.Series:
    return df["ffn"].fillna(0) if "ffn" in df else pd.Series(0, index=df.index)


def speedups(df: pd.DataFrame) -> pd.DataFrame:
    """Per layer workload and other system: latency(system) / latency(overlap) (ok rows)."""
    out = against(df[(df["status"] == "ok") & (_ffn(df) > 0)], pc.WORKLOAD, ["system"], "overlap")
    out = out[(out["system"] != "overlap") & out["ref_ms"].notna()]
    return out.assign(speedup=out["latency_ms"] / out["ref_ms"])


def ratios(df: pd.DataFrame) -> pd.DataFrame:
    """The overlap system's overlap ratio per operator-scope workload (ok rows, ffn 0)."""
    ok = df[(df["status"] == "ok") & (_ffn(df) == 0) & (df["system"] == "overlap")]
    return ok.dropna(subset=["overlap_ratio"])[pc.WORKLOAD + ["overlap_ratio"]]


def missing_systems(df: pd.DataFrame) -> dict[str, str]:
    """Systems of the layer rows without an ok row -> the first reason they were not measured."""
    layer = df[_ffn(df) > 0]
    ok = set(layer.loc[layer["status"] == "ok", "system"])
    absent = layer[~layer["system"].isin(ok)]
    return {s: str(g["reason"].iloc[0])[:80] for s, g in absent.groupby("system")}


def plot(table: str | Path, out_dir: str | Path, name: str) -> list[Path]:
    df = prefer_graph(pd.read_parquet(table), table)
    sp, ra = speedups(df), ratios(df)
    need(sp, table, "layer workload with an ok overlap row and another system")
    routings = sorted(sp["routing"].unique())
    es = sorted(int(e) for e in sp["experts_per_rank"].unique())
    fig, axes = grid(2, len(routings), 4.8, 3.5)
    for i, routing in enumerate(routings):
        ax, ax2 = axes[0][i], axes[1][i]
        for (system, h), s in sp[sp["routing"] == routing].groupby(["system", "hidden"]):
            s = s.sort_values("experts_per_rank")
            ax.plot(s["experts_per_rank"], s["speedup"], "o-", ms=3, label=f"{label(system)} H={h}")
        ax.axhline(1.0, color="k", lw=0.8)
        ax.set_ylabel("speedup of overlap vs system (higher is better)")
        ax.set_title(f"layer, {routing}", fontsize=9)
        r = ra[ra["routing"] == routing]
        for (k, n), s in r.groupby(["hidden", "out"]):
            s = s.sort_values("experts_per_rank")
            ax2.plot(s["experts_per_rank"], s["overlap_ratio"], "o-", label=f"operator K={k} N={n}")
        if r.empty:
            msg = f"no operator-scope rows:\n{OPERATOR_PASS}"
            ax2.text(0.5, 0.5, msg, ha="center", va="center", fontsize=7, transform=ax2.transAxes)
        ax2.set(ylabel="overlap ratio, unclipped (higher is better)")
        for a in (ax, ax2):
            a.set_xscale("log", base=2)
            a.set_xticks(es, [str(e) for e in es])
            a.set_xlabel("experts per rank")
            if a.get_legend_handles_labels()[0]:
                a.legend(fontsize=6)
    note = "; ".join(f"{s}: {why}" for s, why in missing_systems(df).items())
    layer = df[(df["status"] == "ok") & (_ffn(df) > 0)]
    title = (
        "Fig 5: overlap against every system per experts per rank (whole layer, F="
        f"{int(layer['ffn'].iloc[0])}); overlap ratio from the operator-scope rows\n"
        f"{transport_note(layer)}" + (f"\nnot measured: {note}" if note else "")
    )
    return save(fig, out_dir, name, title)


if __name__ == "__main__":
    main(plot, "results/experts.parquet", "experts")
