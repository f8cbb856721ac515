"""The 2026-12-03 re-hash migration: a table written with the old cell hash (HASH_OPTIONAL, ffn
and rounds only when set) gets the hash harness.measure.hash_cell gives the same cell now; rows
of retired variants keep theirs; a second run changes nothing."""

import hashlib
import importlib.util
import json
from pathlib import Path

import pandas as pd
from hydra import compose, initialize_config_dir

from harness.config import register_configs
from harness.measure import expand_grid, hash_cell
from harness.records import ResultsTable, Row

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "results/reference/migrations/2026_12_03_params_rehash.py"
SPEC = ("world_size", "tokens_per_rank", "hidden", "out", "experts_per_rank", "top_k", "routing")
#: what the old harness filled in and left out of the hash (harness/measure.py at a5f15c4)
RETIRED_DEFAULTS = {
    "local": "direct",
    "swizzle": "table",
    "backoff_ns": 0,
    "handshake": "allreduce",
    "handshake_stream": "step",
}
OLD_OPTIONAL = {
    "local": "copy",
    "layout": "aligned",
    "order": "remote_first",
    "swizzle": "table",
    "consumer": "own",
    "backoff_ns": 0,
    "handshake": "allreduce",
    "handshake_stream": "step",
}


def _old_hash(cfg, processes: int, cell: dict) -> str:
    """The cell hash as the harness computed it before the migration (copied, not imported)."""
    cell = dict(cell)
    if cell.get("ffn", 0) == 0:
        cell.pop("ffn", None)
    if cell["system"] == "overlap":
        p = cell["params"]
        cell["params"] = {
            k: v for k, v in p.items() if not (k in OLD_OPTIONAL and v == OLD_OPTIONAL[k])
        }
    m, hw = cfg.measure, cfg.hardware
    measure = {"warmup": int(m.warmup), "iters": int(m.iters), "tol": float(m.tol)}
    if int(m.rounds) != 1:
        measure["rounds"] = int(m.rounds)
    run = {
        "measure": measure,
        "hardware": {"name": hw.name, "device": hw.device, "backend": hw.backend},
        "processes": processes,
    }
    blob = json.dumps({**cell, "run": run}, sort_keys=True, default=str)
    return hashlib.sha1(blob.encode()).hexdigest()[:16]


def _migration():
    spec = importlib.util.spec_from_file_location("rehash", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _row(cfg, cell: dict, params: dict, h: str) -> Row:
    m, hw = cfg.measure, cfg.hardware
    return Row(
        experiment=cell["experiment"],
        system=cell["system"],
        cell_hash=h,
        **{k: cell[k] for k in (*SPEC, "dtype", "ffn")},
        params=params,
        hardware=hw.name,
        backend=hw.backend,
        warmup=int(m.warmup),
        iters=int(m.iters),
        tol=float(m.tol),
        command="python -m harness.run experiment=operator",
        extra=json.dumps({"rounds": int(m.rounds)}),
    )


def test_the_migration_gives_todays_hash_and_keeps_retired_rows(tmp_path):
    register_configs()
    overrides = ["experiment=operator", "experiment.grid.routing=[balanced]"]
    with initialize_config_dir(str(ROOT / "conf"), version_base="1.3"):
        cfg = compose("config", overrides=overrides)
    cells = [c for c in expand_grid(cfg, 2) if c["system"] in ("overlap", "serial")]
    for c in cells:
        del c["cell_hash"]  # the hash covers the cell without it
    assert {c["system"] for c in cells} == {"overlap", "serial"}
    rows, want = [], []
    for c in cells:
        old = dict(c["params"])
        if c["system"] == "overlap":
            old = {**old, **RETIRED_DEFAULTS, "order": "remote_first"}
            c = {**c, "params": {**c["params"], "order": "remote_first"}}
        h = _old_hash(cfg, 2, {**c, "params": old})
        rows.append(_row(cfg, c, old, h))
        want.append(hash_cell(cfg, 2, c))
        assert want[-1] != h  # every hash changes: ffn and rounds now enter every cell
    overlap = next(c for c in cells if c["system"] == "overlap")
    copy = {**overlap["params"], **RETIRED_DEFAULTS, "local": "copy"}  # a retired variant
    retired = _old_hash(cfg, 2, {**overlap, "params": copy})
    rows.append(_row(cfg, overlap, copy, retired))
    want.append(retired)
    path = tmp_path / "operator.parquet"
    ResultsTable(path).append(rows)
    mig = _migration()
    assert mig.migrate(path) == {"migrated": len(cells), "retired": 1}
    df = pd.read_parquet(path)
    assert len(df) == len(rows)
    assert sorted(df["cell_hash"]) == sorted(want)
    assert mig.migrate(path) == {"done": len(cells), "retired": 1}  # idempotent
    assert sorted(pd.read_parquet(path)["cell_hash"]) == sorted(want)
