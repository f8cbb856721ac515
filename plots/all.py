"""Regenerate every figure from results/*.parquet and results/reference/**/*.parquet.

Each table's file name (its experiment) picks the figure script in FIGURES; the figure is named
after the table's path so reference and local tables never overwrite each other.

A figure that cannot be redrawn never stays behind looking current: its old files are removed.
A table that cannot be read whole (a damaged footer or a damaged page in the middle), or a figure
script that crashes, is an error: every other figure is still drawn, then the command exits 1
naming the tables.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from pathlib import Path

import pandas as pd

from plots.common import FIG_DIR

#: figure script -> the experiments (table stems) it draws
_DRAWS = {
    "latency_vs_experts": "smoke baselines_smoke multigpu_smoke layer_smoke operator",
    "speedup_vs_serial": "overlap_sweep", "variants": "operator_order operator_layouts_loopback",
    "placement": "operator_consumer_loopback", "padding": "padding", "ccta_sweep": "overlap_ccta",
    "bandwidth": "bandwidth", "layer": "layer", "experts": "experts", "models": "models",
    "ccta_mgb": "ccta_mgb ccta_auto", "correctness": "correctness correctness_loopback",
    "producer": "producer",
}  # fmt: skip
#: experiment (table stem) -> plot module with plot(table, out_dir, name)
FIGURES = {stem: f"plots.{m}" for m, stems in _DRAWS.items() for stem in stems.split()}


def _drop_old(out: Path, name: str) -> list[Path]:
    old = [p for p in (out / f"{name}.png", out / f"{name}.pdf") if p.exists()]
    for p in old:
        p.unlink()
    return old


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--results", default="results", help="folder of the tables")
    ap.add_argument("--out", default=str(FIG_DIR), help="folder of the figures")
    args = ap.parse_args(argv)
    results, out = Path(args.results), Path(args.out)
    tables = sorted(results.glob("*.parquet")) + sorted((results / "reference").rglob("*.parquet"))
    failed = []
    for table in tables:
        module = FIGURES.get(table.stem)
        if module is None:
            print(f"[figures] no figure for {table}")
            continue
        name = "_".join(table.with_suffix("").relative_to(results).parts)
        try:
            pd.read_parquet(table)  # every page: a footer that reads is not a whole table
        except Exception as exc:  # noqa: BLE001 - any reader error: a damaged table
            why = (str(exc).strip().splitlines() or [""])[0][:160]
            old = _drop_old(out, name)
            gone = f"; removed the old {', '.join(p.name for p in old)}" if old else ""
            print(f"[figures] error: cannot read {table} ({type(exc).__name__}: {why}){gone}")
            failed.append(table)
            continue
        try:
            paths = importlib.import_module(module).plot(table, out, name)
            print(f"[figures] {table} -> {', '.join(map(str, paths))}")
        except (ValueError, ModuleNotFoundError) as exc:
            _drop_old(out, name)
            print(f"[figures] {table}: skipped, no figure ({exc})")
        except Exception as exc:  # noqa: BLE001 - one broken figure must not hide the others
            _drop_old(out, name)
            print(f"[figures] error: {table}: {type(exc).__name__}: {exc}")
            failed.append(table)
    if failed:
        why = f"error: {len(failed)} figure(s) could not be redrawn (their old files were removed)"
        print(f"{why}: {', '.join(map(str, failed))}", file=sys.stderr)
        sys.exit(1)


if __name__ == "__main__":
    main()
