"""When does each band of the producer finish, measured on one GPU, and when does each token's
last row become ready then? Checks benchmarks/token_ready.py's models with the producer's own
flags.

Per workload (W=2 by default: each rank's real plan, compact, the auto order, the shipped tile
table, or the tile orders of --swizzles) and per rank: the producer on SMs - 1 (every band
signalled) runs once per rep next to an observer (one CTA on the spare SM,
systems/overlap/kernels/observer.py) that records when each band's counter reached its target,
after a one-thread stamp kernel on the producer's stream that marks its start. A band's time is
its share of the producer's span: (its time - the stamp) / (the last band's time - the stamp),
median over the reps. The tokens' ready shares then follow as in token_ready.py (as shares of
the slowest rank's span: each rank's band times scaled by its own span), from the measured band
times ("measured") and from the two models ("model": a steady rate; "waves": the tile order in
waves), side by side.

Usage: python -m benchmarks.band_times [--out DIR] [--n 4096,8192] [--experts 4,16,64]
[--routing balanced,stress_skew] [--reps 5] [--swizzles table,fixed1]; writes band_times.parquet
(per workload and swizzle: each source's shares, the producer's span in ms (a tile order's
cost), the largest gap of a band's measured time to each model's, bands never seen, the
observer's start as a share of the producer: it must be <= 0) and band_times_bands.parquet (per
rank and band: both models and measured), prints a table.
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

import pandas as pd
import torch

from benchmarks.token_ready import (
    parse_grid,
    rank_plans,
    ready_times,
    shares,
    uniform_band_times,
    wave_band_times,
)
from harness.records import provenance
from harness.workload import WorkloadSpec
from systems.overlap.autotune import auto_order
from systems.overlap.modes import parse_swizzle

T, K, TOP_K, TILE_M, LAYOUT = 8192, 2048, 2, 128, "compact"
#: GPU cycles the producer's stream sleeps before it (about 100 us at 1.98 GHz), so the
#: observer (on another stream) is polling when the producer starts
SLEEP_CYCLES = 200_000


def measure_rank(
    plan, n: int, order: str, reps: int, swizzle: str = "table"
) -> tuple[torch.Tensor, float, int, float]:
    """(band times [B] as shares of the producer's span, that span in ms (from a stamp kernel
    right before the producer to its last band's flag), bands never seen, the observer's start
    as a share of the span: <= 0 when it started before the producer) of one rank, medians over
    the reps."""
    from systems.overlap.kernels import launch_producer, pick_config, with_swizzle
    from systems.overlap.kernels.observer import launch_observer, stamp
    from systems.overlap.plan import producer_groups, producer_order

    dev = torch.device("cuda")
    p = plan.to(dev)
    e, b = plan.experts_per_rank, plan.n_bands
    gen = torch.Generator(device=dev).manual_seed(plan.rank)
    x = torch.randn(plan.n_padded, K, generator=gen, device=dev).to(torch.bfloat16)
    w = (torch.randn(e, K, n, generator=gen, device=dev) / math.sqrt(K)).to(torch.bfloat16)
    y = torch.empty(plan.n_padded, n, dtype=torch.bfloat16, device=dev)
    ready = torch.zeros(b, dtype=torch.int32, device=dev)
    cfg = with_swizzle(pick_config(TILE_M, K, n, torch.bfloat16), swizzle)
    visit = producer_order(p) if order == "expert" else None
    groups = producer_groups(p, visit, cfg.group_m) if cfg.expert_groups else None
    grid = torch.cuda.get_device_properties(0).multi_processor_count - 1

    def launch():
        launch_producer(
            x, w, y, p, ready, n_signal=b, num_programs=grid, config=cfg, order=visit, groups=groups
        )

    for _ in range(3):
        launch()
    side = torch.cuda.Stream()
    mark = torch.zeros(1, dtype=torch.int64, device=dev)
    # every kernel of the observed runs compiled and loaded first: CUDA loads a module lazily
    # at its first launch and that waits for running kernels, so a first launch of the sleep
    # or the stamp behind the observer would hold the producer until the observer times out
    launch_observer(ready, 0)
    stamp(mark)
    torch.cuda._sleep(1)
    torch.cuda.synchronize()
    shares_b, starts, spans, missed = [], [], [], 0
    for _ in range(reps):
        ready.zero_()
        torch.cuda.synchronize()
        with torch.cuda.stream(side):
            times = launch_observer(ready, cfg.band_increment(n))
        torch.cuda._sleep(SLEEP_CYCLES)  # the producer starts after the observer does
        stamp(mark)  # the producer's start
        launch()
        torch.cuda.synchronize()
        t = times.double().cpu()
        t0, seen = float(mark.item()), t[:b]
        missed = max(missed, int((seen == 0).sum()))
        if missed or float(t[b]) > t0:
            raise RuntimeError(
                f"band_times: the observer missed {missed} of {b} bands or started after the "
                "producer; no share is computed from such a run"
            )
        span = float(seen.max()) - t0
        shares_b.append(((seen - t0) / span).clamp(1e-6, 1.0))
        starts.append((float(t[b]) - t0) / span)
        spans.append(span / 1e6)
    start = float(torch.tensor(starts).median())
    span_ms = float(torch.tensor(spans).median())
    return torch.stack(shares_b).median(0).values, span_ms, missed, start


def measure_workload(spec, plans, order: str, swizzle: str, reps: int, bands: list) -> list:
    """Rows of one workload and tile order: the tokens' ready shares from the measured band
    times and from both models of token_ready.py; appends each rank's bands to `bands`."""
    n = spec.out
    grid = torch.cuda.get_device_properties(0).multi_processor_count - 1
    base = {"out": n, "experts_per_rank": spec.experts_per_rank, "routing": spec.routing}
    base.update(order=order, swizzle=swizzle)
    measured, spans, info = [], [], []
    for c, (_, plan) in enumerate(plans):
        times, span_ms, missed, start = measure_rank(plan, n, order, reps, swizzle)
        uniform = uniform_band_times(plan, order)
        waves = wave_band_times(plan, order, n, K, grid, swizzle)
        measured.append(times)
        spans.append(span_ms)
        info.append((span_ms, missed, start, (times - uniform).abs(), (times - waves).abs()))
        bands.append(
            pd.DataFrame(
                {
                    **base,
                    "rank": c,
                    "span_ms": span_ms,
                    "band": range(plan.n_bands),
                    "model": uniform.numpy(),
                    "waves": waves.numpy(),
                    "measured": times.numpy(),
                }
            )
        )
    base["span_ms"] = max(i[0] for i in info)
    base["bands_missed"] = sum(i[1] for i in info)
    base["observer_start"] = max(i[2] for i in info)
    base["max_band_dev"] = max(float(i[3].max()) for i in info)
    base["max_band_dev_waves"] = max(float(i[4].max()) for i in info)
    rows = []
    for source, bt, model in (
        ("measured", measured, "uniform"),
        ("model", None, "uniform"),
        ("waves", None, "waves"),
    ):
        r = ready_times(
            spec, TILE_M, LAYOUT, order, bt, model=model, grid=grid, swizzle=swizzle, spans=spans
        )
        rows.append({**base, "source": source, **shares(r)})
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=".")
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--n", default="4096,8192")
    ap.add_argument("--experts", default="4,16,64")
    ap.add_argument("--routing", default="balanced,stress_skew")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument(
        "--swizzles", default="table", help="the producer's tile orders (modes.parse_swizzle)"
    )
    a = ap.parse_args()
    ns, experts, routings = parse_grid(ap, a)
    if a.reps < 1 or a.world < 1:
        ap.error("--reps and --world must be >= 1")
    swizzles = a.swizzles.split(",")
    try:
        for sw in swizzles:
            parse_swizzle(sw)
    except ValueError as exc:
        ap.error(str(exc))
    if not torch.cuda.is_available():
        sys.exit(
            "error: band_times needs a CUDA GPU (the producer and its observer are GPU kernels)"
        )
    rows, bands = [], []
    for n in ns:
        for e in experts:
            for routing in routings:
                spec = WorkloadSpec(
                    tokens_per_rank=T,
                    hidden=K,
                    out=n,
                    experts_per_rank=e,
                    top_k=TOP_K,
                    world_size=a.world,
                    routing=routing,
                    dtype="bfloat16",
                )
                order = auto_order(T, TOP_K, e, TILE_M)
                plans = rank_plans(spec, TILE_M, LAYOUT)
                for sw in swizzles:
                    rows += measure_workload(spec, plans, order, sw, a.reps, bands)
                    print(f"[band_times] N={n} E={e} {routing} {sw}: {rows[-3]}", flush=True)
    df = pd.DataFrame(rows)
    for k, v in provenance().items():
        df[k] = v
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    df.to_parquet(out / "band_times.parquet", index=False)
    bands = pd.concat(bands)
    for k, v in provenance().items():
        bands[k] = v
    bands.to_parquet(out / "band_times_bands.parquet", index=False)
    cols = ["out", "experts_per_rank", "routing", "swizzle", "source", "ready_by_0.5"]
    cols += ["ready_by_0.75"]
    cols += ["ready_by_0.9", "mean_ready", "span_ms", "max_band_dev", "max_band_dev_waves"]
    print(df[cols].round(3).to_string(index=False))


if __name__ == "__main__":
    main()
