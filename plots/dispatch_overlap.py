"""dispatch_overlap (experiment dispatch_overlap): how much of the layer's dispatch copy fc1
hides, one GPU playing W ranks (loopback: a development proxy, never an interconnect number).

Three panels against W, the median over E and routing, one line per (setting, layout, H):
the copy + fc1 phase as run over max(copy alone, fc1 alone) (m_dispatch_fc1_ms over
m_dispatch_alone_ms and m_fc1_alone_ms; 1 = fully hidden, lower is better, the target 1.05
drawn); the share of the copy hidden, (copy + fc1 - phase) / copy (m_dispatch_hidden, higher is
better); the layer's latency with the setting on over off in the same cell (lower is better).
"""

from __future__ import annotations

from pathlib import Path

import pandas as pd

from plots import common as pc
from plots.layer_loopback import _lines

TARGET = 1.05  # the bound on the phase: 1.05 x max(copy alone, fc1 alone)


def _with_lines(ok: pd.DataFrame) -> pd.DataFrame:
    lay = pc._col(ok, "p_layout").fillna("aligned")
    h = ok["hidden"].map(lambda v: f" H={int(v)}")
    ratio = ok["m_dispatch_fc1_ms"] / ok[["m_dispatch_alone_ms", "m_fc1_alone_ms"]].max(axis=1)
    return ok.assign(layout=lay, shape=lay + h, phase=ratio,
                     line=ok["p_dispatch_overlap_used"] + ": " + lay + h)  # fmt: skip


def on_over_off(ok: pd.DataFrame) -> pd.DataFrame:
    """Per cell with both settings: latency on / off (column `value`), `line` = layout + H."""
    cell = ["world_size", "hidden", "experts_per_rank", "routing", "layout", "shape"]
    p = ok.pivot_table(index=cell, columns="p_dispatch_overlap_used", values="latency_ms")
    p = p.dropna(subset=[c for c in ("on", "off") if c in p]).reset_index()
    if not {"on", "off"} <= set(p.columns):
        return pd.DataFrame(columns=[*cell, "value", "line"])
    return p.assign(value=p["on"] / p["off"], line=p["shape"])


def plot(table: str | Path, out_dir: str | Path, name: str) -> list[Path]:
    every = pc.load(table, status=None)
    every = every[every["system"] == "overlap"]
    ok = every[(every["status"] == "ok") & every["m_dispatch_fc1_ms"].notna()]
    if ok.empty:
        raise ValueError(f"{table}: no ok overlap rows with the dispatch bounds to plot")
    ok = _with_lines(ok)
    fig, axes = pc.grid(1, 3, w=3.8, h=3.2)
    ax = axes[0][0]
    _lines(ax, ok, "phase", "line")
    ax.axhline(TARGET, color="k", lw=0.8, ls="--", label=f"target {TARGET}")
    ax.axhline(1.0, color="k", lw=0.5, ls=":")
    ax.legend(fontsize=6)
    ax.set_title("copy + fc1 / max(copy, fc1 alone) (lower is better)", fontsize=8)
    ax = axes[0][1]
    on = ok[ok["p_dispatch_overlap_used"] == "on"]
    if not on.empty:
        _lines(ax, on.assign(line=on["shape"]), "m_dispatch_hidden", "line")
    ax.set_ylim(-0.05, 1.05)
    ax.set_title("share of the copy hidden, on (higher is better)", fontsize=8)
    ax = axes[0][2]
    rel = on_over_off(ok)
    if not rel.empty:
        _lines(ax, rel, "value", "line")
    ax.axhline(1.0, color="k", lw=0.5, ls=":")
    ax.set_title("layer latency, on / off (lower is better)", fontsize=8)
    n_ok, n = int((every["status"] == "ok").sum()), len(every)
    title = (f"dispatch_overlap: the dispatch copy behind fc1, one GPU playing W ranks "
             f"(loopback proxy); {n_ok} of {n} cells pass both checks\n"
             f"{pc.transport_note(every)}")  # fmt: skip
    return pc.save(fig, out_dir, name, title)


if __name__ == "__main__":
    pc.main(plot, "results/dispatch_overlap.parquet", "dispatch_overlap")
