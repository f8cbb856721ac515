"""The runner end to end on the CPU: smoke run, resume without duplicates, clear input errors."""

import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from harness.config import register_configs
from tests.inprocess import launch

ROOT = Path(__file__).resolve().parents[1]


def run(*overrides, check=True):
    proc = subprocess.run(
        [sys.executable, "-m", "harness.run", "progress=false", *overrides],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    if check and proc.returncode != 0:
        raise AssertionError(proc.stdout + proc.stderr)
    return proc


def test_smoke_runs_checks_and_resumes(tmp_path, capsys):
    table = tmp_path / "smoke.parquet"
    out = run(f"table={table}").stdout
    df = pd.read_parquet(table)
    assert len(df) == 4, out
    assert set(df["status"]) == {"ok"}, df[["status", "reason"]]
    assert (df["max_rel_err"] < 1e-4).all()
    assert (df["latency_ms"] > 0).all() and (df["world_size"] == 4).all()
    assert set(df["routing"]) == {"balanced", "stress_skew"}
    assert set(df["experts_per_rank"]) == {2, 4}
    assert (df["imbalance_rank"] >= 1).all() and df["git_rev"].str.len().gt(0).all()
    # serial overlaps nothing: no overlap ratio (not the bounds' noise), and the row says why
    assert (df["compute_ms"] > 0).all() and df["overlap_ratio"].isna().all()
    assert df["extra"].str.contains("serial overlaps nothing").all()
    # a re-run skips every recorded cell and writes no duplicate rows (in-process: no rank)
    assert launch(f"table={table}", "progress=false", ranks=False) == 0
    assert "0 to run" in capsys.readouterr().out
    assert len(pd.read_parquet(table)) == 4


@pytest.mark.parametrize(
    "override, message",
    [  # Hydra's own parsing and composition: through the command line
        ("experiment=nope", "experiment/nope"),
        ("experiment.grid.tokns=[1]", "tokns"),
        ("measure.iter=3", "error: Could not override 'measure.iter'; Key 'iter' not in"),
        ("measure.iters=abc", "error: Error merging override measure.iters=abc"),
        ("workload=nope", "Could not find 'workload/nope'; choices: m_bert, m_gpt"),
        ("+experiment.systems.overlap.params=[1]", "wrong type or shape (TypeError"),
    ],
)
def test_bad_input_is_a_clear_error(tmp_path, override, message):
    proc = run(f"table={tmp_path / 't.parquet'}", override, check=False)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert message in proc.stdout + proc.stderr
    assert "Traceback" not in proc.stdout + proc.stderr
    assert "HYDRA_FULL_ERROR=1 for a complete stack trace" not in proc.stderr  # Hydra's dump
    assert not (tmp_path / "t.parquet").exists()


def test_a_command_line_hydra_cannot_compose_is_answered_without_importing_torch():
    """harness.run imports torch once its task starts, so the one-line answer to a misspelt
    key or group takes well under a second, not the 2-3 s of torch's import."""
    code = "import sys, harness.run; print(sorted(m for m in sys.modules if m.startswith('torch')))"
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True)
    assert proc.returncode == 0 and proc.stdout.strip() == "[]", proc.stdout[:300] + proc.stderr


@pytest.mark.parametrize(
    "override, message",
    [  # the harness's checks (one line each before any rank: the CLI path as above)
        ("+experiment.systems.nope={}", "unknown system 'nope'; choices"),
        ("experiment.select=[nope]", "experiment.select names ['nope']"),
        ("+experiment.systems.serial.params.ccta=4", "system 'serial' has no parameter 'ccta'"),
        ("+experiment.params.tutel_degres=[1]", "unknown key experiment.params"),
        ("+measure.iter=3", "unknown key measure.iter"),
        ("experiment.grid.routing=[zipf]", "unknown routing 'zipf'; choices"),
        ("hardware=h200", "needs CUDA GPUs"),
        ("experiment.grid.experts_per_rank=[0]", "experts_per_rank must be >= 1"),
        ("+experiment.systems.overlap.params.tile_m=null", "tile_m must be one of (64, 128)"),
        ("experiment.grid.tokens_per_rank=[1000000000]", "GiB (tokens, weights, expert rows"),
    ],
)
def test_bad_settings_are_one_line_errors_before_any_rank(tmp_path, monkeypatch, override, message):
    import harness.run as hr
    from harness.errors import HarnessUserError

    def no_ranks(*a, **k):
        raise AssertionError("ranks started")

    monkeypatch.setattr(hr, "run_ranks", no_ranks)
    register_configs()
    with initialize_config_dir(str(ROOT / "conf"), version_base="1.3"):
        cfg = compose("config", overrides=[f"table={tmp_path / 't.parquet'}", override])
    with pytest.raises((HarnessUserError, ValueError)) as exc:
        hr.launch(cfg, None)
    assert message in str(exc.value) and "\n" not in str(exc.value)
    assert not (tmp_path / "t.parquet").exists()


@pytest.mark.parametrize(
    "experiment, override, message",
    [
        (
            "bandwidth",
            "+experiment.grid.routing=[stress_skew]",
            "experiment bandwidth reads experiment.grid.out, dtype only; "
            "routing=['stress_skew'] would be ignored",
        ),
        ("bandwidth", "experiment.grid.out=[4096,8192]", "grid.out takes one value"),
        ("padding", "experiment.grid.out=[128]", "out=[128] would be ignored"),
        ("producer", "experiment.grid.ffn=[128]", "ffn=[128] would be ignored"),
        ("models_smoke", "experiment.grid.world_size=[4]", "world_size=[4] would be ignored"),
        ("smoke", "+experiment.options.segment_kib=[16]", "smoke takes no experiment.options"),
    ],
)
def test_a_setting_the_experiment_ignores_is_an_error(experiment, override, message):
    """An axis or option the experiment does not read would change nothing (not even the
    cells): one line before any work, not a silently ignored setting."""
    from harness.errors import HarnessUserError
    from harness.preflight import preflight

    register_configs()
    with initialize_config_dir(str(ROOT / "conf"), version_base="1.3"):
        cfg = compose("config", overrides=[f"experiment={experiment}", "hardware=cpu", override])
        with pytest.raises(HarnessUserError) as exc:
            preflight(cfg, 1, table=False)
        assert message in str(exc.value) and "\n" not in str(exc.value)
        # the same experiment without the override passes preflight
        plain = compose("config", overrides=[f"experiment={experiment}", "hardware=cpu"])
        assert preflight(plain, 1, table=False).cells


#: experiment files that add rows to another experiment's table
PASSES = {
    "bandwidth_nvshmem": "bandwidth",
    "correctness_nvshmem": "correctness",
    "correctness_loopback": "correctness",
    "experts_operator": "experts",
}


def test_every_experiment_config_composes_and_dry_runs(capsys):
    register_configs()
    names = sorted(p.stem for p in (ROOT / "conf" / "experiment").glob("*.yaml"))
    assert "smoke" in names
    with initialize_config_dir(str(ROOT / "conf"), version_base="1.3"):
        for name in names:
            cfg = compose("config", overrides=[f"experiment={name}"])
            # a second pass of an experiment writes into its table (torch's one symmetric-memory
            # backend per process: the nvshmem passes; the loopback and operator-scope passes)
            assert cfg.experiment.name == PASSES.get(name, name)
    # in-process (the command line's dry run: test_reliability's test_7)
    assert launch("experiment=smoke", "dry_run=true", ranks=False) == 0
    assert "dry run of smoke: 4 cells" in capsys.readouterr().out


@pytest.mark.parametrize(
    "workload, shape",
    [
        ("table2", ([8192, 16384], [2048], [4096, 8192], [4, 8, 16, 32, 64])),
        ("m_gpt", ([8192], [768], [3072], [16])),
        ("m_bert", ([16384], [768], [3072], [16])),
        ("m_transxl", ([8192], [512], [2048], [16])),
    ],
)
def test_named_workloads_set_the_operator_shape(workload, shape):
    register_configs()
    with initialize_config_dir(str(ROOT / "conf"), version_base="1.3"):
        cfg = compose("config", overrides=["experiment=operator", f"workload={workload}"])
    g = cfg.experiment.grid
    assert (list(g.tokens_per_rank), list(g.hidden), list(g.out), list(g.experts_per_rank)) == shape
    assert list(g.top_k) == [2]


@pytest.mark.parametrize(
    "n_gpu, first, last",
    [("0", "smoke", "padding"), ("1", "smoke", "layer_loopback"), ("2", "smoke", "producer")],
)
def test_reproduce_preset_follows_the_gpu_count(n_gpu, first, last):
    out = subprocess.run(
        ["make", "-n", "reproduce", f"N_GPU={n_gpu}"], cwd=ROOT, capture_output=True, text=True
    ).stdout
    line = next(x for x in out.splitlines() if x.startswith("for e in "))
    names = line.removeprefix("for e in ").split(";")[0].split()
    assert names[0] == first and names[-1] == last
    for name in names:  # every preset entry is an experiment
        assert (ROOT / "conf" / "experiment" / f"{name}.yaml").exists(), name


def test_a_cell_that_cannot_fit_the_memory_is_refused_before_any_rank(monkeypatch):
    """The floor counts one rank's tokens, weights, expert rows and output, times the ranks
    that share the memory (all of them on a CPU host, or where one process plays them)."""
    import harness.preflight as pf

    cell = dict(
        system="serial",
        world_size=4,
        tokens_per_rank=1000,
        hidden=64,
        out=32,
        experts_per_rank=3,
        top_k=2,
        dtype="bfloat16",
    )
    floor = (1000 * 64 + 3 * 64 * 32 + 1000 * 2 * 32 + 1000 * 32) * 2
    assert pf.rank_floor_bytes(cell) == floor
    assert pf.rank_floor_bytes({**cell, "ffn": 16}) == floor + (3 * 2 * 64 * 16 - 3 * 64 * 32) * 2
    assert pf.rank_floor_bytes({"segment_kib": 16}) == 0  # not a workload cell
    cpu = OmegaConf.create({"hardware": {"device": "cpu"}})
    gpu = OmegaConf.create({"hardware": {"device": "cuda"}})
    monkeypatch.setattr(pf, "memory_bytes", lambda cfg: 4 * floor)
    pf.check_memory(cpu, [cell], 4)  # 4 ranks on the host: exactly fits
    pf.check_memory(gpu, [{**cell, "world_size": 8}], 8)  # one rank per GPU
    with pytest.raises(pf.HarnessUserError, match=r"of 8 rank\(s\)\), more than"):
        pf.check_memory(gpu, [{**cell, "world_size": 8}], 1)  # one process plays all 8
    with pytest.raises(pf.HarnessUserError, match="GiB of this host"):
        pf.check_memory(cpu, [{**cell, "world_size": 5}], 5)
    pf.check_memory(gpu, [{**cell, "world_size": 8}], 1, one_rank=True)  # one rank's problem
    pf.check_memory(gpu, [{**cell, "world_size": 64, "tokens_per_rank": 10**9}], 2)  # skipped
    monkeypatch.setattr(pf, "memory_bytes", lambda cfg: None)  # a GPU config, no GPU here
    pf.check_memory(gpu, [{**cell, "tokens_per_rank": 10**12}], 1)
