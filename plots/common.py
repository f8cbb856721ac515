"""Shared plot helpers: read a results table, label systems from the registry, save PNG + PDF."""

from __future__ import annotations

import argparse
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import pandas as pd  # noqa: E402

FIG_DIR = Path("plots/figures")


def label(system: str) -> str:
    """Display label of a system, from the registry (never hard-coded here)."""
    from harness.system import registry

    info = registry().get(system)
    return info.label if info else system


def overlap_variant(df: pd.DataFrame) -> pd.Series:
    """Per row, the overlap system's knobs that make it another line: the transport, then
    `local copy` (p_local copy, or missing: tables from before the knob ran copy) and `packed`
    (p_layout) and `expert order` (p_order) and `swizzle <s>` (p_swizzle) and `shared SMs, cCTA
    <c>` (p_consumer shared) and `backoff <n> ns` (p_backoff_ns) where they differ from today's
    defaults; "" for every other system."""
    n = len(df)
    tr = df["transport"].fillna("").astype(str) if "transport" in df else pd.Series([""] * n)
    local = df["p_local"] if "p_local" in df else pd.Series([None] * n, index=df.index)
    layout = df["p_layout"] if "p_layout" in df else pd.Series([None] * n, index=df.index)
    order = df["p_order"] if "p_order" in df else pd.Series([None] * n, index=df.index)
    swz = df["p_swizzle"] if "p_swizzle" in df else pd.Series([None] * n, index=df.index)
    cons = df["p_consumer"] if "p_consumer" in df else pd.Series([None] * n, index=df.index)
    ccta = df["p_ccta"] if "p_ccta" in df else pd.Series([None] * n, index=df.index)
    back = df["p_backoff_ns"] if "p_backoff_ns" in df else pd.Series([None] * n, index=df.index)
    out = []
    for s, t, lo, la, od, sw, co, cc, bo in zip(
        df["system"], tr, local, layout, order, swz, cons, ccta, back
    ):
        if s != "overlap":
            out.append("")
            continue
        parts = [t] if t else []
        if pd.isna(lo) or lo == "copy":
            parts.append("local copy")
        if isinstance(la, str) and la != "aligned":
            parts.append(la)
        if isinstance(od, str) and od != "remote_first":
            parts.append(f"{od} order")
        if isinstance(sw, str) and sw != "table":
            parts.append(f"swizzle {sw}")
        if co == "shared":
            parts.append(f"shared SMs, cCTA {cc}")
        if not pd.isna(bo) and int(bo):
            parts.append(f"backoff {int(bo)} ns")
        out.append(", ".join(parts))
    return pd.Series(out, index=df.index, dtype=object)


def line_label(df: pd.DataFrame) -> pd.Series:
    """Per row, the plotted line: the system's label, the overlap system with its variant
    ("Overlap (ours) (p2p, local copy)"); never a best-of over variants."""
    var = overlap_variant(df)
    return pd.Series(
        [f"{label(s)} ({v})" if v else label(s) for s, v in zip(df["system"], var)],
        index=df.index,
        dtype=object,
    )


def placements(df: pd.DataFrame) -> pd.DataFrame:
    """The ok overlap rows with a `placement` column: "<consumer>:<ccta asked>" ("own:auto"
    where the auto pick chose per cell), plus ":b<ns>" where the consumer slept between its
    polls (p_backoff_ns); tables from before the `consumer` knob are "own"."""
    ok = df[(df["status"] == "ok") & (df["system"] == "overlap")].copy()
    if ok.empty:
        return ok.assign(placement=pd.Series(dtype=object))
    consumer = ok["p_consumer"] if "p_consumer" in ok else pd.Series("own", index=ok.index)
    ccta = ok["p_ccta_used"].astype(int).astype(str)
    if "p_ccta" in ok:
        ccta = ok["p_ccta"].where(ok["p_ccta"].astype(str) == "auto", ccta).astype(str)
    ok["placement"] = consumer.fillna("own").astype(str) + ":" + ccta
    if "p_backoff_ns" in ok:
        ns = pd.to_numeric(ok["p_backoff_ns"], errors="coerce").fillna(0).astype(int)
        ok["placement"] += ns.map(lambda v: f":b{v}" if v else "")
    return ok


def load(table: str | Path, status: str | None = "ok") -> pd.DataFrame:
    df = pd.read_parquet(table)
    if status is not None:
        df = df[df["status"] == status]
    return df


def save(fig: plt.Figure, out_dir: str | Path, name: str) -> list[Path]:
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = [out / f"{name}.png", out / f"{name}.pdf"]
    for p in paths:
        fig.savefig(p, bbox_inches="tight", dpi=150)
    plt.close(fig)
    return paths


def transport_note(df: pd.DataFrame) -> str:
    """A caption fragment naming the transports and hardware, so proxies are never mistaken."""
    tr = ", ".join(sorted(set(df["transport"].dropna().astype(str)) - {""})) or "?"
    gpu = ", ".join(sorted(set(df["gpu_name"].dropna().astype(str)))) or "?"
    w = ", ".join(str(int(v)) for v in sorted(set(df["world_size"].dropna())))
    return f"transport: {tr}; W={w}; {gpu}"


def cli(default_table: str, default_name: str) -> argparse.Namespace:
    ap = argparse.ArgumentParser()
    ap.add_argument("--table", default=default_table)
    ap.add_argument("--out", default=str(FIG_DIR))
    ap.add_argument("--name", default=default_name)
    return ap.parse_args()
