"""When does each token's last row arrive? The share of the fused scale's work that a
readiness-driven scale could start before the producer's last band (a model, no GPU).

The scale needs all top_k rows of a token (harness/layout.py: out[t] = sum_j w_tj * y_tj); a
row is ready when the band that computes it is done on its expert's rank. Model: every rank's
producer finishes its bands at a uniform rate in its visiting order (order "remote_first": the
schedule; "expert": systems.overlap.plan.producer_order), all ranks in step, and a remote row
lands when its band is done (the consumer's put and the wire add to it). A band's time is then
(its visiting position + 1) / bands, and a token's ready time the latest of its rows' times.

Printed per (E, routing, order): the share of tokens (= of the scale's rows: every token has
top_k of them) ready by 50%, 75% and 90% of the producer, and the mean ready time.
Usage: python -m benchmarks.token_ready [--world 2] [--experts 4,16,64] [--out T.csv]
"""

from __future__ import annotations

import argparse
from typing import Any

import pandas as pd
import torch

from harness.layout import rank_layout
from harness.workload import ROUTINGS, WorkloadSpec
from systems.overlap.autotune import auto_order
from systems.overlap.plan import LAYOUTS, ORDERS, build_plan, producer_order

#: producer progress (share of its bands done) at which the printed shares are read
MARKS = (0.5, 0.75, 0.9)


def rank_plans(spec: WorkloadSpec, tile_m: int, layout: str) -> list[tuple[Any, Any]]:
    """(RankLayout, CombinePlan) of every rank, on the CPU."""
    out = []
    for c in range(spec.world_size):
        lay = rank_layout(spec, c)
        plan = build_plan(
            lay.recv_src,
            lay.recv_expert,
            lay.recv_dst_index,
            world_size=spec.world_size,
            rank=c,
            experts_per_rank=spec.experts_per_rank,
            tile_m=tile_m,
            mgb=1,
            out_cols=spec.out,
            elem_bytes=2,
            send_counts=lay.send_counts,
            layout=layout,
        )
        out.append((lay, plan))
    return out


def uniform_band_times(plan: Any, order: str) -> torch.Tensor:
    """times [B] (by band id): (visiting position + 1) / B, the model's producer progress."""
    B = plan.n_bands
    step = torch.empty(B, dtype=torch.int64)  # band -> its visiting position
    visit = torch.arange(B) if order == "remote_first" else producer_order(plan).long()
    step[plan.schedule.long()[visit]] = torch.arange(B)
    return (step + 1).double() / B


def ready_times(
    spec: WorkloadSpec,
    tile_m: int,
    layout: str,
    order: str,
    band_times: list[torch.Tensor] | None = None,
) -> torch.Tensor:
    """ready [W, T] float: the producer progress (0, 1] at which each token's last row is done.
    band_times [W] of [B_c] (optional): each rank's band times by band id, as a share of its
    producer's time (benchmarks/band_times.py measures them); None: the uniform model."""
    plans = rank_plans(spec, tile_m, layout)
    ready = torch.zeros(spec.world_size, spec.tokens_per_rank)
    for c, (lay, plan) in enumerate(plans):  # c computes its experts' rows for every owner
        times = uniform_band_times(plan, order) if band_times is None else band_times[c]
        band = torch.searchsorted(plan.band_row, plan.row_pos, right=True) - 1  # [R]
        t = times.double()[band]
        for s in range(spec.world_size):
            mine = lay.recv_src == s
            tok = plans[s][0].send_token[lay.recv_dst_index[mine]]
            ready[s].scatter_reduce_(0, tok, t[mine].float(), "amax")
    return ready


def shares(ready: torch.Tensor) -> dict[str, float]:
    """ready_by_<m> (the share of tokens ready by each mark) and mean_ready."""
    row = {f"ready_by_{m:g}": float((ready <= m).float().mean()) for m in MARKS}
    row["mean_ready"] = float(ready.mean())
    return row


def table(
    world: int,
    tokens: int,
    top_k: int,
    experts: list[int],
    routings: list[str],
    tile_m: int,
    layout: str,
) -> pd.DataFrame:
    rows = []
    for e in experts:
        for routing in routings:
            spec = WorkloadSpec(
                tokens_per_rank=tokens,
                hidden=1,
                out=1,
                experts_per_rank=e,
                top_k=top_k,
                world_size=world,
                routing=routing,
            )
            for order in ORDERS:
                r = ready_times(spec, tile_m, layout, order)
                row = {"experts_per_rank": e, "routing": routing, "order": order}
                row["auto"] = order == auto_order(tokens, top_k, e, tile_m)
                rows.append({**row, **shares(r)})
    return pd.DataFrame(rows)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--top-k", type=int, default=2)
    ap.add_argument("--experts", default="4,8,16,32,64")
    ap.add_argument("--routing", default=",".join(ROUTINGS))
    ap.add_argument("--tile-m", type=int, default=128)
    ap.add_argument("--layout", default="compact", choices=LAYOUTS)
    ap.add_argument("--out", default="", help="also write the table as CSV")
    a = ap.parse_args()
    try:
        experts = [int(x) for x in a.experts.split(",")]
    except ValueError:
        ap.error(f"--experts takes comma-separated integers, got {a.experts!r}")
    routings = a.routing.split(",")
    bad = sorted(set(routings) - set(ROUTINGS))
    if bad:
        ap.error(f"unknown routing {bad}; choices: {', '.join(ROUTINGS)}")
    if a.world < 1 or a.tokens < 1 or a.tile_m < 1 or not 1 <= a.top_k <= a.world * min(experts):
        ap.error("--world, --tokens, --tile-m >= 1 and 1 <= --top-k <= world x experts")
    df = table(a.world, a.tokens, a.top_k, experts, routings, a.tile_m, a.layout)
    if a.out:
        df.to_csv(a.out, index=False)
    print(df.round(3).to_string(index=False))


if __name__ == "__main__":
    main()
