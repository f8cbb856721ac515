"""The overlap system's kept knobs at operator scope: per (N, routing) panel, one line per
variant (layout, order, cCTA and mgb off the defaults) against experts per rank: latency(serial)
/ latency(variant), higher is better; without serial rows the latency, lower is better."""

from __future__ import annotations

from pathlib import Path

import pandas as pd

from plots.common import WORKLOAD, _col, against, load, main, panel_grid, save, transport_note


def _knob(v) -> str:
    """A knob as asked, for a label: 16.0 -> "16" (parquet may store ints as floats), "auto"."""
    try:
        f = float(v)
    except (TypeError, ValueError):
        return str(v)
    return str(int(f)) if f.is_integer() else str(v)


def variant(o: pd.DataFrame) -> pd.Series:
    """Per overlap row: "layout[/order][, cCTA c, mgb m]" ("aligned", "compact/expert")."""
    v = _col(o, "p_layout").fillna("aligned").astype(str)
    if "p_order" in o:  # the producer's visiting order, where not the paper's
        other = o["p_order"].fillna("remote_first") != "remote_first"
        v[other] = v[other] + "/" + o.loc[other, "p_order"].astype(str)
    if "p_ccta" in o and "p_mgb" in o:  # cCTA and mgb as asked, where not the defaults (16, 1)
        ccta, mgb = o["p_ccta"].map(_knob), o["p_mgb"].map(_knob)
        other = (ccta != "16") | (mgb != "1")
        v[other] = v[other] + ", cCTA " + ccta[other] + ", mgb " + mgb[other]
    return v


def speedups(df: pd.DataFrame) -> pd.DataFrame:
    """One row per (workload, variant): latency_ms (median), and serial_ms and speedup where
    the table has serial rows (NaN where not)."""
    over = df["system"] == "overlap"
    if not over.any():
        raise ValueError("a variants table needs ok overlap rows")
    df = df.assign(variant="").astype({"variant": object})
    df.loc[over, "variant"] = variant(df[over])
    out = against(df, WORKLOAD, ["system", "variant"], agg="median")
    return out[out["system"] == "overlap"].rename(columns={"ref_ms": "serial_ms"})


def plot(table: str | Path, out_dir: str | Path, name: str) -> list[Path]:
    df = load(table)
    sp = speedups(df)
    serial = sp["speedup"].notna().any()
    y, what = ("speedup", "speedup vs serial (higher is better)") if serial else (
        "latency_ms", "latency, ms (lower is better)")  # fmt: skip
    title = f"The overlap system's variants (scope gemm+combine)\n{transport_note(df)}"
    fig = panel_grid(sp, "variant", y, what, title, hlines=(1.0,) if serial else ())
    return save(fig, out_dir, name)


if __name__ == "__main__":
    main(plot, "results/operator_order.parquet", "variants")
