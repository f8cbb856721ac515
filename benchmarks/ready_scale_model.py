"""How much of the scale could the ready scale hide, given its kernel's measured speed and when
the tokens become ready? A fluid model next to the measured rows of benchmarks/ready_scale.py.

For each ok row of a variant beside the producer (no SMs taken) the model takes, on the CPU:
the tokens' ready times (the latest band of each token's rows in the waves model of
benchmarks/token_ready.py at the producer's grid, as a share of the producer, times the
measured `producer` ms), the tokens cut into tiles of the variant's block_t in ready order; the
beside kernel scales the tiles one after another at its own measured rate (`alone_ms` for all
T tokens) but none before it is ready; when the producer ends, the rest goes at the tail's rate
(`tail_alone_ms`) or, without a tail, at the beside kernel's. Then
model_hidden = (scale - time left after the producer) / scale: what the variant would hide if
the producer ran as fast beside it as alone. The measured `hidden` falls short of it by what
the scale's programs and polls cost the producer (and by the waves model's error: within 0.12
of the measured ready shares, README "Where the overlapped step's excess comes from"). Where the
table has the producer's span inside the concurrent run (`producer_beside_ms`),
model_hidden_beside plays the same model with the producer as long as it ran there.

Usage: python -m benchmarks.ready_scale_model TABLE.parquet [--out CSV]; prints per row the
measured and the modelled hidden share.
"""

from __future__ import annotations

import argparse
import math
from pathlib import Path

import pandas as pd
import torch


def ready_times(n: int, e: int, routing: str, grid: int) -> torch.Tensor:
    """[T] the tokens' ready times, sorted, as a share of the producer (W=1, compact)."""
    from benchmarks.ready_scale import LAYOUT, TILE_M, TOP_K, K, T
    from benchmarks.token_ready import rank_plans, wave_band_times
    from harness.workload import WorkloadSpec
    from systems.overlap.autotune import auto_order
    from systems.overlap.plan import local_row_map
    from systems.overlap.ready_order import band_of_recv_rows

    spec = WorkloadSpec(T, K, n, e, TOP_K, 1, routing, "bfloat16")
    ((lay, plan),) = rank_plans(spec, TILE_M, LAYOUT)
    band = band_of_recv_rows(plan, local_row_map(plan), lay.send_pos.numel())
    times = wave_band_times(plan, auto_order(T, TOP_K, e, TILE_M), n, K, grid)
    return torch.sort(times[band[lay.send_pos]].amax(1)).values


def time_left(ready_ms: torch.Tensor, block_t: int, beside_ms: float, tail_ms: float, end: float):
    """ms of scaling left when the producer ends at `end`: tiles in ready order, each taking
    beside_ms / tiles and starting no earlier than its last token's ready time; what is left at
    `end` goes at tail_ms for all tiles."""
    tiles = math.ceil(ready_ms.numel() / block_t)
    tile_ready = ready_ms[
        torch.clamp(torch.arange(1, tiles + 1) * block_t, max=ready_ms.numel()) - 1
    ]
    step, t, done = beside_ms / tiles, 0.0, 0.0
    for r in tile_ready.tolist():
        start = max(t, r)
        if start >= end:
            break
        t = start + step
        done += 1.0 if t <= end else (end - start) / step
        if t >= end:
            break
    return (tiles - done) * tail_ms / tiles


def model_rows(df: pd.DataFrame) -> pd.DataFrame:
    """The ok beside rows of a ready_scale table with model_hidden next to hidden."""
    keys = ["out", "experts_per_rank", "routing"]
    base = df[df["variant"].isin(["producer", "scale"])].pivot_table(
        index=keys, columns="variant", values="ms"
    )
    rows = df[(df["status"] == "ok") & df["alone_ms"].notna() & (df["taken"] == 0)]
    cache: dict[tuple, torch.Tensor] = {}
    out = []
    for _, r in rows.iterrows():
        key = (int(r["out"]), int(r["experts_per_rank"]), r["routing"])
        prod, scale = base.loc[key, "producer"], base.loc[key, "scale"]
        grid = int(r["producer_sms"])
        if key + (grid,) not in cache:
            cache[key + (grid,)] = ready_times(*key, grid)
        tail = r["tail_alone_ms"] if r.get("tail_per_sm", 0) else r["alone_ms"]
        left = time_left(cache[key + (grid,)] * prod, int(r["block_t"]), r["alone_ms"], tail, prod)
        res = {**dict(zip(keys, key)), "variant": r["variant"], "hidden": r["hidden"],
               "model_hidden": (scale - left) / scale, "left_ms": left}  # fmt: skip
        beside = r.get("producer_beside_ms", float("nan"))
        if beside == beside:  # measured (newer tables): the producer as long as it ran there
            ready = cache[key + (grid,)] * beside
            left_b = time_left(ready, int(r["block_t"]), r["alone_ms"], tail, beside)
            res["model_hidden_beside"] = (prod + scale - beside - left_b) / scale
        out.append(res)
    return pd.DataFrame(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("table")
    ap.add_argument("--out", default=None, help="write the rows to this CSV")
    a = ap.parse_args()
    if not Path(a.table).exists():
        ap.error(f"no table at {a.table}")
    df = pd.read_parquet(a.table)
    need = {"variant", "status", "alone_ms", "block_t", "producer_sms", "taken", "hidden"}
    if not need <= set(df.columns):
        ap.error(
            f"{a.table} lacks {sorted(need - set(df.columns))}: a ready_scale table since 3f375f3"
        )
    res = model_rows(df)
    if a.out:
        res.to_csv(a.out, index=False)
    print(res.round(3).to_string(index=False))
    cols = [c for c in ("hidden", "model_hidden", "model_hidden_beside") if c in res]
    med = res.groupby("variant")[cols].median().round(3)
    print("\nmedian per variant:\n" + med.to_string())


if __name__ == "__main__":
    main()
