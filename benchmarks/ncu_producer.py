"""The expert GEMMs of one workload, each launched once inside cudaProfilerStart/Stop: the target
that Nsight Compute profiles (`ncu --profile-from-start off`) to find where the Triton producer
loses to torch._grouped_mm (stall reasons, tensor-pipe activity, L2 and DRAM traffic).

Rank 0's problem of the W=2 operator (experiments/producer.py problem()), T=8192, K=2048, bf16,
one GPU. Implementations, in launch order: torch._grouped_mm on the valid rows; one dense cuBLAS
matmul on the same rows; the Triton producer (tile table, order expert, flags) with local=direct
and local=copy, then the CONFIGS named by --configs at local=direct; the CUTLASS producer per
expert, cluster 1x2 (where `make cutlass` built it). Each is checked against the float32
reference before it is profiled.
Usage: ncu ... python -m benchmarks.ncu_producer --workload 16:moderate_skew [--out-n 8192]
[--layout compact] [--configs eg16,eg32]; benchmarks/ncu_summary.py reads ncu's raw CSV.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import replace
from functools import partial

import torch

from experiments.producer import CONFIGS, problem
from harness.check import check
from harness.workload import WorkloadSpec
from systems.overlap.plan import LAYOUTS

ROUTINGS = ("balanced", "moderate_skew", "stress_skew")


def impls(pb, sms: int, configs: list[str]) -> dict:
    """name -> (launch of one step, its output rows in valid order [R, N]); configs: names of
    experiments/producer.py CONFIGS run as more Triton variants at local=direct."""
    from systems.overlap import cutlass_producer as cp
    from systems.overlap.kernels import launch_producer, pick_config
    from systems.overlap.plan import local_row_map, producer_groups, producer_order

    p, n = pb.plan, pb.w.shape[2]
    dev = pb.x.device
    y = torch.zeros(p.n_padded, n, dtype=pb.x.dtype, device=dev)
    ready = torch.zeros(p.n_bands, dtype=torch.int32, device=dev)
    cfg = pick_config(128, pb.x.shape[1], n, pb.x.dtype)
    order = producer_order(p)
    row_dst = local_row_map(p)
    recv = torch.zeros(int(row_dst.max()) + 1, n, dtype=y.dtype, device=dev)
    gm_out: list[torch.Tensor] = []
    w0 = pb.w[0]

    def direct_out():
        mine = row_dst >= 0
        out = y.clone()
        out[mine] = recv[row_dst[mine]]
        return out[pb.valid]

    def triton(c, direct: bool):
        """One launch of the Triton producer with config c; its groups built once, here."""
        g = producer_groups(p, order, c.group_m) if c.expert_groups else None
        local_to = (recv, row_dst) if direct else None
        return partial(
            launch_producer,
            pb.x,
            pb.w,
            y,
            p,
            ready,
            num_programs=sms,
            config=c,
            order=order,
            groups=g,
            local_to=local_to,
        )

    out = {
        "torch_grouped_mm": (
            lambda: gm_out.append(torch._grouped_mm(pb.x_valid, pb.w, offs=pb.offsets)),
            lambda: gm_out[-1],
        ),
        "cublas (dense, same rows)": (lambda: torch.matmul(pb.x_valid, w0), None),
        "triton (table, direct)": (triton(cfg, True), direct_out),
        "triton (table, copy)": (triton(cfg, False), lambda: y[pb.valid]),
    }
    for name in configs:
        out[f"triton ({name}, direct)"] = (triton(replace(cfg, **CONFIGS[name]), True), direct_out)
    try:
        cp.load()
    except cp.CutlassUnavailable as exc:
        print(f"cutlass producer skipped: {exc}")
        return out
    prod = cp.CutlassProducer((1, 2), "expert")
    out["cutlass_expert (1x2)"] = (
        lambda: prod.launch(pb.x, pb.w, y, p, ready, num_programs=sms),
        lambda: y[pb.valid],
    )
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workload", default="16:moderate_skew", help="E:routing")
    ap.add_argument("--out-n", type=int, default=8192)
    ap.add_argument("--layout", default="compact", choices=LAYOUTS)
    ap.add_argument("--configs", default="", help="comma-separated CONFIGS names")
    args = ap.parse_args()
    configs = [c for c in args.configs.split(",") if c]
    if any(c not in CONFIGS for c in configs):
        ap.error(f"--configs: names from {sorted(CONFIGS)}, got {args.configs}")
    e, _, routing = args.workload.partition(":")
    if not e.isdigit() or routing not in ROUTINGS:
        ap.error(f"--workload: E:routing with routing in {ROUTINGS}, got {args.workload}")
    if not torch.cuda.is_available():
        sys.exit("error: ncu_producer needs a CUDA GPU (it runs the expert GEMMs under ncu)")
    spec = WorkloadSpec(8192, 2048, args.out_n, int(e), 2, 2, routing, "bfloat16")
    dev = torch.device("cuda")
    pb = problem(spec, 128, args.layout, dev)
    sms = torch.cuda.get_device_properties(dev).multi_processor_count
    ref = pb.ref_y()[pb.valid]
    steps = impls(pb, sms, configs)
    for name, (step, result) in steps.items():
        for _ in range(3):
            step()
        torch.cuda.synchronize()
        if result is not None:
            res = check(result().float(), ref, tol=8e-3)
            if not res.ok:
                raise SystemExit(f"{name}: wrong result, {res}")
    torch.cuda.cudart().cudaProfilerStart()
    for step, _ in steps.values():
        step()
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStop()
    print(f"profiled {args.workload} N={args.out_n} {args.layout}: " + " | ".join(steps))


if __name__ == "__main__":
    main()
