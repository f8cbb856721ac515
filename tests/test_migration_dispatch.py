"""The 2026-12-03 dispatch migration: serial's and overlap's rows hashed before the param
`dispatch` get the hash of the cell with the dispatch they ran (nccl in the layer scope, auto in
the operator's); other rows stay; a second run changes nothing."""

import importlib.util
import json
from pathlib import Path

import pandas as pd
from hydra import compose, initialize_config_dir

from harness.config import register_configs
from harness.measure import expand_grid, hash_cell
from harness.records import ResultsTable, Row

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "results/reference/migrations/2026_12_03_dispatch_param.py"
SPEC = ("world_size", "tokens_per_rank", "hidden", "out", "experts_per_rank", "top_k", "routing")


def _migration():
    spec = importlib.util.spec_from_file_location("dispatch_param", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _cells(*overrides):
    register_configs()
    with initialize_config_dir(str(ROOT / "conf"), version_base="1.3"):
        cfg = compose("config", overrides=["measure.graph=false", *overrides])
    return cfg, [c for c in expand_grid(cfg, 2) if c["system"] in ("overlap", "serial", "tutel")]


def _row(cfg, cell: dict, params: dict, h: str) -> Row:
    m, hw = cfg.measure, cfg.hardware
    return Row(
        experiment=cell["experiment"], system=cell["system"], cell_hash=h,
        **{k: cell[k] for k in (*SPEC, "dtype", "ffn")}, params=params, hardware=hw.name,
        backend=hw.backend, warmup=int(m.warmup), iters=int(m.iters), tol=float(m.tol),
        command="python -m harness.run", extra=json.dumps({"rounds": int(m.rounds)}),
    )  # fmt: skip


def test_the_migration_gives_the_dispatch_the_rows_ran_and_todays_hash(tmp_path):
    rows, want, kinds = [], [], []
    for overrides in (("experiment=operator",), ("experiment=layer",)):
        cfg, cells = _cells(*overrides, "experiment.grid.routing=[balanced]")
        for c in cells:
            del c["cell_hash"]
            if c["system"] == "tutel":  # not migrated: keeps its hash
                h = hash_cell(cfg, 2, c)
                rows.append(_row(cfg, c, c["params"], h))
                want.append(h)
                continue
            # the rows it moved were made before the knobs added after it (LATER)
            then = {k: v for k, v in c["params"].items() if k not in _migration().LATER}
            before = {k: v for k, v in then.items() if k != "dispatch"}
            h = hash_cell(cfg, 2, {**c, "params": before})
            rows.append(_row(cfg, c, before, h))
            ran = "nccl" if c["ffn"] else "auto"
            want.append(hash_cell(cfg, 2, {**c, "params": {**then, "dispatch": ran}}))
            kinds.append(ran)
    path = tmp_path / "t.parquet"
    ResultsTable(path).append(rows)
    mig = _migration()
    moved = len(kinds)
    assert {"auto", "nccl"} <= set(kinds)
    assert mig.migrate(path) == {"migrated": moved, "done": len(rows) - moved}
    df = pd.read_parquet(path)
    assert sorted(df["cell_hash"]) == sorted(want)
    assert sorted(df["p_dispatch"].dropna()) == sorted(kinds)
    assert mig.migrate(path) == {"done": len(rows)}  # idempotent
