"""Kernel times of the expert GEMM per implementation, from torch.profiler: where the producers'
gap to torch._grouped_mm sits (main GEMM kernel, preparation kernels), on rank 0's problem of the
W=2 Table 2 operator (experiments/producer.py problem()), one GPU.

Implementations: torch._grouped_mm on the valid rows; the Triton producer (tile table, order
expert, with and without flags); the CUTLASS producer per expert, cluster 2x1 and 1x2 (needs
`make cutlass`); the two cuBLAS references of experiments/producer.py, one dense GEMM of the
valid rows and one batched GEMM of E x (R // E) rows (their kernel names carry cuBLAS's tile
and cluster: names are kept to 160 characters).
Usage: python -m benchmarks.profile_producer [--out DIR] [--reps 10] [--layout compact]
[--workloads 16:balanced,64:stress_skew]; prints one table per workload (implementation,
kernel, calls, us per step) and writes producer_profile.parquet (another layout:
producer_profile_<layout>.parquet).
"""

from __future__ import annotations

import argparse
import os
import sys
from functools import partial
from pathlib import Path

import pandas as pd
import torch

from benchmarks.profiling import kernel_times
from experiments.producer import batched_rows, problem
from harness.workload import WorkloadSpec
from systems.overlap.plan import LAYOUTS

ROUTINGS = ("balanced", "moderate_skew", "stress_skew")


def _impls(pb, sms: int) -> dict:
    """name -> launch of one step."""
    from systems.overlap import cutlass_producer as cp
    from systems.overlap.kernels import launch_producer, pick_config
    from systems.overlap.plan import producer_groups, producer_order

    p, n = pb.plan, pb.w.shape[2]
    y = torch.empty(p.n_padded, n, dtype=pb.x.dtype, device=pb.x.device)
    ready = torch.zeros(p.n_bands, dtype=torch.int32, device=pb.x.device)
    cfg = pick_config(128, pb.x.shape[1], n, pb.x.dtype)
    order = producer_order(p)
    groups = producer_groups(p, order, cfg.group_m) if cfg.expert_groups else None  # per plan
    triton = partial(
        launch_producer,
        pb.x,
        pb.w,
        y,
        p,
        ready,
        num_programs=sms,
        config=cfg,
        order=order,
        groups=groups,
    )
    xb = batched_rows(pb.x_valid, pb.w.shape[0])
    out = {
        "cublas": lambda: torch.matmul(pb.x_valid, pb.w[0]),
        "cublas_bmm": lambda: torch.bmm(xb, pb.w),
        "torch_grouped_mm": lambda: torch._grouped_mm(pb.x_valid, pb.w, offs=pb.offsets),
        "triton (expert order)": triton,
        "triton (expert order, no flags)": partial(triton, signal=False),
    }
    try:
        cp.load()
    except cp.CutlassUnavailable as exc:
        print(f"cutlass producer skipped: {exc}")
        return out
    for name, cluster in (("cutlass_expert (2x1)", (2, 1)), ("cutlass_expert (1x2)", (1, 2))):
        prod = cp.CutlassProducer(cluster, "expert")
        out[name] = lambda prod=prod: prod.launch(pb.x, pb.w, y, p, ready, num_programs=sms)
    return out


def run(spec: WorkloadSpec, reps: int, layout: str = "aligned") -> pd.DataFrame:
    dev = torch.device("cuda")
    pb = problem(spec, 128, layout, dev)
    sms = torch.cuda.get_device_properties(dev).multi_processor_count
    rows = []
    for name, step in _impls(pb, sms).items():
        rows += [{"impl": name, **r, "kernel": r["kernel"][:160]} for r in kernel_times(step, reps)]
    df = pd.DataFrame(rows)
    for k in ("out", "experts_per_rank", "routing"):
        df[k] = getattr(spec, k)
    df["valid_rows"] = int(pb.x_valid.shape[0])
    df["gemm_rows"] = int(pb.plan.n_padded)
    df["layout"] = layout
    return df


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=os.environ.get("OUT", "results"))
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--layout", default="aligned", choices=LAYOUTS)
    ap.add_argument(
        "--workloads",
        default="16:balanced,64:balanced,64:stress_skew,32:balanced",
        help="comma-separated E:routing at T=8192, K=2048, N=8192, W=2",
    )
    args = ap.parse_args()
    work = [w.split(":") for w in args.workloads.split(",")]
    if any(len(w) != 2 or not w[0].isdigit() or w[1] not in ROUTINGS for w in work):
        ap.error(f"--workloads: E:routing pairs with routing in {ROUTINGS}, got {args.workloads}")
    if not torch.cuda.is_available():
        sys.exit("error: profile_producer needs a CUDA GPU (it profiles the expert GEMMs)")
    frames = []
    for E, routing in ((int(e), r) for e, r in work):
        spec = WorkloadSpec(8192, 2048, 8192, E, 2, 2, routing, "bfloat16")
        df = run(spec, args.reps, args.layout)
        frames.append(df)
        tot = df.groupby("impl")["us"].sum().round(1).to_dict()
        print(f"== T=8192 K=2048 N=8192 E={E} W=2 {routing}: us per step {tot}")
        print(df[["impl", "kernel", "calls", "us"]].round(1).to_string(index=False))
    suffix = "" if args.layout == "aligned" else f"_{args.layout}"
    path = Path(args.out) / f"producer_profile{suffix}.parquet"
    path.parent.mkdir(parents=True, exist_ok=True)
    pd.concat(frames).to_parquet(path, index=False)


if __name__ == "__main__":
    main()
