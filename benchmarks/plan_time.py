"""Stage A cost: time to build the combine plan on the device, next to the expert GEMM time.

Table 2 shapes (FULL, every routing), one rank's plan (default rank 0: the hottest under skew).
  plan_ms         build_plan on device-resident layout arrays (its one host sync included)
  plan_dev_ms     build_plan_device on the same arrays (no host sync; worst-case sized)
  input_dev_ms    padded_input_device: the padded GEMM input X [P', K] from x_recv
  dev_plan_ok     the device plan equals build_plan's (checked before timing; else an error)
  gemm_ms         the expert GEMM on the same rows, unpadded (harness.experts.expert_gemm)
  gemm_padded_ms  the same GEMM on the plan's padded rows [P, K], checked against float32 first
Times: harness.timing.time_fn (eager), median (p10, p90). Usage: python -m benchmarks.plan_time
[--device cpu --small] (on the CPU the device plan's Triton kernels run in the interpreter).
Writes $OUT/plan_time.parquet (or --out) and prints a short table last.
"""

from __future__ import annotations

import argparse
import itertools
import os
from collections.abc import Callable
from functools import partial
from pathlib import Path

import pandas as pd
import torch

from experiments.producer import reference_y
from harness.check import check
from harness.experts import expert_gemm, expert_gemm_impl
from harness.layout import rank_layout
from harness.measure import SPEC_KEYS
from harness.routing import ROUTINGS
from harness.timing import time_fn
from harness.workload import WorkloadSpec, imbalance_of
from systems.overlap.plan import build_plan, plan_difference

FULL = {"tokens": [8192, 16384], "experts": [4, 8, 16, 32, 64], "hidden": 2048, "out": 8192}
SMALL = {"tokens": [128, 256], "experts": [4, 8], "hidden": 64, "out": 128}


def _ms(fn: Callable[[], object], device: torch.device, warmup: int, iters: int):
    """harness.timing.time_fn, eager: (median, p10, p90) ms of fn()."""
    t = time_fn(fn, device=device, warmup=warmup, iters=iters)
    return t.median_ms, t.p10_ms, t.p90_ms


def gemm_times(plan, lay, spec: WorkloadSpec, device, warmup: int, iters: int) -> dict:
    """Expert GEMM times on the rows of one rank [R, K] x [E, K, N], unpadded and padded [P, K];
    the padded GEMM's valid rows are checked against the float32 reference first."""
    E, K, N = spec.experts_per_rank, spec.hidden, spec.out
    g = torch.Generator(device=device).manual_seed(plan.rank)
    w = (torch.randn(E, K, N, generator=g, device=device) * K**-0.5).to(spec.torch_dtype)
    n = plan.sizes()
    x = torch.randn(n["n_rows"], K, generator=g, device=device).to(spec.torch_dtype)
    xp = torch.zeros(n["n_padded"], K, device=device, dtype=spec.torch_dtype)
    xp[plan.row_pos] = x
    counts = lay.expert_counts.tolist()
    padded_counts = plan.expert_row_start.diff().tolist()
    want = reference_y(plan.expert_row_start.tolist(), xp, w)[plan.row_pos]  # float32 [R, N]
    res = check(expert_gemm(xp, padded_counts, w)[plan.row_pos], want)
    if not res.ok:
        raise RuntimeError(f"plan_time: the padded GEMM's rows are wrong: {res.message}")
    return {
        "gemm_ms": _ms(partial(expert_gemm, x, counts, w), device, warmup, iters)[0],
        "gemm_padded_ms": _ms(partial(expert_gemm, xp, padded_counts, w), device, warmup, iters)[0],
        "gemm_impl": expert_gemm_impl(x, w),
    }


def device_plan_times(plan, args: tuple, kw: dict, spec: WorkloadSpec, device, warmup, iters):
    """build_plan_device and padded_input_device times on the same rows as `plan` (build_plan's,
    the reference), once the device plan is checked equal to it (else a RuntimeError)."""
    from systems.overlap.plan_device import build_plan_device, padded_input_device

    dplan = build_plan_device(*args, **kw)
    differs = plan_difference(plan, dplan)
    if differs is not None:
        raise RuntimeError(f"plan_time: the device plan's {differs} differs from build_plan's")
    d50, d10, d90 = _ms(partial(build_plan_device, *args, **kw), device, warmup, iters)
    x_recv = torch.randn(plan.max_rows, spec.hidden, device=device).to(spec.torch_dtype)
    xp = torch.empty(dplan.max_padded, spec.hidden, device=device, dtype=spec.torch_dtype)
    fill = partial(padded_input_device, x_recv, dplan, xp)
    out = dict(plan_dev_ms=d50, plan_dev_p10_ms=d10, plan_dev_p90_ms=d90)
    out |= dict(input_dev_ms=_ms(fill, device, warmup, iters)[0], dev_plan_ok=True)
    out |= dict(max_padded=dplan.max_padded, max_bands=dplan.max_bands)
    return out | dict(max_segments=dplan.max_segments)


def bench_one(spec: WorkloadSpec, rank: int, tile_m: int, mgb: int, device, warmup, iters):
    """Plan build time and GEMM times of one rank of one cell."""
    lay = rank_layout(spec, rank)
    args = tuple(t.to(device) for t in (lay.recv_src, lay.recv_expert, lay.recv_dst_index))
    kw = dict(world_size=spec.world_size, rank=rank, experts_per_rank=spec.experts_per_rank)
    kw |= dict(tile_m=tile_m, mgb=mgb, out_cols=spec.out, elem_bytes=spec.torch_dtype.itemsize)
    kw["send_counts"] = lay.send_counts.to(device)
    plan = build_plan(*args, **kw)
    n = plan.sizes()
    dev = device_plan_times(plan, args, kw, spec, device, warmup, iters)
    p50, p10, p90 = _ms(partial(build_plan, *args, **kw), device, warmup, iters)
    gemm = gemm_times(plan, lay, spec, device, warmup, iters)
    if device.type == "cuda":
        torch.cuda.empty_cache()
    gpu = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    row = dict(device=device.type, gpu_name=gpu, torch_version=torch.__version__)
    row |= {k: getattr(spec, k) for k in ("world_size", *SPEC_KEYS)}
    row |= dict(rank=rank, imbalance_rank=imbalance_of(spec)["imbalance_rank"])
    row |= dict(tile_m=tile_m, mgb=mgb, rows=n["n_rows"], padded_rows=n["n_padded"])
    row |= dict(pad_share=(n["n_padded"] - n["n_rows"]) / max(1, n["n_padded"]))
    row |= dict(bands=n["n_bands"], remote_bands=n["n_remote_bands"], segments=n["n_segments"])
    row |= dict(plan_ms=p50, plan_p10_ms=p10, plan_p90_ms=p90, **gemm)
    row["plan_over_gemm"] = p50 / gemm["gemm_ms"] if gemm["gemm_ms"] > 0 else float("nan")
    return row | dev | dict(warmup=warmup, iters=iters)


def main() -> None:
    ap = argparse.ArgumentParser(description="Plan build time vs expert GEMM time (Table 2).")
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    ap.add_argument("--small", action="store_true", help="tiny shapes (a quick check)")
    ap.add_argument("--out", default="", help="parquet path (default $OUT/plan_time.parquet)")
    ap.add_argument("--tile-m", type=int, default=128)
    ap.add_argument("--mgb", type=int, default=2)
    ap.add_argument("--ranks", type=int, nargs="+", default=[0])
    ap.add_argument("--world-size", type=int, default=4)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--dtype", default="", help="default bfloat16 on cuda, float32 on cpu")
    args = ap.parse_args()
    device = torch.device(args.device)
    if device.type == "cpu":  # the device plan's Triton kernels through the interpreter
        os.environ.setdefault("TRITON_INTERPRET", "1")
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda but no CUDA GPU is present (try --device cpu --small)")
    shapes = SMALL if args.small else FULL
    dtype = args.dtype or ("bfloat16" if device.type == "cuda" else "float32")
    rows = []
    for tokens, E, routing in itertools.product(shapes["tokens"], shapes["experts"], ROUTINGS):
        spec = WorkloadSpec(
            tokens, shapes["hidden"], shapes["out"], E, 2, args.world_size, routing, dtype=dtype
        )
        if not rows:  # one discarded cell first: allocator, kernels and library handles warm up
            bench_one(spec, args.ranks[0], args.tile_m, args.mgb, device, 1, 1)
        for rank in args.ranks:
            r = bench_one(spec, rank, args.tile_m, args.mgb, device, args.warmup, args.iters)
            rows.append(r)
            print(
                f"[plan_time] T={tokens} E={E} {routing} rank {rank}: plan {r['plan_ms']:.3f} ms,"
                f" device plan {r['plan_dev_ms']:.4f} ms, gemm {r['gemm_ms']:.3f} ms",
                flush=True,
            )
    df = pd.DataFrame(rows)
    out = Path(args.out or Path(os.environ.get("OUT", ".")) / "plan_time.parquet")
    out.parent.mkdir(parents=True, exist_ok=True)
    df.to_parquet(out, index=False)
    cols = "tokens_per_rank experts_per_rank routing rank rows pad_share bands segments plan_ms"
    cols = [*cols.split(), "plan_dev_ms", "input_dev_ms", "gemm_ms", "gemm_padded_ms"]
    print(f"[plan_time] wrote {len(df)} rows to {out}; gemm impl: {', '.join(set(df.gemm_impl))}")
    with pd.option_context("display.width", 200, "display.max_rows", 100):
        print(df[cols].to_string(index=False, float_format=lambda v: f"{v:.4g}"))


if __name__ == "__main__":
    main()
