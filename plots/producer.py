"""The producer against torch._grouped_mm (CUTLASS) and cuBLAS, from an experiment=producer
table: per (N, routing) panel, time(reference) / time(producer) against experts per rank, one
line per producer variant (tile_m, layout, visiting order, tile-configuration variant, flags,
where the local rows go).
Above 1: the producer is faster. Solid: against torch._grouped_mm on the same valid rows;
dashed: against one dense cuBLAS GEMM of the same useful FLOPs (the method-speed issue asks
for >= 1.00 and >= 1/1.05); dotted, where the table has it: against one batched cuBLAS GEMM
(torch.bmm) of E x (R // E) rows, the same FLOPs and the same E x K x N weight bytes.
"""

from __future__ import annotations

from pathlib import Path

import matplotlib.pyplot as plt
import pandas as pd

from plots.common import cli, load, save

WORKLOAD = ["world_size", "tokens_per_rank", "hidden", "out", "experts_per_rank", "routing"]


def ratios(df: pd.DataFrame) -> pd.DataFrame:
    """One row per (workload, producer variant): producer_ms, vs_grouped_mm, vs_cublas, vs_bmm
    (time of the reference / time of the producer, same table; NaN where the table lacks the
    reference)."""
    ok = df[df["status"] == "ok"] if "status" in df else df
    prod = ok[ok["system"] == "overlap"].copy()
    if prod.empty:
        raise ValueError("no ok producer (system overlap) rows")
    prod["variant"] = (
        "tile_m " + prod["p_tile_m"].astype(int).astype(str) + ", " + prod["p_layout"].astype(str)
    )
    if "p_order" in prod:  # the visiting order, where not the paper's
        other = prod["p_order"].fillna("remote_first") != "remote_first"
        prod.loc[other, "variant"] += ", " + prod.loc[other, "p_order"].astype(str) + " order"
    if "p_config" in prod:  # a tile-configuration variant, where not the table's
        other = prod["p_config"].fillna("table") != "table"
        prod.loc[other, "variant"] += ", " + prod.loc[other, "p_config"].astype(str)
    if "p_flags" in prod:
        prod.loc[~prod["p_flags"].astype(bool), "variant"] += ", no flags"
    if "p_local" in prod:  # local rows stored in the receive buffer (the system's default)
        direct = prod["p_local"].fillna("copy") == "direct"
        prod.loc[direct, "variant"] += ", local direct"
    out = prod[WORKLOAD + ["variant", "latency_ms"]].rename(columns={"latency_ms": "producer_ms"})
    refs = {"torch_grouped_mm": "vs_grouped_mm", "cublas": "vs_cublas", "cublas_bmm": "vs_bmm"}
    for ref, col in refs.items():
        r = ok[ok["system"] == ref].groupby(WORKLOAD, as_index=False)["latency_ms"].median()
        if r.empty:  # tables from before this reference
            out[col] = float("nan")
            continue
        out = out.merge(r.rename(columns={"latency_ms": col}), on=WORKLOAD, how="left")
        out[col] = out[col] / out["producer_ms"]
    return out


def plot(table: str | Path, out_dir: str | Path, name: str) -> list[Path]:
    df = load(table, status=None)
    r = ratios(df)
    ns, routings = sorted(r["out"].unique()), sorted(r["routing"].unique())
    fig, axes = plt.subplots(
        len(ns), len(routings), figsize=(3.6 * len(routings), 2.9 * len(ns)), squeeze=False
    )
    variants = sorted(r["variant"].unique())
    for i, n in enumerate(ns):
        for j, routing in enumerate(routings):
            ax = axes[i][j]
            sub = r[(r["out"] == n) & (r["routing"] == routing)]
            for k, v in enumerate(variants):
                s = sub[sub["variant"] == v].sort_values("experts_per_rank")
                kw = dict(marker="o", ms=3, color=plt.cm.tab20(k % 20))
                ax.plot(s["experts_per_rank"], s["vs_grouped_mm"], label=v, **kw)
                ax.plot(s["experts_per_rank"], s["vs_cublas"], ls="--", **kw)
                if s["vs_bmm"].notna().any():
                    ax.plot(s["experts_per_rank"], s["vs_bmm"], ls=":", **kw)
            ax.axhline(1.0, color="k", lw=0.8)
            ax.set_xscale("log", base=2)
            ax.set_title(f"N={n} {routing}", fontsize=8)
            ax.set_ylabel("t(reference) / t(producer), higher is better", fontsize=8)
            ax.tick_params(labelsize=7)
    for ax in axes[-1]:
        ax.set_xlabel("experts per rank", fontsize=8)
    handles, labels_ = axes[0][0].get_legend_handles_labels()
    fig.legend(handles, labels_, fontsize=7, loc="upper center", ncol=min(len(variants), 4),
               bbox_to_anchor=(0.5, 1.01))  # fmt: skip
    gpu = ", ".join(sorted(set(df.get("gpu_name", pd.Series(dtype=str)).dropna().astype(str))))
    fig.suptitle(
        "The producer alone on all SMs: solid vs torch._grouped_mm, dashed vs dense cuBLAS,"
        " dotted vs batched cuBLAS (same weight bytes)\n"
        f"{gpu or '?'}",
        fontsize=9,
        y=1.06,
    )
    return save(fig, out_dir, name)


if __name__ == "__main__":
    args = cli("results/producer.parquet", "producer")
    for p in plot(args.table, args.out, args.name):
        print(p)
