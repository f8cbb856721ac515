"""Fit the ccta/mgb calibration table from overlap sweeps and evaluate it leave-one-workload-out.

python -m systems.overlap.autotune_fit RESULTS.parquet... (--help: the options). Input: results
tables of ok overlap cells swept over integer p_ccta / p_mgb at the order the system runs the
workload with (autotune.auto_order); a workload includes its consumer placement. "auto" rows are
reported next to the sweep's optimum, not fitted on. The held-out table: per workload, the pick
with it left out, latency(pick) / latency(best) and the same ratio for the fixed default.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import pandas as pd

from harness.measure import SPEC_KEYS
from systems.overlap.autotune import (
    COLUMNS,
    DEFAULT,
    FEATURES,
    K_NEAREST,
    TABLE,
    auto_order,
    default_pick,
    pick_from,
    transport_class,
    with_consumer,
)

#: columns that identify one workload of a sweep (with its consumer placement)
WORKLOAD = ["consumer", "transport", "world_size", *SPEC_KEYS]


def order_ran(df: pd.DataFrame) -> pd.Series:
    """The producer order each overlap row ran: p_order_used, else p_order, else remote_first."""
    ran = pd.Series("remote_first", index=df.index, dtype=object)
    for col in ("p_order", "p_order_used"):  # the later one wins
        if col in df:
            v = df[col].astype(object)
            ran = ran.where(v.isna() | (v == "auto"), v)
    return ran


def split_rows(df: pd.DataFrame) -> tuple[pd.DataFrame, pd.DataFrame]:
    """(sweep rows, auto rows) among the ok overlap rows: sweep rows have integer ccta and mgb;
    auto rows asked for "auto" in either. Only rows that ran the order order="auto" picks are
    kept: a workload is calibrated at the order it will run."""
    df = df[(df["system"] == "overlap") & (df["status"] == "ok")].copy()
    tile = pd.to_numeric(df["p_tile_m"]) if "p_tile_m" in df else pd.Series(128, index=df.index)
    want = [
        auto_order(int(t), int(k), int(e), int(m))
        for t, k, e, m in zip(df["tokens_per_rank"], df["top_k"], df["experts_per_rank"], tile)
    ]
    df = df[order_ran(df).to_numpy() == pd.Series(want, index=df.index).to_numpy()]
    df = with_consumer(df, "p_consumer")
    df["transport"] = [transport_class(t, w) for t, w in zip(df["transport"], df["world_size"])]
    is_auto = (df["p_ccta"].astype(str) == "auto") | (df["p_mgb"].astype(str) == "auto")
    sweep, auto = df[~is_auto].copy(), df[is_auto].copy()
    sweep["ccta"] = pd.to_numeric(sweep["p_ccta"]).astype(int)
    sweep["mgb"] = pd.to_numeric(sweep["p_mgb"]).astype(int)
    return sweep, auto


def calibration_table(sweep: pd.DataFrame, sm_count: int) -> pd.DataFrame:
    """One row per (workload, ccta, mgb): its features and median latency / workload's best."""
    g = sweep.groupby([*WORKLOAD, "ccta", "mgb"], as_index=False).agg(
        latency_ms=("latency_ms", "median"), imbalance_rank=("imbalance_rank", "first")
    )
    best = g.groupby(WORKLOAD)["latency_ms"].transform("min")
    g["rel_latency"] = (g["latency_ms"] / best).round(4)
    g["sm_count"] = sm_count
    g["imbalance_rank"] = g["imbalance_rank"].round(4)
    cols = [*COLUMNS[:-1], "consumer", COLUMNS[-1]]
    return g[cols].sort_values(cols[:-1]).reset_index(drop=True)


def _latency(grid: pd.DataFrame, ccta: int, mgb: int) -> float:
    hit = grid[(grid["ccta"] == ccta) & (grid["mgb"] == mgb)]["latency_ms"]
    return float(hit.median()) if len(hit) else float("nan")


def _auto_cells(auto: pd.DataFrame, w: dict) -> dict:
    """auto_ccta, auto_mgb (the picks used) and auto_ms (median) of the workload's cells run at
    ccta = mgb = "auto"; -1, -1, NaN where the sweep has none."""
    out = {"auto_ccta": -1, "auto_mgb": -1, "auto_ms": float("nan")}
    if auto.empty:
        return out
    mask = (auto["p_ccta"].astype(str) == "auto") & (auto["p_mgb"].astype(str) == "auto")
    for col, v in w.items():
        mask &= auto[col] == v
    both = auto[mask]
    if len(both):
        r = both.iloc[0]
        out = {"auto_ccta": int(r["p_ccta_used"]), "auto_mgb": int(r["p_mgb_used"])}
        out["auto_ms"] = float(both["latency_ms"].median())
    return out


def heldout(
    sweep: pd.DataFrame, auto: pd.DataFrame, sm_count: int, k: int = K_NEAREST
) -> pd.DataFrame:
    """Leave-one-workload-out: per workload, the rule's pick from a table fitted on the OTHER
    workloads, latency(pick) / latency(best measured), latency(default) / latency(best) and
    where the sweep ran auto cells of that workload, their measured ratio too."""
    out = []
    for key, grid in sweep.groupby(WORKLOAD, sort=True):
        w = dict(zip(WORKLOAD, key))
        rest = sweep.drop(index=grid.index)
        table = calibration_table(rest, sm_count) if len(rest) else pd.DataFrame(columns=COLUMNS)
        values = {col: grid[col].iloc[0] for col in FEATURES}
        p = pick_from(table, values, w["transport"], sm_count, k=k, consumer=w["consumer"])
        default = default_pick(w["consumer"], sm_count)[:2]
        per = grid.groupby(["ccta", "mgb"])["latency_ms"].median()
        (bc, bm), best = per.idxmin(), float(per.min())
        row = {
            **w,
            "imbalance_rank": float(values["imbalance_rank"]),
            "best_ccta": int(bc),
            "best_mgb": int(bm),
            "best_ms": best,
            "pick_ccta": p.ccta,
            "pick_mgb": p.mgb,
            "pick_ms": _latency(grid, p.ccta, p.mgb),
            "default_ms": _latency(grid, *default),
            "why": p.why,
        }
        row["pick_ratio"] = row["pick_ms"] / best
        row["default_ratio"] = row["default_ms"] / best
        row |= _auto_cells(auto, w)
        row["auto_ratio"] = row["auto_ms"] / best
        out.append(row)
    return pd.DataFrame(out)


SHOW = [
    *(k for k in WORKLOAD if k not in ("top_k", "dtype")),
    "best_ccta",
    "best_mgb",
    "best_ms",
    "pick_ccta",
    "pick_mgb",
    "pick_ratio",
    "default_ratio",
    "auto_ratio",
]


def summary(res: pd.DataFrame, target: float = 1.03) -> str:
    """One line: how many held-out workloads the pick lands within `target` of the best."""
    r = res["pick_ratio"]
    ok = int((r <= target).sum())
    return (
        f"held-out pick within {100 * (target - 1):.0f}% of the best: {ok}/{len(r)} workloads; "
        f"worst ratio {r.max():.4f}, median {r.median():.4f} "
        f"(default {DEFAULT}: worst {res['default_ratio'].max():.4f})"
    )


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("tables", nargs="+", help="results tables (parquet) with overlap sweeps")
    ap.add_argument("--table", default=str(TABLE), help="calibration table to write (csv)")
    ap.add_argument("--heldout", default="results/autotune_heldout.parquet")
    ap.add_argument("--sm-count", type=int, default=132, help="SMs of the measured GPU")
    ap.add_argument("--no-table", action="store_true", help="evaluate only; write no table")
    ap.add_argument("--keep-other-gpus", action="store_true", help="keep other SM counts' rows")
    ap.add_argument("--k", type=int, default=K_NEAREST, help="calibrated workloads averaged")
    args = ap.parse_args(argv)
    df = pd.concat([pd.read_parquet(p) for p in args.tables], ignore_index=True)
    sweep, auto = split_rows(df)
    if sweep.empty:
        raise SystemExit("no ok overlap rows with integer p_ccta / p_mgb in the input")
    if not args.no_table:
        table = calibration_table(sweep, args.sm_count)
        if args.keep_other_gpus and Path(args.table).exists():
            old = pd.read_csv(args.table)
            old = old[old["sm_count"] != args.sm_count]
            table = pd.concat([old, table], ignore_index=True)[table.columns]
            print(f"[autotune_fit] kept {len(old)} rows of other SM counts")
        table.to_csv(args.table, index=False)
        print(f"[autotune_fit] wrote {args.table}")
    res = heldout(sweep, auto, args.sm_count, args.k)
    Path(args.heldout).parent.mkdir(parents=True, exist_ok=True)
    res.to_parquet(args.heldout, index=False)
    with pd.option_context("display.width", 250, "display.max_columns", 30):
        print(res[SHOW].to_string(index=False, float_format=lambda v: f"{v:.4g}"))
    print(f"k={args.k}: " + summary(res))
    print(f"[autotune_fit] wrote {args.heldout}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
