"""Shared plot helpers: read a results table (in its newest measurement setting, a cell's
CUDA-graph rows before its eager ones), label systems from the registry and the overlap
system's knobs, name the machine and the timing, lay out panels, save PNG + PDF."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import pandas as pd  # noqa: E402
from matplotlib.lines import Line2D  # noqa: E402

FIG_DIR = Path("plots/figures")
#: the columns of a workload (the cell systems are compared on); WORKLOAD_KD adds top_k, dtype
WORKLOAD = ["world_size", "tokens_per_rank", "hidden", "out", "experts_per_rank", "routing"]
WORKLOAD_KD = [*WORKLOAD[:5], "top_k", "routing", "dtype"]


def label(system: str) -> str:
    """Display label of a system, from the registry (never hard-coded here)."""
    from harness.system import registry

    info = registry().get(system)
    return info.label if info else system


def _col(df: pd.DataFrame, name: str) -> pd.Series:
    return df[name] if name in df else pd.Series(None, index=df.index, dtype=object)


def overlap_variant(df: pd.DataFrame) -> pd.Series:
    """Per overlap row, its transport and the kept knobs off their defaults (layout, order,
    `shared SMs, cCTA <c>`): each variant its own line; "" for every other system."""
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
    """Per row, the plotted line: the system's label, with its variant for the overlap system
    ("Overlap (ours) (p2p, compact)"); never a best-of over variants."""
    var = overlap_variant(df)
    lines = [f"{label(s)} ({v})" if v else label(s) for s, v in zip(df["system"], var)]
    return pd.Series(lines, index=df.index, dtype=object)


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


#: the columns that say how a row was measured: rows of two settings never share a figure
SETTING = ("hardware", "backend", "warmup", "iters", "rounds", "queue_ahead")


def newest_setting(df: pd.DataFrame, table: str | Path = "") -> pd.DataFrame:
    """The rows of the table's newest measurement setting (SETTING columns, by the newest row of
    each); says on stdout what it left out."""
    cols = [c for c in SETTING if c in df]
    if not cols or df.empty:
        return df
    t = _col(df, "timestamp").fillna(0).astype(float)
    times = t.groupby([df[c].astype(str) for c in cols]).max().sort_values(kind="stable")
    if len(times) < 2:
        return df
    last = times.index[-1]
    keep = (df[cols].astype(str) == list(last if isinstance(last, tuple) else (last,))).all(axis=1)
    print(f"[figures] {table}: the newest measurement setting only ({setting_note(df[keep])}); "
          f"left out {int((~keep).sum())} row(s) of {len(times) - 1} other setting(s)")  # fmt: skip
    return df[keep]


def setting_note(df: pd.DataFrame) -> str:
    """ "warmup 1, iters 5": the measurement setting of df's rows, for a title."""
    cols = [c for c in ("warmup", "iters", "rounds") if c in df]
    vals = {c: sorted(df[c].dropna().unique(), key=str) for c in cols}
    return ", ".join(f"{c} {'/'.join(map(str, v)) or '?'}" for c, v in vals.items())


def machine(df: pd.DataFrame) -> str:
    """The machine of a table's newest rows, named as results/reference/'s folders: "cpu",
    "h200", "h200x2" (the GPU's model, and the count where more than one)."""
    from harness.records import machine_name

    if df.empty or "gpu_count" not in df:
        return "local"
    row = df.iloc[int(_col(df, "timestamp").fillna(0).astype(float).to_numpy().argmax())]
    n = int(row["gpu_count"]) if row["gpu_count"] == row["gpu_count"] else 0
    return machine_name(str(row.get("gpu_name", "")), n)


#: a system's cell, with its knobs (p_*, not *_used) but TIMING_KNOBS: rows that differ in
#: nothing else differ only in how the step was timed
SYSTEM_CELL = ("system", "scope", "transport", "world_size", "tokens_per_rank", "hidden", "out",
               "ffn", "experts_per_rank", "top_k", "routing", "dtype", "model")  # fmt: skip
#: knobs that decide whether a step can be captured: the NCCL dispatch syncs the host, so it is
#: the eager-only path of a system whose device dispatch is graphed
TIMING_KNOBS = ("p_dispatch",)


def graphed(df: pd.DataFrame) -> pd.Series:
    """Per row, True where its step was timed as CUDA-graph replays (`graph`; missing: eager)."""
    g = _col(df, "graph")
    return g.where(g.notna(), False).astype(bool)


def prefer_graph(df: pd.DataFrame, table: str | Path = "") -> pd.DataFrame:
    """df without the eager rows of a system's cell (SYSTEM_CELL) that has an ok CUDA-graph row;
    says on stdout what it left out."""
    g = graphed(df)
    ok = g & (df["status"] == "ok") if "status" in df else g
    if not ok.any():
        return df
    knobs = [c for c in df if c.startswith("p_") and not c.endswith("_used")]
    keys = [c for c in (*SYSTEM_CELL, *knobs) if c in df and c not in TIMING_KNOBS]
    has = ok.groupby([df[c].astype(str) for c in keys], dropna=False).transform("any")
    keep = g | ~has
    if (~keep).any() and table:
        print(f"[figures] {table}: CUDA-graph rows preferred; left out {int((~keep).sum())} "
              "eager row(s) of cells that have one")  # fmt: skip
    return df[keep]


def timing_note(df: pd.DataFrame) -> str:
    """The timing of df's rows, for a title: "timing: CUDA-graph replay", "timing: eager", or
    which systems' rows are graph replays."""
    g = graphed(df)
    if len(df) and g.all():
        return "timing: CUDA-graph replay"
    if not g.any():
        return "timing: eager"
    graph_systems = ", ".join(sorted(set(_col(df, "system")[g].astype(str))))
    return f"timing: CUDA-graph replay ({graph_systems}), eager (the rest)"


def load(table: str | Path, status: str | None = "ok", prefer: bool = True) -> pd.DataFrame:
    """A table's rows of its newest measurement setting, with `status` only (None: every
    status); with `prefer`, a cell's CUDA-graph rows only where it has them (prefer_graph)."""
    df = newest_setting(pd.read_parquet(table), table)
    df = prefer_graph(df, table) if prefer else df
    return df if status is None else df[df["status"] == status]


def need(df: pd.DataFrame, table: str | Path, what: str) -> pd.DataFrame:
    """df where it has rows, else ValueError "<table>: no <what>" (plots.all: no figure)."""
    if df.empty:
        raise ValueError(f"{table}: no {what}")
    return df


def save(fig: plt.Figure, out_dir: str | Path, name: str, title: str = "") -> list[Path]:
    """Write <out_dir>/<name>.png and .pdf (with `title` above a tight layout, where given)."""
    if title:
        fig.tight_layout()
        fig.suptitle(title, fontsize=9, y=1.0, va="bottom")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = [out / f"{name}.png", out / f"{name}.pdf"]
    for p in paths:
        fig.savefig(p, bbox_inches="tight", dpi=150)
    plt.close(fig)
    return paths


def drop_figures(out: Path, names: list[str]) -> list[Path]:
    """Remove <out>/<name>.png and .pdf of each name where present; those removed."""
    old = [p for n in names for p in (out / f"{n}.png", out / f"{n}.pdf") if p.exists()]
    for p in old:
        p.unlink()
    return old


def transport_note(df: pd.DataFrame, timing: bool = True) -> str:
    """A caption naming the transports and hardware, so proxies are never mistaken, and with
    `timing` (figures of latencies) timing_note."""
    tr = ", ".join(sorted(set(df["transport"].dropna().astype(str)) - {""})) or "?"
    gpu = ", ".join(sorted(set(_col(df, "gpu_name").dropna().astype(str)))) or "?"
    w = ", ".join(str(int(v)) for v in sorted(set(_col(df, "world_size").dropna())))
    how = setting_note(df)
    note = f"transport: {tr}; W={w}; {gpu}" + (f"; {timing_note(df)}" if timing else "")
    note += f"; measured with {how}" if how else ""
    runs = _col(df, "run_id").nunique()
    note += f"; rows of {runs} runs" if runs > 1 else ""
    cav = _col(df, "caveat")[_col(df, "system") == "serial"].dropna().astype(str)
    return note + "".join(f"\n{c}" for c in sorted({c.split("; ")[0] for c in cav if c}))


def against(
    df: pd.DataFrame, keys: list[str], by: list[str], ref: str = "serial", agg: str = "min"
) -> pd.DataFrame:
    """One row per (keys, by) of df: `latency_ms` (agg over its rows), `ref_ms` (the `ref`
    system's on the same keys, NaN where it has none) and `speedup` = ref_ms / latency_ms."""
    lat = df.groupby(keys + by, as_index=False)["latency_ms"].agg(agg)
    r = lat[lat["system"] == ref].groupby(keys, as_index=False)["latency_ms"].min()
    out = lat.merge(r.rename(columns={"latency_ms": "ref_ms"}), on=keys, how="left")
    return out.assign(speedup=out["ref_ms"] / out["latency_ms"])


def palette(values) -> dict:
    """value -> colour, in sorted order, so every panel of a figure draws a line alike."""
    return {v: plt.cm.tab10(k % 10) for k, v in enumerate(sorted(set(values)))}


def _fixed(df: pd.DataFrame, rows: dict[str, str], title: str, lead: str = "") -> str:
    """`title` with `lead` and the `rows` columns that hold one value in df ("T/rank=8192
    K=2048") after its first line."""
    one = [(n, df[c].iloc[0]) for c, n in rows.items() if df[c].nunique() == 1]
    fixed = lead + " ".join(f"{n}={v}" if n else str(v) for n, v in one)
    if not fixed:
        return title
    first, nl, rest = title.partition("\n")
    return f"{first}, {fixed}{nl}{rest}"


def grid(n_rows: int, n_cols: int, w: float = 3.6, h: float = 2.9):
    """(figure, axes[n_rows][n_cols]) of panels w x h inches."""
    return plt.subplots(n_rows, n_cols, figsize=(w * n_cols, h * n_rows), squeeze=False)


def panels(df: pd.DataFrame, rows: dict[str, str], w: float = 3.6, h: float = 2.9):
    """(figure, [(ax, title, rows of the panel, (*values of `rows`, routing))]): a grid row per
    value of the `rows` columns, a column per routing; a title names the `rows` columns that
    vary in df (by their short names in `rows`) and the routing."""
    keys = sorted(df[list(rows)].drop_duplicates().itertuples(index=False, name=None))
    routings = sorted(df["routing"].unique())
    fig, axes = grid(len(keys), len(routings), w, h)
    vary = {c for c in rows if df[c].nunique() > 1}
    out = []
    for i, rk in enumerate(keys):
        shape = [f"{n}={v}" if n else str(v) for (c, n), v in zip(rows.items(), rk) if c in vary]
        for j, routing in enumerate(routings):
            sub = df[(df[list(rows)] == list(rk)).all(axis=1) & (df["routing"] == routing)]
            out.append((axes[i][j], " ".join([*shape, routing]), sub, (*rk, routing)))
    return fig, out


def panel_grid(
    df: pd.DataFrame, line: str, y: str, ylabel: str, title: str,
    rows: dict[str, str] | None = None, colors: dict | None = None, ncol: int = 4,
    hlines: tuple[float, ...] = (1.0,), extra: Callable | None = None, logy: bool = False,
) -> plt.Figure:  # fmt: skip
    """One panel per (value of the `rows` columns, routing), one line per value of `line`: the
    median of `y` against experts per rank (log2). `rows` (default N) maps a column to its short
    name in panel titles; columns of one value join the title instead. `extra(ax, rows of the
    line, style)` draws more per line. One legend above the panels, the title above it."""
    rows = rows or {"out": "N"}
    fig, cells = panels(df, rows)
    colors = colors or palette(df[line])
    for ax, name, sub, _ in cells:
        for v, s in sub.groupby(line):
            m = s.groupby("experts_per_rank")[y].median()
            style = dict(marker="o", ms=3, color=colors[v])
            ax.plot(m.index, m.values, label=v, **style)
            if extra is not None:
                extra(ax, s, style)
        for h, ls in zip(hlines, ("-", "--")):
            ax.axhline(h, color="k", lw=0.8, ls=ls)
        ax.set_xscale("log", base=2)
        if logy:
            ax.set_yscale("log")
        ax.set_title(name, fontsize=8)
        ax.set_ylabel(ylabel, fontsize=8)
        ax.tick_params(which="both", labelsize=7)
        if ax.get_subplotspec().is_last_row():
            ax.set_xlabel("experts per rank", fontsize=8)
    title = _fixed(df, rows, title)
    fig.tight_layout()
    handles = [Line2D([], [], marker="o", ms=3, color=c, label=v) for v, c in colors.items()]
    ncol = min(len(handles), ncol)
    fig.legend(handles=handles, fontsize=7, loc="lower center", ncol=ncol,
               bbox_to_anchor=(0.5, 1.0))  # fmt: skip
    legend_h = (0.1 + 0.19 * -(-len(handles) // ncol)) / fig.get_figheight()
    fig.suptitle(title, fontsize=9, y=1.0 + legend_h, va="bottom")
    return fig


def main(
    plot: Callable[..., list[Path]],
    default_table: str,
    default_name: str,
    summary: Callable[[pd.DataFrame], pd.DataFrame] | None = None,
) -> None:
    """A figure script's command line: --table, --out, --name; with `summary`, --summary prints
    the summary table instead of drawing."""
    ap = argparse.ArgumentParser()
    ap.add_argument("--table", default=default_table)
    ap.add_argument("--out", default=str(FIG_DIR))
    ap.add_argument("--name", help="the figure's file name (default: reference_<machine>_<table>"
                    " under results/reference/, as `make figures` names it)")  # fmt: skip
    if summary is not None:
        ap.add_argument("--summary", action="store_true", help="print the summary, draw nothing")
    args = ap.parse_args()
    if summary is not None and args.summary:
        print(summary(pd.read_parquet(args.table)).to_string(index=False))
        return
    table = Path(args.table)
    ref = f"reference_{table.parent.name}_{table.stem}"
    name = args.name or (ref if table.parent.parent.name == "reference" else default_name)
    for p in plot(args.table, args.out, name):
        print(p)
