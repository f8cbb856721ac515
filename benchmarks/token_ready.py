"""When does each token's last row arrive? The share of the fused scale's work that a
readiness-driven scale could start before the producer's last band (models, no GPU;
benchmarks/band_times.py measures the band times on a GPU).

The scale needs all top_k rows of a token (harness/layout.py: out[t] = sum_j w_tj * y_tj); a
row is ready when the band that computes it is done on its expert's rank. Every rank's producer
starts with the step (a rank with fewer bands ends sooner; times are shares of the slowest
rank's producer), and a remote row lands when its band is done (the consumer's put and the wire
add to it). When is a band done:
  uniform  at a steady rate of one band per unit of time in its visiting order (order
           "remote_first": the schedule; "expert": systems.overlap.plan.producer_order)
  waves    the producer's own tile order (its swizzle groups, walked column tile by column
           tile) in waves of GRID equal tiles, its flag one tile later where it is deferred
           (wave_band_times); depends on N, K and the tile table
A token's ready time is the latest of its rows' times.

Printed per (model, N for waves, E, routing, order): the share of tokens (= of the scale's rows:
every token has top_k of them) ready by 50%, 75% and 90% of the producer, and the mean ready
time. Usage: python -m benchmarks.token_ready [--world 2] [--experts 4,16,64] [--n 4096,8192]
[--models uniform,waves] [--out T.csv]
"""

from __future__ import annotations

import argparse
from typing import Any

import pandas as pd
import torch

from harness.layout import rank_layout
from harness.workload import ROUTINGS, WorkloadSpec
from systems.overlap.autotune import auto_order
from systems.overlap.plan import LAYOUTS, ORDERS, build_plan, producer_groups, producer_order

#: producer progress (share of its bands done) at which the printed shares are read
MARKS = (0.5, 0.75, 0.9)
#: the models of when a band is done (ready_times)
MODELS = ("uniform", "waves")
#: the producer's programs in the waves model: an H200's SMs less one (benchmarks/band_times.py)
GRID = 131


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


def wave_band_times(
    plan: Any, order: str, n: int, k: int, grid: int, swizzle: str = "table", share: bool = True
) -> torch.Tensor:
    """times [B] (by band id) from the producer's own tile order (kernels/producer.py: tile t
    of B x tiles_n runs in wave t // grid on program t % grid, its swizzle groups walked column
    tile by column tile), every tile taking the same time: a band is done with its last tile,
    and its flag rises one tile later where the table's flag is deferred (not after a
    program's last tile); as a share of the last band's time (share=False: in tile times).
    swizzle: the overlap system's knob (modes.parse_swizzle; "fixed1" walks each band's column
    tiles in a row)."""
    from systems.overlap.kernels.producer import pick_config, with_swizzle
    from systems.overlap.modes import GROUP_CODE

    cfg = with_swizzle(pick_config(plan.tile_m, k, n, torch.bfloat16), swizzle)
    B, tn = plan.n_bands, cfg.tiles_n(n)
    t = torch.arange(B * tn)
    visit = producer_order(plan).long() if order == "expert" else None
    if cfg.expert_groups:
        g = producer_groups(plan, visit, cfg.group_m).long()[t // tn]
        first, size = g // GROUP_CODE, g % GROUP_CODE
        s = first + (t - first * tn) % size
    elif cfg.group_m == 1:
        s = t // tn
    else:
        per = cfg.group_m * tn
        first = (t // per) * cfg.group_m
        s = first + (t % per) % (B - first).clamp(max=cfg.group_m)
    band = plan.schedule.long()[visit[s] if visit is not None else s]
    deferred = cfg.flag in ("deferred", "warp", "mid")
    done = (t // grid + 1).double() + float(deferred) * ((t + grid) < B * tn).double()
    times = torch.zeros(B, dtype=torch.float64).scatter_reduce(0, band, done, "amax")
    return times / times.max() if share else times


def ready_times(
    spec: WorkloadSpec,
    tile_m: int,
    layout: str,
    order: str,
    band_times: list[torch.Tensor] | None = None,
    model: str = "uniform",
    grid: int = GRID,
    swizzle: str = "table",
    spans: list[float] | None = None,
) -> torch.Tensor:
    """ready [W, T] float: when each token's last row is done, as a share (0, 1] of the slowest
    rank's producer (every rank's producer starts with the step; a rank with fewer bands ends
    sooner). band_times [W] of [B_c] (optional): each rank's band times by band id as a share
    of its own producer's span, spans [W] those spans (benchmarks/band_times.py measures both;
    None: equal); without band_times, the model named: "uniform" (uniform_band_times, a band
    per unit of time) or "waves" (wave_band_times on `grid` programs, tile order `swizzle`)."""
    plans = rank_plans(spec, tile_m, layout)
    own = []  # each rank's band times in one unit of time across ranks
    for c, (_, plan) in enumerate(plans):
        if band_times is not None:
            own.append(band_times[c].double() * (spans[c] if spans else 1.0))
        elif model == "waves":
            own.append(wave_band_times(plan, order, spec.out, spec.hidden, grid, swizzle, False))
        else:
            own.append(uniform_band_times(plan, order) * plan.n_bands)
    slowest = max(float(t.max()) for t in own)
    ready = torch.zeros(spec.world_size, spec.tokens_per_rank)
    for c, (lay, plan) in enumerate(plans):  # c computes its experts' rows for every owner
        band = torch.searchsorted(plan.band_row, plan.row_pos, right=True) - 1  # [R]
        t = own[c][band] / slowest
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
    ns: list[int] = (4096,),
    models: tuple[str, ...] = ("uniform",),
    hidden: int = 2048,
) -> pd.DataFrame:
    rows = []
    for model in models:
        for n in ns if model == "waves" else ns[:1]:  # the uniform model does not see N
            for e in experts:
                for routing in routings:
                    spec = WorkloadSpec(
                        tokens_per_rank=tokens,
                        hidden=hidden,
                        out=n,
                        experts_per_rank=e,
                        top_k=top_k,
                        world_size=world,
                        routing=routing,
                    )
                    for order in ORDERS:
                        r = ready_times(spec, tile_m, layout, order, model=model)
                        row = {"model": model, "out": n if model == "waves" else None}
                        row.update(experts_per_rank=e, routing=routing, order=order)
                        row["auto"] = order == auto_order(tokens, top_k, e, tile_m)
                        rows.append({**row, **shares(r)})
    return pd.DataFrame(rows)


def parse_grid(ap: argparse.ArgumentParser, a: argparse.Namespace) -> tuple[list, list, list]:
    """(ns, experts, routings) from the comma-separated --n, --experts and --routing of a
    benchmark's arguments (this one's and band_times'); ap.error's one line on bad input."""
    try:
        ns = [int(v) for v in a.n.split(",")]
        experts = [int(v) for v in a.experts.split(",")]
    except ValueError:
        ap.error("--n and --experts take comma-separated integers")
    routings = a.routing.split(",")
    bad = sorted(set(routings) - set(ROUTINGS))
    if bad:
        ap.error(f"unknown routing {bad}; choices: {', '.join(ROUTINGS)}")
    if min(ns + experts) < 1:
        ap.error("--n and --experts must be >= 1")
    return ns, experts, routings


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--top-k", type=int, default=2)
    ap.add_argument("--experts", default="4,8,16,32,64")
    ap.add_argument("--routing", default=",".join(ROUTINGS))
    ap.add_argument("--tile-m", type=int, default=128)
    ap.add_argument("--layout", default="compact", choices=LAYOUTS)
    ap.add_argument("--n", default="4096,8192", help="N of the waves model (the tile table's)")
    ap.add_argument("--models", default=",".join(MODELS))
    ap.add_argument("--out", default="", help="also write the table as CSV")
    a = ap.parse_args()
    ns, experts, routings = parse_grid(ap, a)
    models = tuple(a.models.split(","))
    if set(models) - set(MODELS):
        ap.error(f"unknown model in {list(models)}; choices: {', '.join(MODELS)}")
    if a.world < 1 or a.tokens < 1:
        ap.error("--world and --tokens must be >= 1")
    if not 1 <= a.top_k <= a.world * min(experts):
        ap.error("--top-k must be in [1, world x experts]")
    if a.tile_m not in (64, 128):
        ap.error(f"--tile-m must be 64 or 128 (the producer's tile heights), got {a.tile_m}")
    df = table(a.world, a.tokens, a.top_k, experts, routings, a.tile_m, a.layout, ns, models)
    if a.out:
        df.to_csv(a.out, index=False)
    print(df.round(3).to_string(index=False))


if __name__ == "__main__":
    main()
