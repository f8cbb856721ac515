"""Issue 42, finding 7 (parts): a run folder Hydra cannot create is named with its cause, a
misspelt key gets the nearest valid one, a models row records the tolerance that gated it,
and the tests hand Hydra its version_base by name."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf

from harness.config import nearest_key
from harness.run import hydra_error_line

ROOT = Path(__file__).resolve().parents[1]


def _run(*overrides: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "harness.run", "progress=false", "dry_run=true", *overrides],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_a_run_folder_hydra_cannot_create_is_one_line_with_its_cause(tmp_path):
    (tmp_path / "file").write_text("a file, not a folder")
    proc = _run(f"hydra.run.dir={tmp_path / 'file' / 'run'}")
    assert proc.returncode == 2, proc.stdout + proc.stderr
    (line,) = proc.stderr.strip().splitlines()
    assert line.startswith("error: NotADirectoryError: ") and "Not a directory" in line, line
    assert "hydra.run.dir" in line and "HYDRA_FULL_ERROR" not in line, line


def test_a_trace_gives_its_exception_line_not_hydras_hint():
    text = (
        "Traceback (most recent call last):\n"
        '  File "/usr/lib/python3.11/pathlib.py", line 1116, in mkdir\n'
        "    os.mkdir(self, mode)\n"
        "PermissionError: [Errno 13] Permission denied: 'results/hydra/x'\n"
        "\n"
        "Set the environment variable HYDRA_FULL_ERROR=1 for a complete stack trace.\n"
    )
    line = hydra_error_line(text)
    assert line.startswith("PermissionError: [Errno 13] Permission denied: 'results/hydra/x'")
    assert "run folder" in line
    assert hydra_error_line(text.replace("PermissionError", "KeyError")).startswith("KeyError:")
    assert "run folder" not in hydra_error_line(text.replace("PermissionError", "KeyError"))


def test_a_misspelt_key_without_plus_names_the_nearest_valid_key():
    proc = _run("experiment.grid.tokens_per_rnk=[4]")
    assert proc.returncode == 2, proc.stdout + proc.stderr
    (line,) = proc.stderr.strip().splitlines()
    assert line.endswith("did you mean experiment.grid.tokens_per_rank?"), line


@pytest.mark.parametrize(
    "key,near",
    [
        ("hardwre.timeout_s", "hardware.timeout_s"),
        ("measure.itres", "measure.iters"),
        ("experiment.gird.ffn", "experiment.grid.ffn"),
        ("experiment.sytems.serial.params.ccta", "experiment.systems.serial.params.ccta"),
        ("seeed", "seed"),
        ("hardware.timeout_s", None),  # a key of the schema
        ("nothing_like_it.at_all", None),
    ],
)
def test_the_nearest_key_follows_the_schema(key, near):
    assert nearest_key(key) == near


def test_a_models_row_records_the_tolerance_that_gated_it():
    from experiments import models as exp
    from harness.layout import rank_layout
    from harness.models import ModelSpec, SystemMoE, owned_inputs
    from harness.rank import _stamp
    from harness.reference import dispatch_local
    from harness.system import CellInputs, RunContext
    from harness.workload import make_rank_fc1, make_rank_weights, make_tokens, routing_of
    from systems.serial import SerialSystem

    cpu = torch.device("cpu")
    ctx = RunContext(0, 1, cpu)
    tiny = ModelSpec("tiny", 2, (0, 1), 2, 8, 32, 4, True, experts=4, top_k=2, dtype="float32")
    spec = tiny.moe_spec(1, 0)
    r = routing_of(spec)
    inputs = CellInputs(
        spec,
        rank_layout(spec, 0),
        make_tokens(spec, 0, cpu),
        make_rank_weights(spec, 0, cpu),
        dispatch_local(spec, rank_layout(spec, 0), cpu),
        make_rank_fc1(spec, 0, cpu),
        r.expert_ids[0],
        r.gate_weights[0].float(),
    )
    inputs = owned_inputs(inputs)
    system = SerialSystem(ctx, {})
    system.setup([inputs])
    cfg = OmegaConf.create(
        {
            "measure": {"tol": 8e-3, "warmup": 1, "iters": 3},
            "hardware": {"name": "cpu"},
            "experiment": {"options": {"model_tol": 5e-2}},
        }
    )
    cell = {"experiment": "t", "system": "serial", "cell_hash": "h", "world_size": 1}
    row = exp._row({**cell, "params": {}}, tiny)
    ref = exp.reference(ctx, tiny, 0)
    assert exp.checked_forward(ctx, cfg, row, ref, SystemMoE(system, inputs))
    (row,) = _stamp([row], cfg, ctx)
    assert row.tol == 5e-2 and row.max_rel_err < row.tol  # the output's error, gated by model_tol
    assert row.metrics["moe_tol"] == 8e-3 > row.metrics["moe_max_rel_err"]


def test_the_tests_give_hydra_its_version_base_by_name():
    """initialize(config_path, job_name, ...) and initialize_config_dir(config_dir, job_name,
    ...): a second positional argument is the job's name, not version_base."""
    wrong = []
    for path in sorted((ROOT / "tests").glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and len(node.args) > 1:
                name = getattr(node.func, "id", getattr(node.func, "attr", ""))
                if name in ("initialize", "initialize_config_dir", "initialize_config_module"):
                    wrong.append(f"{path.name}:{node.lineno}")
    assert not wrong, f"a positional job_name (meant as version_base?) at {wrong}"


def test_a_misspelt_key_added_with_plus_names_the_nearest_valid_key():
    proc = _run("+measure.iter=3")
    assert proc.returncode == 2, proc.stdout + proc.stderr
    (line,) = proc.stderr.strip().splitlines()
    assert "unknown key measure.iter" in line and "did you mean measure.iters?" in line, line


def test_a_value_listed_twice_on_a_grid_axis_is_rejected_before_any_rank():
    proc = _run("experiment.grid.experts_per_rank=[2,4,2]")
    assert proc.returncode == 2, proc.stdout + proc.stderr
    (line,) = proc.stderr.strip().splitlines()
    assert line == "error: experiment.grid.experts_per_rank lists 2 twice", line


def test_the_start_message_says_ffn_cells_take_out_equal_to_hidden(tmp_path):
    from hydra import compose, initialize_config_dir

    from harness.config import register_configs
    from harness.preflight import preflight, start_message

    register_configs()
    over = ["experiment=layer", "hardware=cpu", f"table={tmp_path / 't.parquet'}"]
    with initialize_config_dir(str(ROOT / "conf"), version_base="1.3"):
        cfg = compose("config", overrides=over)
    msg = start_message(cfg, preflight(cfg, 2, writable=False))
    assert "FFN cells take out = hidden (experiment.grid.out [4096] is not used" not in msg
    with initialize_config_dir(str(ROOT / "conf"), version_base="1.3"):
        cfg = compose("config", overrides=[*over, "experiment.grid.out=[1024]"])
    msg = start_message(cfg, preflight(cfg, 2, writable=False))
    assert "FFN cells take out = hidden (experiment.grid.out [1024] is not used" in msg, msg
