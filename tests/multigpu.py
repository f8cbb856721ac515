"""Helpers of the 2-GPU tests that spawn one process per GPU themselves (NCCL over TCP)."""

from __future__ import annotations

import socket

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def gpu_world() -> int:
    """The ranks a 2+ GPU test spawns: one per visible GPU, at most 8 (so a 4- or 8-GPU host
    runs the same tests at W=4 or W=8; below 2 the tests skip)."""
    return min(torch.cuda.device_count(), 8)


def init_nccl(rank: int, world: int, port: int) -> torch.device:
    """This process's GPU (cuda:rank) and the default NCCL process group of `world` ranks."""
    dev = torch.device("cuda", rank)
    torch.cuda.set_device(dev)
    dist.init_process_group(
        "nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world, device_id=dev
    )
    return dev


def run_ranks(worker, world: int, n_values: int, *args) -> list[list[float]]:
    """worker(rank, world, port, *args, values) on `world` spawned processes; values is a
    shared float array of world * n_values NaNs each rank fills its slice of. Returns the
    slices per rank."""
    values = mp.get_context("spawn").Array("d", [float("nan")] * (world * n_values))
    mp.start_processes(
        worker, args=(world, free_port(), *args, values), nprocs=world, start_method="spawn"
    )
    return [list(values[r * n_values : (r + 1) * n_values]) for r in range(world)]


def _cells_worker(rank: int, init: str, out: str, cells: list[dict]) -> None:
    """One NCCL process on cuda:0 (W=1) measuring `cells` through harness.measure.measure_cell;
    writes one dict per cell to `out` (JSON)."""
    import json
    from pathlib import Path
    from types import SimpleNamespace

    from harness.measure import measure_cell
    from harness.system import RunContext

    torch.cuda.set_device(0)
    dev = torch.device("cuda", 0)
    dist.init_process_group("nccl", init_method=init, rank=0, world_size=1, device_id=dev)
    try:
        ctx = RunContext(0, 1, dev, None, "nccl")
        cfg = SimpleNamespace(measure=SimpleNamespace(tol=8e-3, warmup=1, iters=3))
        rows = []
        for cell in cells:
            r = measure_cell(ctx, cfg, cell)
            rows.append(
                {
                    "system": cell["system"],
                    "routing": cell["routing"],
                    **{k: getattr(r, k) for k in ("status", "reason", "impl", "scope", "extra")},
                    **{k: getattr(r, k) for k in ("latency_ms", "compute_ms", "comm_ms")},
                    "err": r.max_rel_err,
                }
            )
        Path(out).write_text(json.dumps(rows))
    finally:
        dist.destroy_process_group()


ROUTINGS = ("balanced", "moderate_skew", "stress_skew")


def one_gpu_cells(tmp_path, systems: list[str], shape: dict, params: dict | None = None) -> list:
    """Every (routing, system) cell of `shape` (tokens_per_rank, hidden, out, experts_per_rank,
    top_k, dtype, optional ffn) at W=1 on one GPU, in a spawned NCCL process (fmoe and Megatron
    keep per-process state). Each cell's params are the system's PARAMS defaults, then
    params[system]. Returns one dict per cell (status, reason, err, impl, scope, latencies)."""
    import json

    from harness.system import get_system

    params = params or {}
    cells = [
        {
            "experiment": "test_gpu_cells",
            "system": system,
            "seed": 0,
            "world_size": 1,
            "routing": routing,
            "ffn": 0,
            **shape,
            "params": {**get_system(system).load().PARAMS, **params.get(system, {})},
            "cell_hash": f"{system}-{routing}",
        }
        for routing in ROUTINGS
        for system in systems
    ]
    out = tmp_path / "cells.json"
    init = f"tcp://127.0.0.1:{free_port()}"
    mp.spawn(_cells_worker, args=(init, str(out), cells), nprocs=1, join=True)
    rows = json.loads(out.read_text())
    print(json.dumps(rows, indent=1))
    return rows
