"""Slurm through Hydra's submitit launcher: the committed launcher config composes, Slurm task
ids become torchrun ranks, and a two-task job runs end to end through submitit's local executor
(the same job path as on a cluster, with processes instead of sbatch)."""

import os
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest
from hydra import compose, initialize_config_dir

from harness.config import register_configs

pytest.importorskip("hydra_plugins.hydra_submitit_launcher")
ROOT = Path(__file__).resolve().parents[1]


def test_the_slurm_launcher_config_composes():
    register_configs()
    with initialize_config_dir(str(ROOT / "conf"), version_base="1.3"):
        cfg = compose(
            "config",
            overrides=["hydra/launcher=slurm", "experiment=overlap_sweep"],
            return_hydra_config=True,
        )
    launcher = cfg.hydra.launcher
    assert launcher._target_.endswith("submitit_launcher.SlurmLauncher")
    assert launcher.tasks_per_node == launcher.gpus_per_node  # one rank per GPU


def test_slurm_task_ids_become_torchrun_ranks():
    env = {
        "PATH": os.environ["PATH"],
        "PYTHONPATH": str(ROOT),
        "SLURM_JOB_ID": "77",
        "SLURM_NTASKS": "4",
        "SLURM_PROCID": "3",
        "SLURM_LOCALID": "1",
        "SLURM_JOB_NODELIST": "node[01-02]",
        "SLURM_JOB_NUM_NODES": "2",
        "SLURM_NODEID": "1",
    }
    code = (
        "import os; from harness.slurm import export_torch_env; assert export_torch_env(); "
        "print(*(os.environ[k] for k in ('MASTER_ADDR', 'RANK', 'WORLD_SIZE', 'LOCAL_RANK')))"
    )
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert out.stdout.split() == ["node01", "3", "4", "1"], out.stderr[-2000:]
    one = {**env, "SLURM_NTASKS": "1", "SLURM_PROCID": "0"}  # one task spawns its own ranks
    code = "from harness.slurm import export_torch_env; print(export_torch_env())"
    out = subprocess.run([sys.executable, "-c", code], env=one, capture_output=True, text=True)
    assert out.stdout.strip() == "False", out.stderr[-2000:]


def test_a_two_task_job_runs_end_to_end(tmp_path):
    table = tmp_path / "t.parquet"
    cmd = [
        sys.executable, "-m", "harness.run", "-m", "hydra/launcher=submitit_local",
        "hydra.launcher.tasks_per_node=2", "hydra.launcher.timeout_min=5",
        f"hydra.sweep.dir={tmp_path / 'sweep'}", "experiment=smoke", "progress=false",
        f"table={table}",
    ]  # fmt: skip
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    df = pd.read_parquet(table)
    assert len(df) == 4 and (df.status == "ok").all() and (df.world_size == 2).all()
