"""The fused scale under Nsight Compute: one launch of each kernel variant at one shape between
cudaProfilerStart/Stop, so `ncu --profile-from-start off` records only these
(benchmarks/h200_session.sh scale_ncu; benchmarks/ncu_summary.py reads the report: time, HBM
bytes and throughput, warps active, stall reasons). A torch copy of the same bytes runs after
them; it is a cudaMemcpyAsync, not a kernel, so ncu does not record it.

Inputs as benchmarks/scale_bound.py: y [k*T, N] bf16, pos a random permutation [T, k], gate
[T, k] float32. Prints the launch order (the names for ncu_summary --impls).
Usage: python -m benchmarks.ncu_scale [--tokens 8192] [--cols 4096] [--variants a,b]
"""

from __future__ import annotations

import argparse

import torch


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--cols", type=int, default=4096)
    ap.add_argument("--top-k", type=int, default=2)
    ap.add_argument("--variants", default="", help="comma-separated; default: every variant")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("ncu_scale needs a CUDA GPU")
    from harness.kernels.scale import VARIANTS, launch_scale

    T, N, k = args.tokens, args.cols, args.top_k
    names = [v for v in args.variants.split(",") if v] or list(VARIANTS)
    bad = sorted(set(names) - set(VARIANTS))
    if bad:
        raise SystemExit(f"unknown variant(s) {bad}; choices: {sorted(VARIANTS)}")
    dev = torch.device("cuda")
    g = torch.Generator().manual_seed(T * 7 + N)
    pos = torch.randperm(T * k, generator=g).view(T, k).to(dev)
    gate = torch.rand(T, k, generator=g).to(dev)
    y = torch.randn(T * k, N, generator=g).to(device=dev, dtype=torch.bfloat16)
    out = torch.empty(T, N, dtype=y.dtype, device=dev)
    src = torch.empty((k + 1) * T * N, dtype=y.dtype, device=dev)
    dst = torch.empty_like(src)
    for name in names:  # compile and warm up outside the profiled range
        launch_scale(y, pos, gate, out, variant=name)
    dst.copy_(src)
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStart()
    for name in names:
        launch_scale(y, pos, gate, out, variant=name)
    dst.copy_(src)
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStop()
    print("launch order:", ",".join(names))


if __name__ == "__main__":
    main()
