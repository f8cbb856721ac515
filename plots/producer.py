"""The producer against torch._grouped_mm and cuBLAS: per (N, routing) panel, time(reference) /
time(producer) against experts per rank, one line per producer variant; above 1 the producer is
faster. Solid: torch._grouped_mm on the same valid rows; dashed: one dense cuBLAS GEMM of the same
useful FLOPs; dotted: torch.bmm of E x (R // E) rows, the same FLOPs and E x K x N weight bytes."""

from __future__ import annotations

from pathlib import Path

import pandas as pd

from plots.common import WORKLOAD, load, main, panel_grid, save


def ratios(df: pd.DataFrame) -> pd.DataFrame:
    """One row per (workload, producer variant): producer_ms and vs_grouped_mm, vs_cublas,
    vs_bmm = t(reference) / t(producer) (NaN where the table lacks the reference)."""
    ok = df[df["status"] == "ok"] if "status" in df else df
    prod = ok[ok["system"] == "overlap"].copy()
    if prod.empty:
        raise ValueError("no ok producer (system overlap) rows")
    tile_m = "tile_m " + prod["p_tile_m"].astype(int).astype(str)
    prod["variant"] = tile_m + ", " + prod["p_layout"].astype(str)
    if "p_order" in prod:  # the visiting order, where not the paper's
        other = prod["p_order"].fillna("remote_first") != "remote_first"
        prod.loc[other, "variant"] += ", " + prod.loc[other, "p_order"].astype(str) + " order"
    if "p_flags" in prod:
        prod.loc[~prod["p_flags"].astype(bool), "variant"] += ", no flags"
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


def _references(ax, s: pd.DataFrame, style: dict) -> None:
    for col, ls in (("vs_cublas", "--"), ("vs_bmm", ":")):
        m = s.groupby("experts_per_rank")[col].median()
        if m.notna().any():
            ax.plot(m.index, m.values, ls=ls, **style)


def plot(table: str | Path, out_dir: str | Path, name: str) -> list[Path]:
    df = load(table, status=None)
    gpu = ", ".join(sorted(set(df.get("gpu_name", pd.Series(dtype=str)).dropna().astype(str))))
    title = (
        "The expert GEMM (producer) alone on all SMs, higher is better\nt(reference) / "
        f"t(producer): solid vs torch._grouped_mm, dashed vs dense cuBLAS, dotted vs batched "
        f"cuBLAS; {gpu or '?'}"
    )
    fig = panel_grid(ratios(df), "variant", "vs_grouped_mm", "t(reference) / t(producer)", title,
                     extra=_references)  # fmt: skip
    return save(fig, out_dir, name)


if __name__ == "__main__":
    main(plot, "results/producer.parquet", "producer")
