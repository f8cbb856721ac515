"""One-off migration (2026-12-03, issue 38): re-hash the committed tables for the harness's hash
without its compatibility entries.

Before, a cell's hash left out the overlap system's HASH_OPTIONAL knobs at the value tables were
measured with before the knob (local=copy, layout=aligned, order=remote_first, swizzle=table,
consumer=own, backoff_ns=0, handshake=allreduce, handshake_stream=step), the workload axis ffn
at 0 and measure.rounds at 1. Now every cell carries ffn and rounds, and the overlap system has
seven knobs (systems/overlap/params.py): local, swizzle, backoff_ns, handshake and
handshake_stream are gone, layout "packed" too.

Per row of every table under results/reference/ with a cell_hash: the cell is rebuilt from the
row's columns (workload, p_<knob> columns, run settings; the seed, the device and the number of
processes from the few values they can take) and hashed the old way; where that gives the
stored hash, the row takes the hash the harness gives the same cell now (harness.measure
hash_cell), so a re-run resumes on it. Rows of retired variants (local=copy, which rows without
p_local ran, a swizzle other than table, backoff_ns != 0, handshake=barrier,
handshake_stream=consumer, layout=packed) keep their old hash: no cell of today's grid is
theirs. Rows whose old hash cannot be rebuilt (cells of an experiment's own format, such as
bandwidth, models and producer, or of an older harness) are left as they are. No row is dropped
and no other column changes. Running it again changes nothing (a row already at its new hash
counts as done).

Run once from the repository root:
  python3 results/reference/migrations/2026_12_03_params_rehash.py [table.parquet ...]
(no argument: every table under results/reference/).
"""

from __future__ import annotations

import hashlib
import itertools
import json
import re
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pandas as pd

ROOT = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(ROOT))

from harness.measure import hash_cell  # noqa: E402
from harness.system import registry  # noqa: E402

SPEC_KEYS = ("tokens_per_rank", "hidden", "out", "experts_per_rank", "top_k", "routing", "dtype")
#: the overlap system's PARAMS and HASH_OPTIONAL before this migration
OLD_OVERLAP = {
    "ccta": 16,
    "mgb": 1,
    "tile_m": 128,
    "transport": "",
    "local": "direct",
    "layout": "aligned",
    "order": "auto",
    "swizzle": "table",
    "consumer": "own",
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
#: a row of the overlap system ran a retired variant where one of these holds
RETIRED = {
    "local": lambda v: v == "copy",
    "swizzle": lambda v: v != "table",
    "backoff_ns": lambda v: v != 0,
    "handshake": lambda v: v == "barrier",
    "handshake_stream": lambda v: v == "consumer",
    "layout": lambda v: v == "packed",
}
DEVICES = {"cpu": "cpu", "h200": "cuda"}


def old_hash(cell: dict, run: dict) -> str:
    """The hash as harness.measure.hash_cell gave it before (records.cell_hash of the cell
    with its hashed params and the run settings, ffn and rounds only when set)."""
    cell = dict(cell)
    if cell.get("ffn", 0) == 0:
        cell.pop("ffn", None)
    if cell["system"] == "overlap":
        p = cell["params"]
        cell["params"] = {
            k: v for k, v in p.items() if not (k in OLD_OPTIONAL and v == OLD_OPTIONAL[k])
        }
    measure = dict(run["measure"])
    if measure.get("rounds", 1) == 1:
        measure.pop("rounds", None)
    blob = json.dumps({**cell, "run": {**run, "measure": measure}}, sort_keys=True, default=str)
    return hashlib.sha1(blob.encode()).hexdigest()[:16]


def new_hash(cell: dict, run: dict) -> str:
    """The hash harness.measure.hash_cell gives the cell now."""
    m, hw = run["measure"], run["hardware"]
    cfg = SimpleNamespace(measure=SimpleNamespace(**m), hardware=SimpleNamespace(**hw))
    return hash_cell(cfg, run["processes"], cell)


def _missing(v: Any) -> bool:
    return v is None or (isinstance(v, float) and v != v)


def _typed(v: Any, default: Any) -> Any:
    """A p_<key> cell back as the value the cell held (ints stored as floats or text, lists
    and mappings as JSON text)."""
    if isinstance(default, bool):
        return bool(v)
    if isinstance(default, int) and not isinstance(v, bool):
        text = str(v)
        if re.fullmatch(r"-?[0-9]+(\.0+)?", text):
            return int(float(text))
        return v
    if isinstance(default, float):
        return float(v)
    if isinstance(default, (list, dict)) and isinstance(v, str):
        return json.loads(v)
    return v


def old_params(row: dict, defaults: dict, optional: dict) -> dict:
    """The params a row's cell held: a missing p_<key> is the value the knob stands for in
    rows made before it (optional) or its default."""
    out = {}
    for k, d in defaults.items():
        v = row.get(f"p_{k}")
        out[k] = optional.get(k, d) if _missing(v) else _typed(v, d)
    return out


def _workload(row: dict, keys: tuple) -> dict:
    """The row's workload columns as the cell held them (ffn 0 in rows made before it)."""
    out = {}
    for k in keys:
        v = row.get(k, 0)
        out[k] = v if k in ("routing", "dtype") else int(0 if _missing(v) else v)
    return out


def cells_of(row: dict, seed: int, params: dict) -> list[dict]:
    """The cell in each format the harness builds it: expand_grid's and the padding study's."""
    head = {"experiment": row["experiment"], "system": row["system"], "seed": seed}
    grid = {**head, **_workload(row, ("world_size", *SPEC_KEYS, "ffn")), "params": params}
    pad = ("world_size", "tokens_per_rank", "experts_per_rank", "top_k", "routing")
    return [grid, {**head, **_workload(row, pad), "params": params}]


def runs_of(row: dict) -> list[dict]:
    """The run settings the row can have been measured with."""
    extra = json.loads(row.get("extra") or "{}")
    cmd = str(row.get("command") or "")
    rounds = {1, int(extra.get("rounds", 1))}
    rounds |= {int(r) for r in re.findall(r"measure\.rounds=([0-9]+)", cmd)}
    name = row["hardware"]
    devices = [DEVICES[name]] if name in DEVICES else ["cuda", "cpu"]
    procs = {1, int(row["world_size"]), int(row.get("gpu_count") or 1)}
    out = []
    for r, dev, n in itertools.product(sorted(rounds), devices, sorted(procs)):
        measure = {"warmup": int(row["warmup"]), "iters": int(row["iters"])}
        measure |= {"tol": float(row["tol"]), "rounds": r}
        hw = {"name": name, "device": dev, "backend": row["backend"]}
        out.append({"measure": measure, "hardware": hw, "processes": n})
    return out


def rehash(row: dict, system_params: dict) -> tuple[str, str]:
    """(status, hash): "migrated" with the new hash, "done" (already new), "retired" (a
    retired variant: old hash kept) or "unmatched" (old hash not rebuilt: kept)."""
    system = row["system"]
    if system == "overlap":
        before = old_params(row, OLD_OVERLAP, OLD_OPTIONAL)
        now = {k: before[k] for k in system_params["overlap"]}
    elif system in system_params:
        before = now = old_params(row, system_params[system], {})
    else:
        return "unmatched", row["cell_hash"]
    seeds = {0} | {int(s) for s in re.findall(r"(?<![.\w])seed=([0-9]+)", str(row["command"]))}
    for seed, run in itertools.product(sorted(seeds), runs_of(row)):
        for old_cell, new_cell in zip(cells_of(row, seed, before), cells_of(row, seed, now)):
            if new_hash(new_cell, run) == row["cell_hash"]:
                return "done", row["cell_hash"]
            if old_hash(old_cell, run) == row["cell_hash"]:
                if system == "overlap" and any(RETIRED[k](before[k]) for k in RETIRED):
                    return "retired", row["cell_hash"]
                return "migrated", new_hash(new_cell, run)
    return "unmatched", row["cell_hash"]


def migrate(path: Path) -> dict[str, int]:
    """Re-hash one table in place; the count of rows per status."""
    df = pd.read_parquet(path)
    need = {"cell_hash", "system", "experiment", "hardware", "warmup", "iters", "tol"}
    if not need <= set(df.columns):
        print(f"{path}: no harness cell hashes, left as it is")
        return {}
    system_params = {name: info.load().PARAMS for name, info in registry().items()}
    results = [rehash(r, system_params) for r in df.to_dict("records")]
    counts = pd.Series([s for s, _ in results]).value_counts().to_dict()
    if counts.get("migrated"):
        df["cell_hash"] = [h for _, h in results]
        df.to_parquet(path, index=False)
    print(f"{path}: {len(df)} rows: {counts}")
    return counts


if __name__ == "__main__":
    paths = [Path(p) for p in sys.argv[1:]] or sorted(
        (ROOT / "results/reference").rglob("*.parquet")
    )
    for p in paths:
        migrate(p)
