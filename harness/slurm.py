"""Ranks from Slurm (or submitit's local executor): one task per GPU, across nodes. Hydra's
submitit launcher starts `nodes x tasks_per_node` copies of the job; export_torch_env turns
their task ids into the torchrun variables. A job of one task spawns a process per GPU itself.
"""

from __future__ import annotations

import os


def job_tasks() -> int:
    """Tasks of the submitit/Slurm job this process belongs to (1 outside any job). A plain
    `srun` step of several tasks counts too (submitit then reads it as a Slurm job)."""
    if int(os.environ.get("SLURM_NTASKS", "1") or 1) > 1 and "SLURM_PROCID" in os.environ:
        os.environ.setdefault("SUBMITIT_EXECUTOR", "slurm")
    try:
        import submitit

        return int(submitit.JobEnvironment().num_tasks)
    except (ImportError, RuntimeError):
        return 1


def export_torch_env() -> bool:
    """Set the torchrun variables in one task of several (not under torchrun); True if it did."""
    if "RANK" in os.environ or job_tasks() < 2:
        return False
    from submitit.helpers import TorchDistributedEnvironment

    # every rank sees all GPUs of its node and picks cuda:LOCAL_RANK itself
    TorchDistributedEnvironment().export(set_cuda_visible_devices=False)
    return True
