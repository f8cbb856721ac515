"""Shared plot helpers: read a results table (without the rows of retired variants), label
systems from the registry and the overlap system's kept knobs, lay out panels, save PNG + PDF."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import pandas as pd  # noqa: E402

FIG_DIR = Path("plots/figures")
#: column -> the values a row may hold and still be a kept variant (rows of committed tables
#: that ran a retired variant are left out of every figure and of the report)
KEPT = {
    "p_layout": {"aligned", "compact"},
    "p_local": {"direct"},
    "p_swizzle": {"table"},
    "p_config": {"table"},
}


def label(system: str) -> str:
    """Display label of a system, from the registry (never hard-coded here)."""
    from harness.system import registry

    info = registry().get(system)
    return info.label if info else system


def kept(df: pd.DataFrame) -> pd.DataFrame:
    """The rows of kept variants. A missing p_local in a table that has the column ran `copy`
    (the knob's hash-optional default then); p_backoff_ns must be 0 where present."""
    over = df["system"] == "overlap" if "system" in df else pd.Series(True, index=df.index)
    keep = pd.Series(True, index=df.index)
    for col, values in KEPT.items():
        if col in df:
            v = df[col]
            keep &= v.isin(values) | (v.isna() & (col != "p_local")) | ~over
    if "p_backoff_ns" in df:
        keep &= (pd.to_numeric(df["p_backoff_ns"], errors="coerce").fillna(0) == 0) | ~over
    return df[keep]


def _col(df: pd.DataFrame, name: str) -> pd.Series:
    return df[name] if name in df else pd.Series(None, index=df.index, dtype=object)


def overlap_variant(df: pd.DataFrame) -> pd.Series:
    """Per row, the overlap system's kept knobs that make it another line where they differ
    from the defaults: the transport, the layout (compact), the order (expert, or what auto
    chose), the consumer (`shared SMs, cCTA <c>`); "" for every other system."""
    tr = _col(df, "transport").fillna("").astype(str)
    out = []
    for s, t, la, od, co, cc in zip(
        df["system"], tr, _col(df, "p_layout"), _col(df, "p_order"), _col(df, "p_consumer"),
        _col(df, "p_ccta"),
    ):  # fmt: skip
        parts = [t] if t else []
        if isinstance(la, str) and la != "aligned":
            parts.append(la)
        if isinstance(od, str) and od not in ("remote_first", "auto"):
            parts.append(f"{od} order")
        if co == "shared":
            parts.append(f"shared SMs, cCTA {cc}")
        out.append(", ".join(parts) if s == "overlap" else "")
    return pd.Series(out, index=df.index, dtype=object)


def line_label(df: pd.DataFrame) -> pd.Series:
    """Per row, the plotted line: the system's label, the overlap system with its variant
    ("Overlap (ours) (p2p, compact)"); never a best-of over variants."""
    var = overlap_variant(df)
    return pd.Series(
        [f"{label(s)} ({v})" if v else label(s) for s, v in zip(df["system"], var)],
        index=df.index,
        dtype=object,
    )


def placements(df: pd.DataFrame) -> pd.DataFrame:
    """The ok overlap rows with a `placement` column: "<consumer>:<ccta asked>" ("own:auto"
    where the auto pick chose per cell); tables from before the `consumer` knob are "own"."""
    ok = df[(df["status"] == "ok") & (df["system"] == "overlap")].copy()
    if ok.empty:
        return ok.assign(placement=pd.Series(dtype=object))
    consumer = _col(ok, "p_consumer").fillna("own").astype(str)
    ccta = ok["p_ccta_used"].astype(int).astype(str)
    if "p_ccta" in ok:
        ccta = ok["p_ccta"].where(ok["p_ccta"].astype(str) == "auto", ccta).astype(str)
    ok["placement"] = consumer + ":" + ccta
    return ok


def load(table: str | Path, status: str | None = "ok") -> pd.DataFrame:
    """A table's rows of kept variants, with `status` only (None: every status)."""
    df = kept(pd.read_parquet(table))
    return df if status is None else df[df["status"] == status]


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
    gpu = ", ".join(sorted(set(_col(df, "gpu_name").dropna().astype(str)))) or "?"
    w = ", ".join(str(int(v)) for v in sorted(set(_col(df, "world_size").dropna())))
    return f"transport: {tr}; W={w}; {gpu}"


def panel_grid(
    df: pd.DataFrame,
    line: str,
    y: str,
    ylabel: str,
    title: str,
    hlines: tuple[float, ...] = (1.0,),
    extra: Callable[[plt.Axes, pd.DataFrame, dict], None] | None = None,
) -> plt.Figure:
    """One panel per (N, routing), x = experts per rank (log2), one line per value of `line`
    (median of `y` per E); `extra(ax, rows of the line, style)` draws more of each line."""
    ns, routings = sorted(df["out"].unique()), sorted(df["routing"].unique())
    fig, axes = plt.subplots(
        len(ns), len(routings), figsize=(3.6 * len(routings), 2.9 * len(ns)), squeeze=False
    )
    names = sorted(df[line].unique())
    for i, n in enumerate(ns):
        for j, routing in enumerate(routings):
            ax = axes[i][j]
            sub = df[(df["out"] == n) & (df["routing"] == routing)]
            for k, v in enumerate(names):
                s = sub[sub[line] == v]
                m = s.groupby("experts_per_rank")[y].median()
                style = dict(marker="o", ms=3, color=plt.cm.tab10(k % 10))
                ax.plot(m.index, m.values, label=v, **style)
                if extra is not None:
                    extra(ax, s, style)
            for h, ls in zip(hlines, ("-", "--")):
                ax.axhline(h, color="k", lw=0.8, ls=ls)
            ax.set_xscale("log", base=2)
            ax.set_title(f"N={n} {routing}", fontsize=8)
            ax.set_ylabel(ylabel, fontsize=8)
            ax.tick_params(labelsize=7)
    for ax in axes[-1]:
        ax.set_xlabel("experts per rank", fontsize=8)
    handles, labels_ = axes[0][0].get_legend_handles_labels()
    fig.legend(handles, labels_, fontsize=7, loc="upper center", ncol=min(len(names), 4),
               bbox_to_anchor=(0.5, 1.0 + 0.04 * ((len(names) + 3) // 4)))  # fmt: skip
    fig.suptitle(title, fontsize=9, y=1.02 + 0.05 * ((len(names) + 3) // 4))
    return fig


def main(
    plot: Callable[..., list[Path]],
    default_table: str,
    default_name: str,
    summary: Callable[[pd.DataFrame], pd.DataFrame] | None = None,
) -> None:
    """The command line of a figure script: --table, --out, --name (and --summary: print the
    script's summary table, draw nothing); prints the paths."""
    ap = argparse.ArgumentParser()
    ap.add_argument("--table", default=default_table)
    ap.add_argument("--out", default=str(FIG_DIR))
    ap.add_argument("--name", default=default_name)
    if summary is not None:
        ap.add_argument("--summary", action="store_true", help="print the summary, draw nothing")
    args = ap.parse_args()
    if summary is not None and args.summary:
        print(summary(pd.read_parquet(args.table)).to_string(index=False))
        return
    for p in plot(args.table, args.out, args.name):
        print(p)
