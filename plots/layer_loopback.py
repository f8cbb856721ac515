"""The overlap layer with one GPU playing W ranks (experiment layer_loopback), three panels
against W, lower is better: the worst error over the cells per layout and check, with their
tolerances; the worst-case receive buffer per H; the latency per (layout, H), median over E and
routing: a loopback proxy (the W ranks' steps in turn on one GPU), never an interconnect number."""

from __future__ import annotations

from pathlib import Path

import pandas as pd

from harness.check import DEFAULT_TOL, ROW_TOL_FACTOR
from plots import common as pc

ERRORS = {"max_rel_err": "relative Frobenius", "max_row_rel_err": "worst row"}


def errors(df: pd.DataFrame) -> pd.DataFrame:
    """One row per (W, layout, check): the worst error recorded over the cells (any status),
    `line` = "<layout>: <check>"."""
    d = df.assign(layout=pc._col(df, "p_layout").fillna("aligned"))
    long = d.melt(id_vars=["world_size", "layout"], value_vars=list(ERRORS), var_name="check")
    long = long.dropna(subset=["value"])
    out = long.groupby(["world_size", "layout", "check"], as_index=False)["value"].max()
    return out.assign(line=out["layout"] + ": " + out["check"].map(ERRORS))


def _lines(ax, d: pd.DataFrame, y: str, line: str, title: str) -> None:
    """Per value of `line`, the median of `y` against W (log2 x, log y)."""
    colors = pc.palette(d[line])
    for v, s in d.groupby(line):
        m = s.groupby("world_size")[y].median()
        compact = "compact" in str(v)  # drawn dashed: its points may sit on the aligned ones
        style = dict(marker="x" if compact else "o", ls="--" if compact else "-", ms=4)
        ax.plot(m.index, m.values, color=colors[v], label=v, **style)
    ax.set_xscale("log", base=2)
    ws = sorted(d["world_size"].unique())
    ax.set_xticks(ws, [str(int(w)) for w in ws])
    ax.set_yscale("log")
    ax.set_title(title, fontsize=8)
    ax.set_xlabel("W (ranks played by one GPU)", fontsize=8)
    ax.tick_params(which="both", labelsize=7)
    ax.legend(fontsize=6)


def plot(table: str | Path, out_dir: str | Path, name: str) -> list[Path]:
    every = pc.load(table, status=None)
    every = every[every["system"] == "overlap"]
    ok = pc.need(every[every["status"] == "ok"], table, "ok overlap rows to plot")
    fig, ((ax_err, ax_mem, ax_lat),) = pc.grid(1, 3, w=3.8, h=3.2)
    _lines(ax_err, errors(every), "value", "line", "worst error over the cells (lower is better)")
    tol = float(every["tol"].max()) if "tol" in every else DEFAULT_TOL
    for bound, ls, what in ((tol, "--", "tolerance"), (ROW_TOL_FACTOR * tol, ":", "row tolerance")):
        ax_err.axhline(bound, color="k", lw=0.8, ls=ls, label=f"{what} {bound:.0e}")
    ax_err.legend(fontsize=6, loc="center right")
    mem = ok.assign(H=ok["hidden"].map(lambda h: f"H={int(h)}"))
    _lines(ax_mem, mem, "m_recv_worst_mib", "H", "worst-case receive memory (MiB)")
    lat = ok.assign(line=ok["p_layout"].fillna("aligned") + ok["hidden"].map(lambda h: f" H={h}"))
    what = "latency (ms): loopback proxy, not an interconnect number"
    _lines(ax_lat, lat, "latency_ms", "line", what)
    ax_lat.set_ylabel("median over E and routing (lower is better)", fontsize=7)
    title = (f"The overlap layer, one GPU playing W ranks (loopback): {len(ok)} of {len(every)} "
             f"cells pass both checks\n{pc.transport_note(every)}")  # fmt: skip
    return pc.save(fig, out_dir, name, title)


if __name__ == "__main__":
    pc.main(plot, "results/layer_loopback.parquet", "layer_loopback")
