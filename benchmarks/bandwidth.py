"""Consumer bandwidth vs transfer (segment) size: the paper's Fig 3a, measured through our consumer.

For each transport available on this machine, each cCTA in --cctas and each segment size in
16 KiB .. 16 MiB (powers of two), the consumer kernel (systems/overlap/kernels/consumer.py,
default ConsumerConfig) ships n_seg segments of that size with its flags pre-set (it still
polls them: the acquire load per band is part of the path), one band per segment, and signals
the receiver once per segment. GB/s = bytes moved / median time (triton do_bench).

  loopback         ONE GPU playing W = 4 ranks: destinations are regions of local memory. This
                   is a local copy through the consumer, NOT an interconnect measurement; the
                   `transport` column says loopback on every such row.
  nvshmem/store    (child process, W = 1, PE 0, sizes 4x apart) Triton stores through the
  nvshmem/put_signal  NVSHMEM symmetric address / putmem_block + putmem_signal_block (32 warps):
                   also local.
  p2p / nvshmem over NVLink need >= 2 GPUs and one process per GPU: rows say skipped here.

Output: bandwidth.parquet (and .csv) with columns transport, ccta, bytes, gbps, ms, status,
reason (+ n_segments, total_bytes, gpu) under --out (default $OUT or results/).
Usage (repository root): python -m benchmarks.bandwidth [--out DIR] [--cctas 2,4,8,14,16,24]
       [--quick] [--consumer-json best_consumer.json]   (default: ConsumerConfig())
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import subprocess
import sys
import time
import traceback

import torch

from benchmarks.kernels_h200 import bench_ms
from systems.overlap.testing import expected_sends, synthetic_plan

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # default --out: ROOT/results

N = 4096  # columns: one bf16 row = 8 KiB
SIZES = [16 << 10 << i for i in range(11)]  # 16 KiB .. 16 MiB
MIN_TOTAL = 64 << 20  # bytes per measurement at least


def segments_plan(seg_bytes: int, ccta: int, world: int, device, cap: int = 1 << 30) -> tuple:
    """A plan of n_seg one-band segments of seg_bytes each, destinations round-robin.

    n_seg: enough for MIN_TOTAL bytes and two segments per CTA, a multiple of ccta (no tail
    imbalance), at most `cap` bytes in all.
    """
    rows_per_seg = max(1, seg_bytes // (N * 2))
    seg = rows_per_seg * N * 2
    n_seg = max(2 * ccta, -(-MIN_TOTAL // seg))
    n_seg = -(-n_seg // ccta) * ccta  # every CTA ships the same number of segments
    n_seg = max(1, min(n_seg, 8192, cap // seg))
    rows = [[0] * (world + 1) for _ in range(n_seg)]
    for s in range(n_seg):
        rows[s][s % world] = rows_per_seg
    plan = synthetic_plan(rows, rank=world, tile_m=rows_per_seg, device=device)
    return plan, rows_per_seg * N * 2, n_seg


def measure(plan, y, recv_tab, sig_tab, *, ccta, scope, put_mode, cfg, check) -> dict:
    from systems.overlap.errors import new_error_buffer, raise_if_error
    from systems.overlap.kernels import launch_consumer

    ready = torch.ones(plan.n_bands, dtype=torch.int32, device=y.device)
    err = new_error_buffer(y.device)
    clock = torch.zeros(ccta, dtype=torch.int64, device=y.device)
    go = functools.partial(
        launch_consumer,
        y,
        plan,
        ready,
        recv_tab,
        sig_tab,
        err,
        clock,
        ready_target=1,
        rank=0,
        ccta=ccta,
        config=cfg,
        wait=True,
        scope=scope,
        put_mode=put_mode,
    )
    go()
    torch.cuda.synchronize()
    raise_if_error(err)
    if not check():
        return {"status": "fail", "reason": "destination buffers differ"}
    ms = bench_ms(go, rep_ms=40)
    raise_if_error(err)
    return {"status": "ok", "ms": ms}


def consumer_config(path: str | None):
    """ConsumerConfig() or the one in a JSON file (kernels_h200.py's best_consumer.json)."""
    from systems.overlap.kernels import ConsumerConfig

    if path and os.path.exists(path):
        fields = json.load(open(path))
        fields.pop("label", None)
        return ConsumerConfig(**fields)
    return ConsumerConfig()


def loopback_rows(cctas: list[int], sizes: list[int], cfg) -> list[dict]:
    from systems.overlap.transport import LoopbackFabric

    out = []
    dev = torch.device("cuda")
    for seg_bytes in sizes:
        for ccta in cctas:
            row = {"transport": "loopback", "ccta": ccta, "bytes": seg_bytes}
            try:
                plan, real_bytes, n_seg = segments_plan(seg_bytes, ccta, 4, dev)
                y = torch.randn(plan.n_padded, N, device=dev).to(torch.bfloat16)
                fab = LoopbackFabric(plan.dst_rows, N, y.dtype, dev)
                tr = fab.transport(plan.rank)
                total = real_bytes * n_seg

                def check(plan=plan, y=y, fab=fab):
                    want = expected_sends(
                        plan, y, [torch.zeros_like(fab.recv(d)) for d in range(4)]
                    )
                    return all(torch.equal(fab.recv(d), want[d]) for d in range(4))

                res = measure(
                    plan,
                    y,
                    tr.recv_ptrs,
                    tr.signal_ptrs,
                    ccta=ccta,
                    scope=tr.scope,
                    put_mode=0,
                    cfg=cfg,
                    check=check,
                )
                row.update(res, bytes=real_bytes, n_segments=n_seg, total_bytes=total)
                if res["status"] == "ok":
                    row["gbps"] = total / res["ms"] / 1e6
                del y, fab
            except Exception as exc:  # noqa: BLE001
                traceback.print_exc()
                row.update(status="error", reason=f"{type(exc).__name__}: {str(exc)[:300]}")
            print("ROW", json.dumps(row), flush=True)
            out.append(row)
    return out


def nvshmem_child(path: str, cctas: list[int], sizes: list[int], cfg) -> None:
    """Child process: W = 1 NVSHMEM transport, PUT_STORE and PUT_NVSHMEM_SIGNAL."""
    from dataclasses import replace

    import torch.distributed as dist

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29567")
    os.environ.setdefault("NVSHMEM_DISABLE_NVLS", "1")
    os.environ.setdefault("NVSHMEM_SYMMETRIC_SIZE", str(4 << 30))
    import torch.distributed._symmetric_memory as symm_mem

    out = []
    if not symm_mem.is_nvshmem_available():
        for name in ("nvshmem/store", "nvshmem/put_signal"):
            out.append(
                {"transport": name, "status": "skipped", "reason": "no NVSHMEM in torch here"}
            )
        json.dump(out, open(path, "w"))
        return
    dist.init_process_group("nccl", rank=0, world_size=1, device_id=torch.device("cuda", 0))
    from systems.overlap.kernels import ConsumerConfig
    from systems.overlap.modes import PUT_NVSHMEM_SIGNAL, PUT_STORE
    from systems.overlap.transport import nvshmem_self_transport

    dev = torch.device("cuda")
    for seg_bytes in sizes:
        plan, real_bytes, n_seg = segments_plan(seg_bytes, max(cctas), 1, dev, cap=256 << 20)
        y = torch.randn(plan.n_padded, N, device=dev).to(torch.bfloat16)
        tr0 = nvshmem_self_transport(plan.dst_rows[0], N, y.dtype, dev)
        total = real_bytes * n_seg
        for mode, name, mode_cfg in (
            (PUT_STORE, "nvshmem/store", cfg),
            (PUT_NVSHMEM_SIGNAL, "nvshmem/put_signal", ConsumerConfig(num_warps=32, stages=1)),
        ):
            tr = replace(tr0, put_mode=mode)
            recv_tab, sig_tab = tr.tables()
            for ccta in cctas:
                row = {"transport": name, "ccta": ccta, "bytes": real_bytes, "n_segments": n_seg}
                try:
                    tr.recv.zero_()

                    def check(plan=plan, y=y, tr=tr):
                        want = expected_sends(plan, y, [torch.zeros_like(tr.recv)])[0]
                        return torch.equal(tr.recv, want)

                    res = measure(
                        plan,
                        y,
                        recv_tab,
                        sig_tab,
                        ccta=ccta,
                        scope="sys",
                        put_mode=mode,
                        cfg=mode_cfg,
                        check=check,
                    )
                    row.update(res, total_bytes=total)
                    if res["status"] == "ok":
                        row["gbps"] = total / res["ms"] / 1e6
                except Exception as exc:  # noqa: BLE001
                    traceback.print_exc()
                    row.update(status="error", reason=f"{type(exc).__name__}: {str(exc)[:300]}")
                print("ROW", json.dumps(row), flush=True)
                out.append(row)
        del y, tr0, tr
    json.dump(out, open(path, "w"))
    dist.destroy_process_group()


def main() -> None:
    ap = argparse.ArgumentParser(description="consumer bandwidth vs segment size (Fig 3a)")
    ap.add_argument("--out", default=os.environ.get("OUT", os.path.join(ROOT, "results")))
    ap.add_argument("--cctas", default="2,4,8,14,16,24")
    ap.add_argument("--quick", action="store_true", help="sizes x4 apart instead of x2")
    ap.add_argument("--no-nvshmem", action="store_true")
    ap.add_argument("--nvshmem-cctas", default="4,8,16")
    ap.add_argument("--nvshmem-timeout", type=int, default=120)
    ap.add_argument("--consumer-json", default=None, help="ConsumerConfig fields (JSON file)")
    ap.add_argument("--child", default=None)
    args = ap.parse_args()
    sizes = SIZES[::2] if args.quick else SIZES
    cfg = consumer_config(args.consumer_json)
    if args.child:
        cctas = [int(c) for c in args.nvshmem_cctas.split(",")]
        nvshmem_child(args.child, cctas, SIZES[::2], cfg)
        return
    print("consumer config:", cfg)
    os.makedirs(args.out, exist_ok=True)
    if not torch.cuda.is_available():
        print("no CUDA GPU: nothing to measure")
        return
    gpu = torch.cuda.get_device_name(0)
    t0 = time.time()
    rows = loopback_rows([int(c) for c in args.cctas.split(",")], sizes, cfg)
    print(f"loopback took {time.time() - t0:.1f}s", flush=True)
    world = torch.cuda.device_count()
    for name in ("p2p", "nvshmem"):
        rows.append(
            {
                "transport": name,
                "status": "skipped",
                "reason": f"needs >= 2 GPUs with one process each (this machine has {world}); "
                "run benchmarks on a multi-GPU kind",
            }
        )
    if not args.no_nvshmem:
        import tempfile

        path = os.path.join(tempfile.mkdtemp(), "bandwidth_nvshmem.json")
        cmd = [sys.executable, "-m", "benchmarks.bandwidth", "--child", path]
        if args.consumer_json:
            cmd += ["--consumer-json", args.consumer_json]
        cmd += ["--nvshmem-cctas", args.nvshmem_cctas] + (["--quick"] if args.quick else [])
        try:
            proc = subprocess.run(
                cmd, capture_output=True, text=True, timeout=args.nvshmem_timeout, cwd=ROOT
            )
            sys.stdout.write(proc.stdout[-3000:])
            if proc.returncode != 0:
                sys.stdout.write(proc.stderr[-3000:])
                last = proc.stderr.strip().splitlines()[-1][:300] if proc.stderr.strip() else ""
                rows.append(
                    {"transport": "nvshmem/self", "status": "error", "reason": f"child: {last}"}
                )
        except subprocess.TimeoutExpired:
            rows.append(
                {"transport": "nvshmem/self", "status": "error", "reason": "child timed out"}
            )
        if os.path.exists(path):
            rows += json.load(open(path))
    import pandas as pd

    df = pd.DataFrame(rows)
    for col in ("ccta", "bytes", "gbps", "ms", "status", "reason"):
        if col not in df:
            df[col] = None
    df["gpu"] = gpu
    df["reason"] = df["reason"].fillna("")
    df.to_csv(os.path.join(args.out, "bandwidth.csv"), index=False)
    df.to_parquet(os.path.join(args.out, "bandwidth.parquet"), index=False)
    ok = df[df.status == "ok"]
    print("\n=== consumer GB/s vs segment size (transport=loopback is a LOCAL copy) ===")
    if len(ok):
        tab = ok.pivot_table(index="bytes", columns=["transport", "ccta"], values="gbps")
        tab.index = [f"{int(b) >> 10} KiB" for b in tab.index]
        short = {"loopback": "loop", "nvshmem/store": "nv_store", "nvshmem/put_signal": "nv_putsig"}
        tab.columns = [f"{short.get(t, t)}/{int(c)}" for t, c in tab.columns]
        with pd.option_context("display.width", 250, "display.max_columns", 40):
            print(tab.round(0).to_string())
    for _, r in df[df.status != "ok"].iterrows():
        print(f"[{r.status}] {r.transport}: {str(r.reason)[:150]}")


if __name__ == "__main__":
    main()
