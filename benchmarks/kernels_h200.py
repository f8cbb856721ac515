"""Build, check and time the overlap kernels on one GPU (H200): one call, one table.

  producer   persistent Triton GEMM (systems/overlap/kernels/producer.py) with and without flags
             vs torch._grouped_mm and dense cuBLAS on the same expert problem (bf16), a small
             config sweep on the main shape (16 experts x 1024 rows, K=2048, N=8192)
  consumer   loopback GB/s per consumer CTA at cCTA {2, 4, 8, 16} (flags pre-set), a small copy
             config sweep
  overlap    producer + consumer overlapped on loopback vs the same kernels one after the other
             (outputs must match exactly), with the residency report (one consumer CTA per SM)
  nvshmem    self-put variants (W = 1, PE 0) in a child process: Triton stores through the
             symmetric address vs nvshmemx_putmem_block vs putmem_signal_block, 8/16/32 warps
Every variant is checked against torch before it is timed; a failing one records status=fail.
Writes kernels_h200.csv / .parquet (and nvshmem.json) under --out (default $OUT or results/).

Usage (GPU machine, repository root): python -m benchmarks.kernels_h200 [--out DIR] [--quick]
       [--no-sweep] [--skip SECTIONS]
The plans are systems.overlap.testing.synthetic_plan's (group sizes through the real stage-A
builder), shared with the kernel tests.
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import os
import subprocess
import sys
import time
import traceback
from types import SimpleNamespace

import torch

from systems.overlap.testing import (
    balanced_rows,
    expected_sends,
    reference_y,
    rows_sent,
    synthetic_plan,
)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # default --out: ROOT/results


# ----------------------------------------------------------------------------------------
# Timing helpers
# ----------------------------------------------------------------------------------------
def bench_ms(fn, rep_ms: int = 200) -> float:
    import triton

    return float(triton.testing.do_bench(fn, warmup=25, rep=rep_ms, return_mode="median"))


def rel_err(a: torch.Tensor, ref: torch.Tensor) -> float:
    a, ref = a.float(), ref.float()
    return float((a - ref).norm() / ref.norm().clamp(min=1e-30))


ROWS: list[dict] = []


def record(**kw) -> dict:
    kw.setdefault("status", "ok")
    kw.setdefault("reason", "")
    ROWS.append(kw)
    short = {k: (round(v, 3) if isinstance(v, float) else v) for k, v in kw.items() if k != "k"}
    print("ROW", json.dumps(short, default=str), flush=True)
    return kw


# ----------------------------------------------------------------------------------------
# Producer
# ----------------------------------------------------------------------------------------
def producer_problem(name, experts, rows_per_expert, K, N, world=4, dtype=torch.bfloat16, seed=0):
    """A balanced expert problem: each expert's rows split evenly over `world` owners (the last
    one is this rank), X [P, K], weights [E, K, N], the plan, and torch's view of it."""
    dev = torch.device("cuda")
    g = torch.Generator(device="cpu").manual_seed(seed)
    rows = balanced_rows(experts, rows_per_expert, world)
    plan = synthetic_plan(rows, rank=world - 1, tile_m=128, device=dev)
    x_recv = (torch.randn(plan.n_rows, K, generator=g) * 0.5).to(dev, dtype)
    w = (torch.randn(experts, K, N, generator=g) / math.sqrt(K)).to(dev, dtype)
    from systems.overlap.plan import padded_input

    x = padded_input(x_recv, plan.gather_index)
    # rows sorted by expert for torch (valid rows only, the same values)
    valid_rows = plan.gather_index >= 0
    x_sorted_idx = torch.arange(plan.n_padded, device=dev)[valid_rows]
    counts = [rows_per_expert] * experts
    return SimpleNamespace(
        name=name,
        plan=plan,
        x=x,
        w=w,
        K=K,
        N=N,
        E=experts,
        x_sorted=x[x_sorted_idx],
        counts=counts,
        flops=2.0 * plan.n_rows * K * N,
        flops_padded=2.0 * plan.n_padded * K * N,
    )


def run_producer_variant(pb, cfg, *, flag: bool, grid: int, label: str, ref: torch.Tensor):
    from systems.overlap.kernels import launch_producer
    from systems.overlap.plan_device import producer_groups_device

    p = pb.plan
    y = torch.full((p.n_padded, pb.N), float("nan"), dtype=pb.x.dtype, device=pb.x.device)
    ready = torch.zeros(p.n_bands, dtype=torch.int32, device=pb.x.device)
    # the swizzle groups once per plan, as the runner builds them (not inside the timed launch)
    groups = producer_groups_device(p, None, cfg.group_m) if cfg.expert_groups else None

    def go():
        return launch_producer(
            pb.x,
            pb.w,
            y,
            p,
            ready,
            num_programs=grid,
            config=cfg,
            signal=flag,
            groups=groups,
        )

    row = dict(
        part="producer",
        shape=pb.name,
        variant=label,
        grid=grid,
        flag=flag,
        config=json.dumps(cfg.__dict__),
    )
    try:
        k = go()
        torch.cuda.synchronize()
        err = rel_err(y, ref)
        row.update(rel_err=err, n_regs=int(getattr(k, "n_regs", 0)), smem=k.metadata.shared)
        bad = torch.isnan(y).any().item() or err > 2e-2
        if flag:
            inc = cfg.band_increment(pb.N)
            got = ready[p.schedule[: p.n_remote_bands]]
            bad = bad or not bool((got == inc).all())
            row["flags_ok"] = bool((got == inc).all())
        if bad:
            return record(**row, status="fail", reason=f"rel_err={err:.3g} or flags wrong")
        ms = bench_ms(go, rep_ms=200)
        return record(**row, ms=ms, tflops=pb.flops / ms / 1e9, k=k)
    except Exception as exc:  # noqa: BLE001 - a failing variant must not stop the run
        traceback.print_exc()
        return record(**row, status="error", reason=f"{type(exc).__name__}: {str(exc)[:300]}")


def producer_section(args, sms: int) -> None:
    from dataclasses import replace

    from systems.overlap.kernels import pick_config

    # (name, experts, rows per expert, K, N, owners): rows per owner a multiple of 128, so the
    # plan has no padding rows and every kernel does the same FLOPs as torch
    shapes = [("16x1024_K2048_N8192", 16, 1024, 2048, 8192, 4)]
    if not args.quick:
        shapes += [
            ("64x256_K2048_N8192", 64, 256, 2048, 8192, 2),
            ("16x1024_K512_N2048", 16, 1024, 512, 2048, 4),
        ]
    for name, E, rpe, K, N, world in shapes:
        pb = producer_problem(name, E, rpe, K, N, world=world)
        ref = reference_y(pb.plan, pb.x, pb.w)
        # baselines
        offs = torch.tensor(pb.counts, device="cuda").cumsum(0).to(torch.int32)
        try:
            out = torch._grouped_mm(pb.x_sorted, pb.w, offs=offs)
            ms = bench_ms(lambda xs=pb.x_sorted, w=pb.w, o=offs: torch._grouped_mm(xs, w, offs=o))
            record(
                part="producer",
                shape=name,
                variant="torch._grouped_mm",
                grid=sms,
                ms=ms,
                tflops=pb.flops / ms / 1e9,
                rel_err=rel_err(out, ref[pb.plan.gather_index >= 0]),
            )
        except Exception as exc:  # noqa: BLE001
            record(
                part="producer",
                shape=name,
                variant="torch._grouped_mm",
                status="error",
                reason=str(exc)[:300],
            )
        a = pb.x_sorted
        b = pb.w[0]
        ms = bench_ms(lambda a=a, b=b: torch.matmul(a, b))
        record(
            part="producer",
            shape=name,
            variant="cublas_dense",
            grid=sms,
            ms=ms,
            tflops=pb.flops / ms / 1e9,
        )
        cfg0 = pick_config(128, K, N, pb.x.dtype)
        variants = [
            ("table", cfg0),
            ("g1_thread", replace(cfg0, group_m=1, flag="thread")),
            ("noflat_cta", replace(cfg0, flatten=False, flag="cta", group_m=1)),
        ]
        if args.sweep:
            if name.startswith("16x1024_K2048"):
                variants += [
                    ("g4_thread", replace(cfg0, group_m=4, flag="thread")),
                    ("g4_warp", replace(cfg0, group_m=4, flag="warp")),
                    ("g8_s4_deferred", replace(cfg0, group_m=8, num_stages=4, flag="deferred")),
                    ("g8_s4_warp", replace(cfg0, group_m=8, num_stages=4, flag="warp")),
                ]
            elif name.startswith("64x256"):
                variants += [
                    ("g2_deferred", replace(cfg0, group_m=2, flag="deferred")),
                    ("g2_warp", replace(cfg0, group_m=2, flag="warp")),
                ]
            else:
                variants += [
                    ("g4_warp", replace(cfg0, group_m=4, flag="warp")),
                    ("g1_warp", replace(cfg0, group_m=1, flag="warp")),
                ]
        for label, cfg in variants:
            for grid in (sms, sms - 16) if label == "table" else (sms,):
                for flag in (False, True):
                    run_producer_variant(pb, cfg, flag=flag, grid=grid, label=label, ref=ref)
        torch.cuda.empty_cache()


# ----------------------------------------------------------------------------------------
# Consumer (loopback)
# ----------------------------------------------------------------------------------------
def copy_problem(n_bands: int, band_rows: int, N: int, world: int = 4, dtype=torch.bfloat16):
    """A plan whose remote bands are all full and valid (one band a segment), round-robin dst."""
    dev = torch.device("cuda")
    rows = [[0] * (world + 1) for _ in range(n_bands)]
    for b in range(n_bands):
        rows[b][b % world] = band_rows
    plan = synthetic_plan(rows, rank=world, tile_m=band_rows, device=dev)
    y = torch.randn(plan.n_padded, N, device=dev).to(dtype)
    return plan, y


def run_consumer_variant(plan, y, fabric, cfg, *, ccta, wait, label, nbytes, inc=1):
    from systems.overlap.errors import new_error_buffer, raise_if_error
    from systems.overlap.kernels import launch_consumer

    ready = torch.full((plan.n_bands,), inc, dtype=torch.int32, device=y.device)
    err = new_error_buffer(y.device)
    clock = torch.zeros(ccta, dtype=torch.int64, device=y.device)
    tr = fabric.transport(plan.rank)

    def go():
        return launch_consumer(
            y,
            plan,
            ready,
            tr.recv_ptrs,
            tr.signal_ptrs,
            err,
            clock,
            ready_target=inc,
            rank=plan.rank,
            ccta=ccta,
            config=cfg,
            wait=wait,
            scope=tr.scope,
        )

    row = dict(
        part="consumer",
        transport="loopback",
        variant=label,
        ccta=ccta,
        wait=wait,
        bytes=nbytes,
        config=json.dumps(cfg.__dict__),
    )
    try:
        fabric.reset()
        k = go()
        torch.cuda.synchronize()
        raise_if_error(err)
        want = expected_sends(plan, y, [fabric.recv(d) * 0 for d in range(fabric.world)])
        ok = all(torch.equal(fabric.recv(d), want[d]) for d in range(plan.world_size))
        if not ok:
            return record(**row, status="fail", reason="destination buffers differ")
        ms = bench_ms(go, rep_ms=100)
        gbps = nbytes / ms / 1e6
        regs = -(-int(getattr(k, "n_regs", 0)) // 8) * 8 * 32 * cfg.num_warps
        # can a second consumer CTA share the SM? (registers or shared memory say no)
        alone = 2 * regs > 65536 or 2 * (k.metadata.shared + 1024) > 233472
        return record(
            **row,
            exclusive_cc=alone,
            ms=ms,
            gbps=gbps,
            gbps_per_cta=gbps / ccta,
            smem=k.metadata.shared,
            n_regs=int(getattr(k, "n_regs", 0)),
            k=k,
        )
    except Exception as exc:  # noqa: BLE001
        traceback.print_exc()
        return record(**row, status="error", reason=f"{type(exc).__name__}: {str(exc)[:300]}")


def consumer_section(args) -> None:
    from systems.overlap.kernels import ConsumerConfig
    from systems.overlap.transport import LoopbackFabric

    N, band_rows, n_bands = 8192, 128, 128  # 2 MiB bands, 256 MiB in all
    plan, y = copy_problem(n_bands, band_rows, N)
    fabric = LoopbackFabric(plan.dst_rows, N, y.dtype, y.device)
    nbytes = n_bands * band_rows * N * y.element_size()
    configs = [
        ("b64k_w32", ConsumerConfig(block=65536, num_warps=32, stages=1)),
        ("b64k_w32_stream", ConsumerConfig(block=65536, num_warps=32, stages=1, streaming=True)),
        ("b64k_w16_stream", ConsumerConfig(block=65536, num_warps=16, stages=1, streaming=True)),
    ]
    if args.sweep:
        configs += [
            ("b64k_w16", ConsumerConfig(block=65536, num_warps=16, stages=1)),
            ("b32k_w32", ConsumerConfig(block=32768, num_warps=32, stages=1)),
        ]
    best = None
    for label, cfg in configs:
        r = run_consumer_variant(
            plan, y, fabric, cfg, ccta=8, wait=True, label=label, nbytes=nbytes
        )
        ok = r["status"] == "ok" and r.get("exclusive_cc")
        if ok and (best is None or r["gbps"] > best[2]):
            best = (label, cfg, r["gbps"])
    chosen = [("default", ConsumerConfig())]
    if best is not None:
        chosen.append((best[0], best[1]))
        with open(os.path.join(args.out, "best_consumer.json"), "w") as f:
            json.dump({"label": best[0], **best[1].__dict__}, f)
    for label, cfg in chosen:
        for ccta in (2, 4, 8, 16):
            for wait in (True, False) if label != "default" else (True,):
                run_consumer_variant(
                    plan, y, fabric, cfg, ccta=ccta, wait=wait, label=label, nbytes=nbytes
                )
    del y, fabric
    torch.cuda.empty_cache()


# ----------------------------------------------------------------------------------------
# Overlap on loopback
# ----------------------------------------------------------------------------------------
def overlap_section(args, sms: int) -> None:
    from systems.overlap.runner import OverlapRunner, residency_report
    from systems.overlap.transport import LoopbackFabric

    pb = producer_problem("16x1024_K2048_N8192", 16, 1024, 2048, 8192)
    p = pb.plan
    fabric = LoopbackFabric(p.dst_rows, pb.N, pb.x.dtype, pb.x.device)
    sent = torch.tensor(rows_sent(p))
    for ccta in (8, 16):
        row = dict(part="overlap", shape=pb.name, transport="loopback", ccta=ccta)
        try:
            runner = OverlapRunner(p, pb.w, fabric.transport(p.rank), ccta=ccta)
            y_seq = torch.empty(p.n_padded, pb.N, dtype=pb.x.dtype, device="cuda")
            fabric.reset()
            runner.sequential(pb.x, y_seq)
            torch.cuda.synchronize()
            runner.check()
            want = [fabric.recv(d).clone() for d in range(fabric.world)]
            y = torch.empty_like(y_seq)
            fabric.reset()
            runner.reset()
            runner.overlapped(pb.x, y)
            torch.cuda.synchronize()
            runner.check()
            same = torch.equal(y, y_seq) and all(
                torch.equal(fabric.recv(d), want[d]) for d in range(fabric.world)
            )
            sig_ok = fabric.counters[:, p.rank].cpu().tolist() == [
                s * runner.consumer_runs for s in sent.tolist()
            ]
            rep = residency_report(runner.last_kernels["producer"], runner.last_kernels["consumer"])
            print("RESIDENCY", json.dumps(rep), flush=True)
            if not (same and sig_ok):
                record(**row, status="fail", reason=f"overlapped != sequential ({same}, {sig_ok})")
                continue
            t_ov = bench_ms(lambda r=runner, y=y: r.overlapped(pb.x, y))
            runner.check()
            t_seq = bench_ms(lambda r=runner, y=y: r.sequential(pb.x, y))
            t_comp = bench_ms(lambda r=runner, y=y: r.compute_only(pb.x, y))
            t_comm = bench_ms(lambda r=runner, y=y: r.comm_only(y))
            runner.check()
            hidden = (t_comp + t_comm - t_ov) / t_comm if t_comm > 0 else float("nan")
            record(
                **row,
                ms=t_ov,
                seq_ms=t_seq,
                compute_ms=t_comp,
                comm_ms=t_comm,
                overlap_ratio=max(0.0, min(1.0, hidden)),
                exclusive=rep["exclusive"],
                tflops=pb.flops / t_ov / 1e9,
            )
        except Exception as exc:  # noqa: BLE001
            traceback.print_exc()
            record(**row, status="error", reason=f"{type(exc).__name__}: {str(exc)[:300]}")


# ----------------------------------------------------------------------------------------
# NVSHMEM self-put (child process: torch.distributed with one rank, NVSHMEM backend)
# ----------------------------------------------------------------------------------------
def nvshmem_child(out_path: str, sizes: list[int], cctas: list[int]) -> None:
    """Child: consumer GB/s through the NVSHMEM transport to PE 0, every put mode."""
    from dataclasses import replace

    import torch.distributed as dist

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29561")
    os.environ.setdefault("NVSHMEM_DISABLE_NVLS", "1")
    os.environ.setdefault("NVSHMEM_SYMMETRIC_SIZE", str(4 << 30))
    dist.init_process_group("nccl", rank=0, world_size=1, device_id=torch.device("cuda", 0))
    from systems.overlap.errors import new_error_buffer, raise_if_error
    from systems.overlap.kernels import ConsumerConfig, launch_consumer
    from systems.overlap.modes import PUT_NVSHMEM, PUT_NVSHMEM_SIGNAL, PUT_STORE
    from systems.overlap.transport import nvshmem_self_transport

    results = []
    N = 4096
    for seg_bytes in sizes:
        seg_rows = max(1, seg_bytes // (N * 2))
        n_seg = max(8, min(2048, (64 << 20) // (seg_rows * N * 2)))
        # W = 1: every band goes to PE 0 = self; a 2-owner plan (this "rank" 1 owns no rows)
        rows = [[seg_rows, 0] for _ in range(n_seg)]
        plan = synthetic_plan(rows, rank=1, tile_m=seg_rows, device="cuda")
        y = torch.randn(plan.n_padded, N, device="cuda").to(torch.bfloat16)
        nbytes = n_seg * seg_rows * N * 2
        tr0 = nvshmem_self_transport(plan.dst_rows[0], N, torch.bfloat16, torch.device("cuda"))
        for mode, mname in (
            (PUT_STORE, "store"),
            (PUT_NVSHMEM, "put"),
            (PUT_NVSHMEM_SIGNAL, "put_signal"),
        ):
            tr = replace(tr0, put_mode=mode)
            recv_tab, sig_tab = tr.tables()
            if mode == PUT_STORE:
                cfgs = [
                    ConsumerConfig(block=32768, num_warps=32, stages=1),
                    ConsumerConfig(block=65536, num_warps=32, stages=1),
                ]
            else:
                cfgs = [ConsumerConfig(num_warps=w, stages=1) for w in (8, 32)]
            for cfg in cfgs:
                warps = cfg.num_warps
                for ccta in cctas:
                    ready = torch.ones(plan.n_bands, dtype=torch.int32, device="cuda")
                    err = new_error_buffer("cuda")
                    clock = torch.zeros(ccta, dtype=torch.int64, device="cuda")
                    res = dict(
                        part="nvshmem",
                        transport=f"nvshmem/{mname}",
                        warps=warps,
                        block=cfg.block,
                        ccta=ccta,
                        bytes=seg_rows * N * 2,
                        total_bytes=nbytes,
                    )

                    # rank=0: the signal slot of source 0 (W = 1)
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
                        scope="sys",
                        put_mode=mode,
                    )
                    try:
                        tr.recv.zero_()
                        go()
                        torch.cuda.synchronize()
                        raise_if_error(err)
                        want = expected_sends(plan, y, [tr.recv * 0, tr.recv * 0])[0]
                        if not torch.equal(tr.recv, want):
                            res.update(status="fail", reason="destination differs")
                        else:
                            ms = bench_ms(go, rep_ms=60)
                            res.update(
                                status="ok",
                                ms=ms,
                                gbps=nbytes / ms / 1e6,
                                gbps_per_cta=nbytes / ms / 1e6 / ccta,
                            )
                    except Exception as exc:  # noqa: BLE001
                        traceback.print_exc()
                        res.update(status="error", reason=f"{type(exc).__name__}: {str(exc)[:300]}")
                    results.append(res)
                    print("NVSHMEM", json.dumps(res), flush=True)
        del y, tr0, tr
    with open(out_path, "w") as f:
        json.dump(results, f)
    dist.destroy_process_group()


def nvshmem_section(args, out_dir: str) -> None:
    import tempfile

    path = os.path.join(tempfile.mkdtemp(), "nvshmem.json")  # rows go into kernels_h200.csv
    sizes = [2 << 20] if args.quick else [64 << 10, 2 << 20]
    cmd = [
        sys.executable,
        "-m",
        "benchmarks.kernels_h200",
        "--nvshmem-child",
        path,
        "--sizes",
        ",".join(map(str, sizes)),
        "--cctas",
        "16",
    ]
    try:
        proc = subprocess.run(
            cmd, capture_output=True, text=True, timeout=args.nvshmem_timeout, cwd=ROOT
        )
        sys.stdout.write(proc.stdout[-6000:])
        if proc.returncode != 0:
            sys.stdout.write(proc.stderr[-4000:])
            last = proc.stderr.strip().splitlines()[-1][:300] if proc.stderr.strip() else ""
            record(part="nvshmem", status="error", reason=f"child exit {proc.returncode}: {last}")
    except subprocess.TimeoutExpired:
        record(part="nvshmem", status="error", reason=f"child timed out ({args.nvshmem_timeout}s)")
    if os.path.exists(path):
        for r in json.load(open(path)):
            ROWS.append(r)


# ----------------------------------------------------------------------------------------
def summary_table() -> str:
    lines = ["", "=== summary (bf16, H200) ==="]
    by = {}
    for r in ROWS:
        if r.get("part") == "producer" and r.get("status") == "ok":
            key = (r["shape"], r["variant"], r.get("grid"), r.get("flag"))
            by[key] = r
    shapes = sorted({k[0] for k in by})
    for s in shapes:
        gmm = next((r for k, r in by.items() if k[0] == s and k[1] == "torch._grouped_mm"), None)
        cub = next((r for k, r in by.items() if k[0] == s and k[1] == "cublas_dense"), None)
        lines.append(
            f"[producer] {s}: grouped_mm {gmm['tflops'] if gmm else float('nan'):.0f}  "
            f"cuBLAS dense {cub['tflops'] if cub else float('nan'):.0f} TFLOP/s"
        )
        for k, r in sorted(by.items(), key=lambda kv: str(kv[0])):
            if k[0] != s or k[1] in ("torch._grouped_mm", "cublas_dense") or not k[3]:
                continue
            nof = by.get((k[0], k[1], k[2], False))
            cost = (r["ms"] / nof["ms"] - 1) * 100 if nof else float("nan")
            lines.append(
                f"   {k[1]:<20} grid {k[2]:>3}: flags {r['tflops']:.0f} / no-flag "
                f"{nof['tflops'] if nof else float('nan'):.0f} TFLOP/s (flag cost {cost:+.1f}%)"
                f"  vs grouped_mm {r['tflops'] / gmm['tflops'] if gmm else float('nan'):.2f}x"
                f"  vs cuBLAS {r['tflops'] / cub['tflops'] if cub else float('nan'):.2f}x"
            )
    for r in ROWS:
        if r.get("part") == "consumer" and r.get("status") == "ok":
            lines.append(
                f"[consumer] loopback {r['variant']:<12} ccta {r['ccta']:>2} wait "
                f"{r['wait']!s:<5}: {r['gbps']:.0f} GB/s = {r['gbps_per_cta']:.1f}/CTA"
            )
        if r.get("part") == "overlap" and r.get("status") == "ok":
            lines.append(
                f"[overlap] ccta {r['ccta']}: overlapped {r['ms']:.3f} ms, sequential "
                f"{r['seq_ms']:.3f}, compute {r['compute_ms']:.3f}, comm {r['comm_ms']:.3f}"
                f" (hidden {r['overlap_ratio']:.2f}, exclusive SMs {r['exclusive']})"
            )
        if r.get("part") == "nvshmem" and r.get("status") == "ok":
            lines.append(
                f"[nvshmem self] {r['transport']:<20} warps {r['warps']:>2} block "
                f"{r['block']:>6} ccta {r['ccta']:>2} seg {r['bytes'] >> 10} KiB: "
                f"{r['gbps']:.0f} GB/s = {r['gbps_per_cta']:.1f}/CTA"
            )
    bad = [r for r in ROWS if r.get("status") != "ok"]
    for r in bad:
        lines.append(
            f"[{r.get('status')}] {r.get('part')} {r.get('variant', r.get('transport', ''))}"
            f": {r.get('reason', '')[:160]}"
        )
    return "\n".join(lines)


def write_rows(out_dir: str) -> None:
    import pandas as pd

    rows = [{k: v for k, v in r.items() if k != "k"} for r in ROWS]
    df = pd.DataFrame(rows)
    df.to_csv(os.path.join(out_dir, "kernels_h200.csv"), index=False)
    try:
        df.astype({c: str for c in df.columns if df[c].dtype == object}).to_parquet(
            os.path.join(out_dir, "kernels_h200.parquet"), index=False
        )
    except Exception as exc:  # noqa: BLE001
        print("parquet not written:", exc)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=os.environ.get("OUT", os.path.join(ROOT, "results")))
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--no-sweep", dest="sweep", action="store_false")
    ap.add_argument("--skip", default="", help="comma list of sections to skip")
    ap.add_argument("--nvshmem-timeout", type=int, default=150)
    ap.add_argument("--nvshmem-child", default=None)
    ap.add_argument("--sizes", default="")
    ap.add_argument("--cctas", default="16")
    args = ap.parse_args()
    if args.nvshmem_child:
        nvshmem_child(
            args.nvshmem_child,
            [int(s) for s in args.sizes.split(",") if s],
            [int(c) for c in args.cctas.split(",")],
        )
        return
    if not torch.cuda.is_available():
        sys.exit("error: kernels_h200 needs a CUDA GPU (it times the overlap kernels)")
    os.makedirs(args.out, exist_ok=True)
    props = torch.cuda.get_device_properties(0)
    sms = props.multi_processor_count
    import triton

    print(f"device {props.name}, {sms} SMs, torch {torch.__version__}, triton {triton.__version__}")
    skip = set(args.skip.split(","))
    t0 = time.time()
    for name, fn in (
        ("producer", lambda: producer_section(args, sms)),
        ("consumer", lambda: consumer_section(args)),
        ("overlap", lambda: overlap_section(args, sms)),
        ("nvshmem", lambda: nvshmem_section(args, args.out)),
    ):
        if name in skip:
            continue
        t = time.time()
        try:
            fn()
        except Exception as exc:  # noqa: BLE001
            traceback.print_exc()
            record(part=name, status="error", reason=f"section: {type(exc).__name__}: {exc}"[:300])
        print(f"--- section {name} took {time.time() - t:.1f}s", flush=True)
        write_rows(args.out)
    print(f"total {time.time() - t0:.1f}s")
    print(summary_table())


if __name__ == "__main__":
    main()
