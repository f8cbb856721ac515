"""The machine (issue 56, item 3): the GPU model and count name the row, the cell hash and the
reference folder, so an H100 node never writes into the H200 tables; CPU cells keep their
hashes (the committed CPU table still resumes)."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pandas as pd
import pytest
from hydra import compose, initialize_config_dir

from harness import records
from harness.config import register_configs
from harness.measure import expand_grid, hash_cell
from harness.records import Row, gpu_model, machine_name, provenance, row_dict, this_machine

ROOT = Path(__file__).resolve().parents[1]


def _compose(*overrides):
    register_configs()
    with initialize_config_dir(str(ROOT / "conf"), version_base="1.3"):
        return compose("config", overrides=list(overrides))


@pytest.mark.parametrize(
    "name, model",
    [
        ("NVIDIA H200", "h200"),
        ("NVIDIA H100 80GB HBM3", "h100"),
        ("NVIDIA H100 PCIe", "h100"),
        ("NVIDIA A100-SXM4-80GB", "a100"),
        ("NVIDIA GH200 480GB", "gh200"),
        ("Tesla V100-SXM2-32GB", "v100"),
        ("NVIDIA B200", "b200"),
        ("Some Accelerator", "gpu"),
    ],
)
def test_the_gpu_model_is_a_short_lowercase_tag(name, model):
    assert gpu_model(name) == model


def test_the_machine_is_the_model_and_the_count():
    assert machine_name("NVIDIA H200", 1) == "h200"
    assert machine_name("NVIDIA H200", 2) == "h200x2"
    assert machine_name("NVIDIA H100 80GB HBM3", 8) == "h100x8"
    assert machine_name("x86_64", 0) == "cpu"


def test_the_machine_agrees_with_the_figures_name():
    from plots.common import machine

    for name, n in (("NVIDIA H200", 1), ("NVIDIA H100 80GB HBM3", 8), ("x86_64", 0)):
        df = pd.DataFrame({"gpu_name": [name], "gpu_count": [n], "timestamp": [1.0]})
        assert machine(df) == machine_name(name, n)


def test_rows_carry_the_machine():
    import torch

    if not torch.cuda.is_available():
        assert this_machine() == "cpu"
    assert provenance()["machine"] == this_machine() != ""
    row = Row("x", "serial", **provenance())
    assert row_dict(row)["machine"] == this_machine()


def _cfg(device: str, name: str = "h200"):
    backend = "nccl" if device == "cuda" else "gloo"
    return SimpleNamespace(
        measure=SimpleNamespace(warmup=1, iters=2, tol=8e-3, rounds=1, graph="auto"),
        hardware=SimpleNamespace(name=name, device=device, backend=backend),
    )


CELL = {"experiment": "x", "system": "serial", "seed": 0, "world_size": 2, "params": {}}


def _hash(monkeypatch, machine: str, device: str = "cuda") -> str:
    monkeypatch.setattr(records, "this_machine", lambda: machine)
    return hash_cell(_cfg(device), 2, CELL)


def test_the_gpu_model_and_count_enter_the_cell_hash(monkeypatch):
    preset = _hash(monkeypatch, "cpu")  # no GPU here (a dry run): the preset's name
    assert _hash(monkeypatch, "h200") == preset  # one H200: the hashes the preset always had
    h200x8, h100x8 = _hash(monkeypatch, "h200x8"), _hash(monkeypatch, "h100x8")
    assert len({preset, _hash(monkeypatch, "h200x2"), h200x8, h100x8}) == 4
    assert _hash(monkeypatch, "h100") not in (preset, h100x8)


def test_cpu_cells_keep_their_hashes_on_any_host(monkeypatch):
    cpu = _hash(monkeypatch, "cpu", "cpu")
    assert _hash(monkeypatch, "h100x8", "cpu") == cpu


def test_the_committed_cpu_table_resumes(monkeypatch):
    from experiments import padding

    monkeypatch.setattr(records, "this_machine", lambda: "h100x8")  # also on a GPU host
    df = pd.read_parquet(ROOT / "results/reference/cpu/padding.parquet", columns=["cell_hash"])
    cells = padding.cells(_compose("experiment=padding"), 1)
    assert set(df["cell_hash"]) <= {c["cell_hash"] for c in cells}


def test_an_h100_run_never_resumes_an_h200_cell(monkeypatch):
    cfg = _compose("experiment=multigpu_smoke")
    hashes = {}
    for machine in ("h200x2", "h100x2", "h100x8"):
        monkeypatch.setattr(records, "this_machine", lambda m=machine: m)
        hashes[machine] = {c["cell_hash"] for c in expand_grid(cfg, 2)}
    assert not hashes["h200x2"] & hashes["h100x2"] and not hashes["h100x2"] & hashes["h100x8"]
