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
