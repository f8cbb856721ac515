"""Stage A cost: time to build the combine plan on the device, next to the expert GEMM time.

Table 2 shapes (tokens per rank 8192 / 16384, top-2, W=4 logical, E in {4..64}, K=2048,
N=8192, three routings), the plan of one rank (rank 0 by default: the hottest under skew).
  plan_ms         systems.overlap.plan.build_plan on device-resident layout arrays (its one
                  host sync included), CUDA events (host clock on the CPU), warm-up, median
  plan_dev_ms     systems.overlap.plan_device.build_plan_device on the same arrays (no host
                  sync; worst-case sized): the stage-A cost inside a timed step
  input_dev_ms    padded_input_device: the padded GEMM input X [P', K] from x_recv (one kernel)
  dev_plan_ok     the device plan's valid prefixes equal build_plan's (checked once, untimed)
  gemm_ms         the expert GEMM on the same rows, unpadded (harness.experts.expert_gemm:
                  torch._grouped_mm bf16 on Hopper, per-expert matmul elsewhere)
  gemm_padded_ms  the same GEMM on the plan's padded layout (P rows)
Usage:
  python -m benchmarks.plan_time                        # GPU, Table 2 shapes
  python -m benchmarks.plan_time --device cpu --small   # quick check anywhere (the device plan's
                                                        # Triton kernels in the interpreter)
Writes $OUT/plan_time.parquet (or --out) and prints a short table last.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path

import pandas as pd
import torch

from harness.experts import expert_gemm, expert_gemm_impl
from harness.layout import rank_layout
from harness.routing import ROUTINGS
from harness.workload import WorkloadSpec, imbalance_of
from systems.overlap.plan import build_plan

FULL = {"tokens": [8192, 16384], "experts": [4, 8, 16, 32, 64], "hidden": 2048, "out": 8192}
SMALL = {"tokens": [128, 256], "experts": [4, 8], "hidden": 64, "out": 128}


def time_ms(fn: Callable[[], object], device: torch.device, warmup: int, iters: int) -> list[float]:
    """Per-iteration times (ms) of fn(): CUDA events on the GPU, the host clock on the CPU."""
    for _ in range(warmup):
        fn()
    out = []
    for _ in range(iters):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            torch.cuda.synchronize(device)
            out.append(start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            fn()
            out.append((time.perf_counter() - t0) * 1e3)
    return out


def _summary(ms: list[float]) -> tuple[float, float, float]:
    q = sorted(ms)
    return statistics.median(q), q[len(q) // 10], q[min(len(q) - 1, (9 * len(q)) // 10)]


def gemm_times(
    plan, lay, spec: WorkloadSpec, device: torch.device, warmup: int, iters: int
) -> tuple[list[float], list[float], str]:
    """Expert GEMM times on the rows of one rank [R, K] x [E, K, N], unpadded and padded [P, K]."""
    E, K, N = spec.experts_per_rank, spec.hidden, spec.out
    g = torch.Generator(device=device).manual_seed(plan.rank)
    w = (torch.randn(E, K, N, generator=g, device=device) * K**-0.5).to(spec.torch_dtype)
    x = torch.randn(plan.n_rows, K, generator=g, device=device).to(spec.torch_dtype)
    xp = torch.zeros(plan.n_padded, K, device=device, dtype=spec.torch_dtype)
    xp[plan.row_pos] = x
    counts = lay.expert_counts.tolist()
    padded_counts = plan.expert_row_start.diff().tolist()
    gemm = time_ms(partial(expert_gemm, x, counts, w), device, warmup, iters)
    gemm_pad = time_ms(partial(expert_gemm, xp, padded_counts, w), device, warmup, iters)
    return gemm, gemm_pad, expert_gemm_impl(x, w)


def device_plan_times(
    plan, src, exp, dst, send_counts, spec: WorkloadSpec, device, warmup: int, iters: int
) -> dict:
    """build_plan_device and padded_input_device times on the same rows as `plan` (build_plan's),
    and whether the device plan equals it (checked once, outside the timing)."""
    from systems.overlap.plan_device import build_plan_device, padded_input_device

    kw = dict(
        world_size=plan.world_size,
        rank=plan.rank,
        experts_per_rank=plan.experts_per_rank,
        tile_m=plan.tile_m,
        mgb=plan.mgb,
        out_cols=plan.out_cols,
        elem_bytes=plan.elem_bytes,
        send_counts=send_counts,
    )

    def fn():
        return build_plan_device(src, exp, dst, **kw)

    dev_ms = time_ms(fn, device, warmup, iters)
    dplan = fn()
    host = dplan.to_host_plan()
    ok = all(
        torch.equal(a, b) if isinstance(a, torch.Tensor) else a == b
        for a, b in ((getattr(plan, k), getattr(host, k)) for k in vars(plan))
        if a is not None
    )
    x_recv = torch.randn(plan.n_rows, spec.hidden, device=device).to(spec.torch_dtype)
    xp = torch.empty(dplan.max_padded, spec.hidden, device=device, dtype=spec.torch_dtype)
    in_ms = time_ms(partial(padded_input_device, x_recv, dplan, xp), device, warmup, iters)
    d50, d10, d90 = _summary(dev_ms)
    return {
        "plan_dev_ms": d50,
        "plan_dev_p10_ms": d10,
        "plan_dev_p90_ms": d90,
        "input_dev_ms": _summary(in_ms)[0],
        "dev_plan_ok": bool(ok),
        "max_padded": dplan.max_padded,
        "max_bands": dplan.max_bands,
        "max_segments": dplan.max_segments,
    }


def bench_one(
    spec: WorkloadSpec,
    rank: int,
    tile_m: int,
    mgb: int,
    device: torch.device,
    warmup: int,
    iters: int,
) -> dict:
    """Plan build time and GEMM times of one rank of one cell."""
    lay = rank_layout(spec, rank)
    src, exp, dst = (t.to(device) for t in (lay.recv_src, lay.recv_expert, lay.recv_dst_index))
    send_counts = lay.send_counts.to(device)
    elem = torch.empty(0, dtype=spec.torch_dtype).element_size()

    def plan_fn():
        return build_plan(
            src,
            exp,
            dst,
            world_size=spec.world_size,
            rank=rank,
            experts_per_rank=spec.experts_per_rank,
            tile_m=tile_m,
            mgb=mgb,
            out_cols=spec.out,
            elem_bytes=elem,
            send_counts=send_counts,
        )

    plan_ms = time_ms(plan_fn, device, warmup, iters)
    plan = plan_fn()
    dev = device_plan_times(plan, src, exp, dst, send_counts, spec, device, warmup, iters)
    gemm_ms, gemm_pad_ms, impl = gemm_times(plan, lay, spec, device, warmup, iters)
    if device.type == "cuda":
        torch.cuda.empty_cache()
    p50, p10, p90 = _summary(plan_ms)
    E, K, N = spec.experts_per_rank, spec.hidden, spec.out
    g50, gp50 = _summary(gemm_ms)[0], _summary(gemm_pad_ms)[0]
    imb = imbalance_of(spec)
    return {
        "device": device.type,
        "gpu_name": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "torch_version": torch.__version__,
        "world_size": spec.world_size,
        "rank": rank,
        "tokens_per_rank": spec.tokens_per_rank,
        "experts_per_rank": E,
        "top_k": spec.top_k,
        "hidden": K,
        "out": N,
        "dtype": spec.dtype,
        "routing": spec.routing,
        "imbalance_rank": imb["imbalance_rank"],
        "tile_m": tile_m,
        "mgb": mgb,
        "rows": plan.n_rows,
        "padded_rows": plan.n_padded,
        "pad_share": plan.n_padding / max(1, plan.n_padded),
        "bands": plan.n_bands,
        "remote_bands": plan.n_remote_bands,
        "segments": plan.n_segments,
        "plan_ms": p50,
        "plan_p10_ms": p10,
        "plan_p90_ms": p90,
        "gemm_ms": g50,
        "gemm_padded_ms": gp50,
        "gemm_impl": impl,
        "plan_over_gemm": p50 / g50 if g50 > 0 else float("nan"),
        **dev,
        "warmup": warmup,
        "iters": iters,
    }


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
    warm = True  # one discarded cell first: allocator, kernels and library handles warm up
    for tokens in shapes["tokens"]:
        for E in shapes["experts"]:
            for routing in ROUTINGS:
                spec = WorkloadSpec(
                    tokens_per_rank=tokens,
                    hidden=shapes["hidden"],
                    out=shapes["out"],
                    experts_per_rank=E,
                    top_k=2,
                    world_size=args.world_size,
                    routing=routing,
                    dtype=dtype,
                )
                if warm:
                    bench_one(spec, args.ranks[0], args.tile_m, args.mgb, device, 1, 1)
                    warm = False
                for rank in args.ranks:
                    r = bench_one(
                        spec, rank, args.tile_m, args.mgb, device, args.warmup, args.iters
                    )
                    rows.append(r)
                    print(
                        f"[plan_time] T={tokens} E={E} {routing} rank {rank}: plan "
                        f"{r['plan_ms']:.3f} ms, device plan {r['plan_dev_ms']:.4f} ms "
                        f"(equal: {r['dev_plan_ok']}), gemm {r['gemm_ms']:.3f} ms",
                        flush=True,
                    )
    df = pd.DataFrame(rows)
    out = Path(args.out or Path(os.environ.get("OUT", ".")) / "plan_time.parquet")
    out.parent.mkdir(parents=True, exist_ok=True)
    df.to_parquet(out, index=False)
    cols = [
        "tokens_per_rank",
        "experts_per_rank",
        "routing",
        "rank",
        "rows",
        "pad_share",
        "bands",
        "segments",
        "plan_ms",
        "plan_dev_ms",
        "input_dev_ms",
        "dev_plan_ok",
        "gemm_ms",
        "gemm_padded_ms",
        "plan_over_gemm",
    ]
    print(f"[plan_time] wrote {len(df)} rows to {out}; gemm impl: {', '.join(set(df.gemm_impl))}")
    with pd.option_context("display.width", 200, "display.max_rows", 100):
        print(df[cols].to_string(index=False, float_format=lambda v: f"{v:.4g}"))


if __name__ == "__main__":
    main()
