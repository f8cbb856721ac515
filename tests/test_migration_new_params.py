"""The 2026-12-03 param migrations: megatron_cutlass's and megatron_te's rows hashed before the
param `capacity` get the hash of the cell with capacity=dropless (what they ran); overlap's rows
hashed with `dispatch_overlap` (a param that came and left) get the hash of today's cell and lose
the variant's columns; eager and graph-mode rows alike; other systems' rows stay; a second run
changes nothing."""

import importlib.util
from pathlib import Path

import pandas as pd
import pytest
from hydra import compose, initialize_config_dir

from harness.config import register_configs
from harness.measure import expand_grid, hash_cell
from harness.records import ResultsTable
from tests.test_migration_dispatch import _row  # the row a migration reads

ROOT = Path(__file__).resolve().parents[1]
MIGRATIONS = ROOT / "results/reference/migrations"
MEGATRON = ("megatron_cutlass", "megatron_te")
#: (script, the systems it moves, the param, the value the old rows ran)
CASES = [
    ("2026_12_03_megatron_capacity.py", MEGATRON, "capacity", "dropless"),
]


def _migration(script: str):
    spec = importlib.util.spec_from_file_location(script[:-3], MIGRATIONS / script)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.parametrize("script,systems,knob,ran", CASES)
def test_the_migration_gives_old_rows_what_they_ran_and_todays_hash(
    tmp_path, script, systems, knob, ran
):
    register_configs()
    rows, want, moved = [], [], 0
    for graph in ("false", "auto"):
        over = ["experiment=layer_w1", "hardware=h200", f"measure.graph={graph}"]
        with initialize_config_dir(str(ROOT / "conf"), version_base="1.3"):
            cfg = compose("config", overrides=over)
        for c in expand_grid(cfg, 1):
            if c["system"] not in (*systems, "serial"):
                continue
            del c["cell_hash"]
            c["params"] = {**c["params"], knob: ran} if c["system"] in systems else c["params"]
            before = {k: v for k, v in c["params"].items() if k != knob}
            if c["system"] == "serial":  # not migrated: keeps its hash
                rows.append(_row(cfg, c, c["params"], hash_cell(cfg, 1, c)))
                want.append(rows[-1].cell_hash)
                continue
            rows.append(_row(cfg, c, before, hash_cell(cfg, 1, {**c, "params": before})))
            want.append(hash_cell(cfg, 1, c))
            moved += 1
    path = tmp_path / "t.parquet"
    ResultsTable(path).append(rows)
    mig = _migration(script)
    assert moved and mig.migrate(path) == {"migrated": moved, "done": len(rows) - moved}
    df = pd.read_parquet(path)
    assert sorted(df["cell_hash"]) == sorted(want)
    assert (df[df["system"].isin(systems)][f"p_{knob}"] == ran).all()
    assert mig.migrate(path) == {"done": len(rows)}  # idempotent


def test_the_removal_gives_overlap_rows_todays_hash_and_drops_the_variants_columns(tmp_path):
    register_configs()
    rows, want = [], []
    for graph in ("false", "auto"):
        over = ["experiment=layer_w1", "hardware=h200", f"measure.graph={graph}"]
        with initialize_config_dir(str(ROOT / "conf"), version_base="1.3"):
            cfg = compose("config", overrides=over)
        for c in expand_grid(cfg, 1):
            if c["system"] not in ("overlap", "serial"):
                continue
            del c["cell_hash"]
            want.append(hash_cell(cfg, 1, c))
            if c["system"] == "serial":  # not migrated: keeps its hash
                rows.append(_row(cfg, c, c["params"], want[-1]))
                continue
            then = {**c["params"], "dispatch_overlap": "off"}
            rows.append(_row(cfg, c, then, hash_cell(cfg, 1, {**c, "params": then})))
    path = tmp_path / "t.parquet"
    ResultsTable(path).append(rows)
    df = pd.read_parquet(path)
    df["p_dispatch_overlap_used"] = df["p_dispatch_overlap"]
    df.to_parquet(path, index=False)
    moved = int((df["system"] == "overlap").sum())
    mig = _migration("2026_12_03_dispatch_overlap_removed.py")
    assert moved and mig.migrate(path) == {"migrated": moved, "done": len(rows) - moved}
    df = pd.read_parquet(path)
    assert sorted(df["cell_hash"]) == sorted(want)
    assert not [c for c in df.columns if "dispatch_overlap" in c]
    assert mig.migrate(path) == {"done": len(rows)}  # idempotent
