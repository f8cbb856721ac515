"""Regenerate every figure from results/*.parquet and results/reference/**/*.parquet.

A table's stem (its experiment) picks the figure script (FIGURES), figure_base its name. A
figure that cannot be redrawn has its old files removed. An unreadable table, a folder named like
a table, or a crashing script is an error: every other figure is still drawn, then the command
exits 1 naming the tables."""

from __future__ import annotations

import argparse
import importlib
import sys
from pathlib import Path

import pandas as pd

from plots.common import FIG_DIR, drop_figures, machine

#: figure script -> the experiments (table stems) it draws
_DRAWS = {
    "latency_vs_experts": "smoke baselines_smoke multigpu_smoke layer_smoke operator",
    "speedup_vs_serial": "overlap_sweep", "variants": "operator_order operator_layouts_loopback",
    "placement": "operator_consumer_loopback", "padding": "padding", "ccta_sweep": "overlap_ccta",
    "bandwidth": "bandwidth", "layer": "layer", "experts": "experts", "models": "models",
    "ccta_mgb": "ccta_mgb ccta_auto", "correctness": "correctness correctness_loopback",
    "producer": "producer", "functional": "overlap_functional overlap_functional_ranks",
    "layer_w1": "layer_w1",
    "layer_loopback": "layer_loopback", "layer_train": "layer_train",
}  # fmt: skip
#: experiment (table stem) -> plot module with plot(table, out_dir, name)
FIGURES = {stem: f"plots.{m}" for m, stems in _DRAWS.items() for stem in stems.split()}
#: figure script -> what its figure shows (results/REPORT.md's figure index)
SHOWS = {
    "latency_vs_experts": "latency per system and expert count; lower is better",
    "speedup_vs_serial": "the best overlap cell against serial, per routing",
    "variants": "the overlap system's variants (layout, order) against serial",
    "placement": "consumer placement: step time against the compute bound",
    "padding": "padding rows of the remote-aligned layout against the paper's bounds",
    "ccta_sweep": "latency per cCTA with the compute and comm bounds (loopback)",
    "bandwidth": "Fig 3a: the consumer's GB/s against the segment size",
    "layer": "the whole layer: latency (_latency) and speedup against serial (_speedup)",
    "experts": "Fig 5: layer speedup and overlap ratio against experts per rank",
    "models": "Fig 4: the models end to end and per MoE layer",
    "ccta_mgb": "Figs 6-8: speedup per cCTA and mgb, and the auto pick",
    "correctness": "correctness: error heatmaps and histograms against the tolerance",
    "producer": "the producer against torch._grouped_mm and cuBLAS",
    "functional": "the overlap kernels in Triton's CPU interpreter: error against the tolerance "
    "per cell (functional, not a timing)",
    "layer_w1": "the layer at W=1: each system vs serial (_systems), eager vs graph replay "
    "(_graph)",
    "layer_loopback": "the layer, one GPU playing W ranks: errors, receive memory, latency",
    "layer_train": "one training step (forward + backward) per system, W=1 and loopback",
}
#: figure script -> the files it draws per table (<name><part>); others draw one, <name>
PARTS = {"layer": ("_latency", "_speedup"), "layer_w1": ("_systems", "_graph")}


def _parts(table: Path) -> tuple[str, ...]:
    return PARTS.get(FIGURES.get(table.stem, "").removeprefix("plots."), ("",))


def figure_base(table: Path, results: Path, df: pd.DataFrame | None = None) -> str:
    """A table's figure name: `reference_<machine>_<experiment>` under results/reference/, else
    `<machine>_<experiment>` (plots.common.machine of df)."""
    rel = table.with_suffix("").relative_to(results).parts
    if rel[0] == "reference":
        return "_".join(rel)
    return f"{machine(df if df is not None else pd.DataFrame())}_{table.stem}"


def figure_names(table: Path, results: Path, df: pd.DataFrame | None = None) -> list[str]:
    """The names (no suffix) of a table's figure files: figure_base, one per part (PARTS)."""
    return [figure_base(table, results, df) + part for part in _parts(table)]


def _drop_unread(out: Path, table: Path, results: Path) -> str:
    """Remove the old figures of a table that cannot be read; what was removed, as a clause. A
    local table's may be `<m>_<experiment>` for each machine m found in `out`."""
    names = figure_names(table, results)
    if table.parent == results:
        machines = {p.stem.split("_", 1)[0] for p in out.glob(f"*_{table.stem}*.png")}
        bases = [f"{m}_{table.stem}" for m in sorted(machines - {"reference"})]
        names = [b + part for b in bases for part in _parts(table)]
    old = drop_figures(out, names)
    return f"; removed the old {', '.join(p.name for p in old)}" if old else ""


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
        if not table.is_file():  # a folder: pandas would read it as a data set; the harness
            gone = _drop_unread(out, table, results)  # refuses it (harness.records.read_table)
            print(f"[figures] error: {table} is a folder, not a table{gone}")
            failed.append(table)
            continue
        try:
            df = pd.read_parquet(table)  # every page: a footer that reads is not a whole table
        except Exception as exc:  # noqa: BLE001 - any reader error: a damaged table
            why = (str(exc).strip().splitlines() or [""])[0][:160]
            gone = _drop_unread(out, table, results)
            print(f"[figures] error: cannot read {table} ({type(exc).__name__}: {why}){gone}")
            failed.append(table)
            continue
        base, names = figure_base(table, results, df), figure_names(table, results, df)
        try:
            paths = importlib.import_module(module).plot(table, out, base)
            print(f"[figures] {table} -> {', '.join(map(str, paths))}")
        except (ValueError, ModuleNotFoundError) as exc:
            drop_figures(out, names)
            print(f"[figures] {table}: skipped, no figure ({exc})")
        except Exception as exc:  # noqa: BLE001 - one broken figure must not hide the others
            drop_figures(out, names)
            print(f"[figures] error: {table}: {type(exc).__name__}: {exc}")
            failed.append(table)
    if failed:
        why = f"error: {len(failed)} figure(s) could not be redrawn (their old files were removed)"
        print(f"{why}: {', '.join(map(str, failed))}", file=sys.stderr)
        sys.exit(1)


if __name__ == "__main__":
    main()
