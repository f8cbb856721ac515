"""Entry point: `python -m harness.run experiment=<name> [overrides]`.

On one node it spawns W ranks itself (one process per GPU with NCCL, or W CPU processes with
gloo). Under torchrun (RANK / WORLD_SIZE / LOCAL_RANK set) it uses the ranks it is given. Every
rank walks the same cells in the same order; only rank 0 writes the parquet table. Process
groups are created once per run, never per cell.
"""

from __future__ import annotations

import importlib
import os
import socket
import sys
from datetime import timedelta
from pathlib import Path
from typing import Any

import hydra
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from omegaconf import DictConfig, OmegaConf

from harness.config import register_configs
from harness.records import ResultsTable, Row, provenance, row_dict
from harness.system import RunContext

register_configs()

#: a collective that does not finish within this time raises instead of hanging forever
PG_TIMEOUT = timedelta(minutes=10)


def table_path(cfg: Any) -> Path:
    return Path(cfg.table or Path(cfg.results_dir) / f"{cfg.experiment.name}.parquet")


def resolve_world(cfg: Any) -> int:
    """Number of processes to spawn; a clear error when more GPUs are asked than present."""
    hw = cfg.hardware
    if hw.device == "cuda":
        n_gpu = torch.cuda.device_count()
        if n_gpu == 0:
            raise ValueError(f"hardware={hw.name} needs CUDA GPUs; none found (try hardware=cpu)")
        world = hw.world_size or n_gpu
        if world > n_gpu:
            raise ValueError(f"hardware.world_size={world} but only {n_gpu} GPU(s) are present")
        return world
    if hw.device != "cpu":
        raise ValueError(f"hardware.device must be cpu or cuda, got {hw.device!r}")
    if hw.world_size < 1:
        raise ValueError("hardware.world_size must be >= 1 on the CPU")
    return hw.world_size


def load_experiment(cfg: Any):
    try:
        return importlib.import_module(cfg.experiment.module)
    except ModuleNotFoundError as exc:
        raise ValueError(f"experiment module {cfg.experiment.module!r} not found") from exc


def preflight(cfg: Any, world: int) -> list[dict]:
    """Build and validate every cell before any rank starts (bad input fails here)."""
    exp = load_experiment(cfg)
    cells = exp.cells(cfg, world)
    sm = 0
    if cfg.hardware.device == "cuda":
        sm = torch.cuda.get_device_properties(0).multi_processor_count
    exp.validate(cfg, cells, sm)
    return cells


def dry_run(cfg: Any) -> None:
    """List the cells (one line each) without starting a rank; needs no GPU."""
    hw = cfg.hardware
    world = hw.world_size or (torch.cuda.device_count() if hw.device == "cuda" else 1) or 1
    exp = load_experiment(cfg)
    cells = exp.cells(cfg, world)
    exp.validate(cfg, cells, 0)  # SM-count checks wait for the real run
    for c in cells:
        shape = " ".join(f"{k}={c[k]}" for k in c if k not in ("experiment", "params", "cell_hash"))
        params = " ".join(f"{k}={v}" for k, v in c.get("params", {}).items())
        print(f"{c['cell_hash']}  {shape}  {params}")
    print(f"[harness] dry run: {len(cells)} cells on {world} rank(s)")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def worker(rank: int, world: int, local_rank: int, cfg_dict: dict, init_method: str) -> None:
    """One rank: init the process group once, walk the cells, rank 0 writes."""
    cfg = OmegaConf.create(cfg_dict)
    if cfg.hardware.device == "cuda":
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    kw = {"device_id": device} if device.type == "cuda" else {}
    dist.init_process_group(
        cfg.hardware.backend,
        init_method=init_method,
        rank=rank,
        world_size=world,
        timeout=PG_TIMEOUT,
        **kw,
    )
    try:
        _walk(RunContext(rank, world, device, None, cfg.hardware.backend), cfg)
    finally:
        dist.destroy_process_group()


def _stamp(rows: list[Row], cfg: Any, ctx: RunContext) -> list[Row]:
    """Every row says how it was run (the settings that are part of its cell hash)."""
    for r in rows:
        r.hardware, r.backend = cfg.hardware.name, ctx.backend
        r.warmup, r.iters, r.tol = cfg.measure.warmup, cfg.measure.iters, cfg.measure.tol
    return rows


def _walk(ctx: RunContext, cfg: Any) -> None:
    exp = load_experiment(cfg)
    cells = exp.cells(cfg, ctx.world_size)
    exp.validate(cfg, cells, ctx.sm_count)
    table = ResultsTable(table_path(cfg))
    done = [table.done_hashes(cfg.redo_failed) if ctx.rank == 0 else None]
    dist.broadcast_object_list(done, src=0)
    todo = [c for c in cells if c["cell_hash"] not in done[0]]
    if ctx.rank == 0:
        print(
            f"[harness] {cfg.experiment.name}: {len(cells)} cells, {len(cells) - len(todo)} "
            f"already in {table.path}, {len(todo)} to run on {ctx.world_size} rank(s) "
            f"({ctx.device.type}, {ctx.backend})",
            flush=True,
        )
    bar = None
    if ctx.rank == 0 and cfg.progress and todo:
        from tqdm import tqdm

        bar = tqdm(total=len(todo), desc=cfg.experiment.name, file=sys.stdout)
    written: list[Row] = []
    for cell in todo:
        try:
            rows = exp.run_cell(ctx, cfg, cell)
        except Exception as exc:  # noqa: BLE001 - the sweep survives a failing cell
            rows = [
                Row(
                    experiment=cfg.experiment.name,
                    system=cell.get("system", ""),
                    cell_hash=cell["cell_hash"],
                    status="error",
                    reason=f"{type(exc).__name__}: {exc}"[:500],
                    **provenance(),
                )
            ]
        if ctx.rank == 0:
            table.append(_stamp(rows, cfg, ctx))
            written.extend(rows)
            if bar is not None:
                bar.set_postfix_str(f"{rows[-1].system}:{rows[-1].status}")
                bar.update(1)
    if bar is not None:
        bar.close()
    if ctx.rank == 0:
        _summary(written, table.path)


def _summary(rows: list[Row], path: Path) -> None:
    if not rows:
        print(f"[harness] nothing new; table at {path}")
        return
    import pandas as pd

    df = pd.DataFrame([row_dict(r) for r in rows])
    cols = [
        "system",
        "routing",
        "experts_per_rank",
        "world_size",
        "status",
        "latency_ms",
        "overlap_ratio",
        "max_rel_err",
    ]
    cols = [c for c in cols if c in df and df[c].notna().any()]
    with pd.option_context("display.width", 160, "display.max_rows", 60):
        print(df[cols].to_string(index=False, float_format=lambda v: f"{v:.4g}"))
    bad = df[df["status"].isin(["fail", "error"])]
    for _, r in bad.head(5).iterrows():
        print(f"[harness] {r['status']}: {r['system']} {r['cell_hash']}: {r['reason']}")
    print(f"[harness] wrote {len(rows)} row(s) to {path}")


def _spawn_entry(rank: int, world: int, cfg_dict: dict, init_method: str) -> None:
    worker(rank, world, rank, cfg_dict, init_method)


def launch(cfg: DictConfig) -> None:
    cfg_dict = OmegaConf.to_container(cfg, resolve=True)
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:  # torchrun / Slurm
        rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        if rank == 0:
            preflight(cfg, world)
        worker(rank, world, int(os.environ.get("LOCAL_RANK", 0)), cfg_dict, "env://")
        return
    if cfg.dry_run:
        dry_run(cfg)
        return
    world = resolve_world(cfg)
    preflight(cfg, world)
    init = f"tcp://127.0.0.1:{_free_port()}"
    if world == 1:
        worker(0, 1, 0, cfg_dict, init)
    else:
        mp.spawn(_spawn_entry, args=(world, cfg_dict, init), nprocs=world, join=True)


@hydra.main(version_base="1.3", config_path="../conf", config_name="config")
def main(cfg: DictConfig) -> None:
    launch(cfg)


if __name__ == "__main__":
    main()
