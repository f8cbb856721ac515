"""The fused scale against its memory bound (issue: within 1.15x), measured in one run.

Per shape (T tokens, N columns, top-k, dtype) on one device:
  scale_ms  harness.scale.Scaler: out[t] = sum_j gate[t, j] * y[pos[t, j]], pos a random
            permutation of the k*T rows (the send order); on CUDA also every kernel variant of
            harness/kernels/scale.py (VARIANTS), one row each (`variant`; `default`: the Scaler)
  copy_ms   torch copy_ of (k+1)*T*N elements, the scale's bytes (read k*T*N, write T*N), read
            AND written, so the copy moves 2x; copy_gbps counts read + write
  bound_ms  (k+1)*T*N*elem / copy_gbps; ratio = scale_ms / bound_ms (1.0: at copy bandwidth)
Each variant is checked against float32 first (rel_err); one past TOL records status=fail and no
times. Times: harness.timing.time_fn queued ahead (the device back to back); the eager times
(scale_eager_ms, copy_eager_ms) add the host's launch time, longer than the ~0.05 ms kernel.
Usage: python -m benchmarks.scale_bound [--out DIR] [--small] (prints a short table last).
"""

from __future__ import annotations

import argparse
import itertools
import os
from functools import partial
from pathlib import Path

import pandas as pd
import torch

from harness.scale import Scaler
from harness.timing import time_fn

FULL = {"tokens": [8192, 16384], "cols": [2048, 4096, 8192]}
SMALL = {"tokens": [64], "cols": [128]}
#: largest relative error (Frobenius, against float32) a timed variant may have
TOL = 1e-2


def measure(T: int, N: int, device: torch.device, iters: int) -> list[dict]:
    k, dtype = 2, torch.bfloat16  # top-2, the layers' dtype
    g = torch.Generator(device="cpu").manual_seed(T * 7 + N)
    pos = torch.randperm(T * k, generator=g).view(T, k)
    gate = torch.rand(T, k, generator=g)
    y = torch.randn(T * k, N, generator=g).to(device=device, dtype=dtype)
    scale = Scaler(pos, gate, device)
    ref = (y.float()[pos.view(-1).to(device)].view(T, k, N) * gate.to(device)[..., None]).sum(1)
    err = float((scale(y).float() - ref).norm() / ref.norm())
    src = torch.empty((k + 1) * T * N, dtype=dtype, device=device)
    dst = torch.empty_like(src)
    runs = {"default": (lambda: scale(y), err)}
    if scale.fused:
        from harness.kernels.scale import VARIANTS, launch_scale

        out = torch.empty(T, N, dtype=dtype, device=device)
        for name in VARIANTS:
            run = partial(launch_scale, y, scale.pos, scale.gate, out, variant=name)
            runs[name] = (run, float((run().float() - ref).norm() / ref.norm()))

    def timed(fn) -> tuple[float, float]:
        """(queued, eager) median ms of fn, in that order."""
        kw = dict(device=device, warmup=3, iters=iters)
        return tuple(time_fn(fn, **kw, queue_ahead=q).median_ms for q in (True, False))

    copy_ms, copy_eager_ms = timed(lambda: dst.copy_(src))
    elem = y.element_size()
    nbytes = (k + 1) * T * N * elem
    gbps = 2 * nbytes / copy_ms / 1e6
    bound = nbytes / gbps / 1e6
    rows, cuda = [], device.type == "cuda"
    for name, (fn, e) in runs.items():
        ok = e <= TOL
        scale_ms, scale_eager_ms = timed(fn) if ok else (float("nan"), float("nan"))
        row = dict(tokens=T, cols=N, top_k=k, dtype=str(dtype).removeprefix("torch."))
        row |= dict(fused=scale.fused, variant=name, default=name == "default")
        row |= dict(status="ok" if ok else "fail", scale_ms=scale_ms, copy_ms=copy_ms)
        row |= dict(scale_eager_ms=scale_eager_ms, copy_eager_ms=copy_eager_ms)
        row |= dict(timing="queued" if cuda else "host", copy_gbps=gbps, bound_ms=bound)
        row |= dict(ratio=scale_ms / bound, rel_err=e)
        row |= dict(device=torch.cuda.get_device_name(device) if cuda else "cpu")
        row |= dict(torch_version=torch.__version__, git_rev=os.environ.get("HARNESS_GIT_REV", ""))
        rows.append(row)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=os.environ.get("OUT", "results"))
    ap.add_argument("--small", action="store_true")
    ap.add_argument("--iters", type=int, default=20)
    args = ap.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    shapes = SMALL if args.small or device.type == "cpu" else FULL
    pairs = itertools.product(shapes["tokens"], shapes["cols"])
    rows = [row for T, N in pairs for row in measure(T, N, device, args.iters)]
    df = pd.DataFrame(rows)
    path = Path(args.out) / "scale_bound.parquet"
    path.parent.mkdir(parents=True, exist_ok=True)
    df.to_parquet(path, index=False)
    print(df.pivot_table(index=["tokens", "cols"], columns="variant", values="ratio").round(3))
    cols = ["tokens", "cols", "variant", "scale_ms", "scale_eager_ms", "bound_ms", "ratio"]
    print(df[df.variant == "default"][cols].round(4).to_string(index=False))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
