"""Predicted latency of every serial and overlap row of results tables (harness/step_model.py):
PREDICTIONS, never measurements.

  python -m experiments.predict --cells IN.parquet [IN2 ...] --out OUT.parquet [hardware=h200]
      every row of the tables, with the PRED columns on the serial and overlap rows of SCOPES
      (other rows pass through, NaN), `pred_node` the node preset, `table` <machine>/<stem>
  python -m experiments.predict --project --out OUT.parquet
      the projection grid (project()): serial and the overlap system at its best predicted
      cCTA, mgb and layout
  python -m experiments.predict --calibrate
      the fitted numbers of conf/node/h200.yaml (step_model.fit)
"""

from __future__ import annotations

import argparse
import itertools
import time
from dataclasses import replace
from pathlib import Path

import pandas as pd
import torch
import yaml

from harness.step_model import PRED, Node, fit, load_node, predict

ROOT = Path(__file__).resolve().parents[1]

SCOPES = ("gemm+combine", "layer")
#: the projection: node preset -> world sizes (W > 8 balanced only); workloads: the paper's
#: Fig 5-8 operator (T=8192, K=2048, N=8192, 16 experts a rank: 64 at W=4) and the named
#: layer workloads (conf/workload/proxy_*.yaml: their experts in all fixed, split over W)
NODES_W = {"h200": (2, 4, 8, 16, 32, 64), "h100": (4, 8), "a100_pairwise": (4,)}
PAPER = dict(tokens_per_rank=8192, hidden=2048, out=8192, ffn=0, experts_per_rank=16, top_k=2)
ROUTINGS = ("balanced", "stress_skew")
#: the link sweep: the H200 node at W=8 with its link (and per-program rate) scaled
LINK_SCALES = (0.125, 0.25, 0.5, 2.0, 4.0)


def workloads() -> dict[str, tuple[dict, int | None]]:
    """name -> (shape, experts in all; None: experts_per_rank stays)."""
    out = {"paper_fig5": (PAPER, None)}
    for name in ("proxy_mixtral", "proxy_deepseek"):
        g = yaml.safe_load((ROOT / "conf" / "workload" / f"{name}.yaml").read_text())
        shape = {k: v[0] for k, v in g.items() if k not in ("world_size", "dtype")}
        out[name] = (shape, shape["experts_per_rank"] * g["world_size"][0])
    return out


def predict_table(df: pd.DataFrame, node: Node) -> pd.DataFrame:
    """df with the PRED columns on its serial and overlap rows of SCOPES."""
    out = df.assign(**dict.fromkeys(PRED, float("nan")))
    if "system" not in out:  # not a table of systems' rows: nothing to predict
        return out.assign(pred_node=node.name)
    ffn = out["ffn"].fillna(0) if "ffn" in out else pd.Series(0, index=out.index)
    scope = out["scope"].fillna("") if "scope" in out else ffn.map({0: SCOPES[0]})
    todo = out["system"].isin(["serial", "overlap"]) & scope.isin(SCOPES)
    for i in out.index[todo]:
        for c, v in predict(out.loc[i].to_dict(), node).items():
            out.at[i, c] = v
    return out.assign(pred_node=node.name)


def best_overlap(cell: dict, node: Node) -> dict:
    """The overlap prediction at its best cCTA (4-24), mgb (1-2) and layout, with them."""
    picks = []
    for ccta, mgb, lay in itertools.product((4, 8, 12, 16, 24), (1, 2), ("aligned", "compact")):
        knobs = {"p_ccta_used": ccta, "p_mgb_used": mgb, "p_layout": lay}
        picks.append(predict(cell | {"system": "overlap"} | knobs, node) | knobs)
    return min(picks, key=lambda p: p["m_pred_ms"])


def ratio(node: Node, W: int) -> dict:
    """A node's link GB/s out of a GPU in an all-to-all, its GEMM TFLOP/s and their ratio."""
    link = node.link_gbps * (W - 1 if node.topology == "pairwise" else 1)
    tflops = 2 * 128 * 256 * 2048 / node.tile_us * node.sms / 1e6
    return {"link_gbps": link, "gemm_tflops": tflops, "link_per_tflops": link / tflops}


def project() -> pd.DataFrame:
    """The projection grid: per node, W, workload and routing (and the link sweep), serial and
    the best overlap."""
    runs = [(load_node(n), w, r) for n, ws in NODES_W.items() for w in ws for r in ROUTINGS]
    h200 = load_node("h200")
    for f in LINK_SCALES:
        sped = dict(link_gbps=h200.link_gbps * f, cta_gbps=h200.cta_gbps * min(f, 1.0))
        runs.append((replace(h200, name=f"h200, link x{f:g}", **sped), 8, "balanced"))
    rows = []
    for (node, W, routing), (wname, (shape, n_exp)) in itertools.product(runs, workloads().items()):
        E = shape["experts_per_rank"] if n_exp is None else n_exp // W
        if E < 1 or (W > 8 and routing != "balanced"):
            continue
        cell = shape | dict(experts_per_rank=E, world_size=W, routing=routing, dtype="bfloat16")
        cell |= dict(transport="p2p", graph=True, workload=wname, pred_node=node.name)
        cell |= ratio(node, W)
        rows.append(cell | {"system": "serial"} | predict(cell | {"system": "serial"}, node))
        rows.append(cell | {"system": "overlap"} | best_overlap(cell, node))
    df = pd.DataFrame(rows)
    return df.assign(scope=df["ffn"].map(lambda f: "layer" if f else "gemm+combine"))


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cells", nargs="+", default=[], help="results tables (parquet)")
    ap.add_argument("--out", help="the table to write (parquet)")
    ap.add_argument("--project", action="store_true", help="write the projection grid")
    ap.add_argument("--calibrate", action="store_true", help="print the fitted H200 preset")
    ap.add_argument("hardware", nargs="?", default="hardware=h200", help="hardware=<preset>")
    args = ap.parse_args(argv)
    if args.calibrate:
        print("\n".join(f"{k}: {v}" for k, v in fit().items()))
        return
    if not args.hardware.startswith("hardware=") or not args.out:
        ap.error("usage: --cells IN.parquet --out OUT.parquet [hardware=<preset>]")
    torch.set_num_threads(1)  # the plans' small ops: threads only contend (20x on 2 cores)
    t = time.perf_counter()
    if args.project:
        df = project()
    else:
        try:
            node = load_node(args.hardware.removeprefix("hardware="))
        except ValueError as exc:
            ap.error(str(exc))
        parts = []
        for path in map(Path, args.cells):
            part = predict_table(pd.read_parquet(path), node)
            parts.append(part.assign(table=f"{path.parent.name}/{path.stem}"))
        if not parts:
            ap.error("no --cells table given")
        df = pd.concat(parts, ignore_index=True)
        mixed = [c for c in df if df[c].dtype == object]  # the tables' types differ: as text
        df[mixed] = df[mixed].astype("string")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    df.to_parquet(args.out)
    n = int(df["m_pred_ms"].notna().sum())
    print(f"predict: {n} predicted rows -> {args.out} ({time.perf_counter() - t:.1f} s)")


if __name__ == "__main__":
    main()
