"""Regenerate every figure from results/*.parquet and results/reference/**/*.parquet.

Each table's file name (its experiment) picks the figure script in FIGURES; the figure is named
after the table's path so reference and local tables never overwrite each other.
"""

from __future__ import annotations

import importlib
from pathlib import Path

from plots.common import FIG_DIR

#: experiment (table stem) -> plot module with plot(table, out_dir, name)
FIGURES: dict[str, str] = {
    "smoke": "plots.latency_vs_experts",
    "baselines_smoke": "plots.latency_vs_experts",
    "operator": "plots.latency_vs_experts",
    "padding": "plots.padding",
    "overlap_ccta": "plots.ccta_sweep",
    "bandwidth": "plots.bandwidth",
    "multigpu_smoke": "plots.latency_vs_experts",
    "overlap_sweep": "plots.speedup_vs_serial",
}


def main() -> None:
    tables = sorted(Path("results").glob("*.parquet")) + sorted(
        Path("results/reference").rglob("*.parquet")
    )
    for table in tables:
        module = FIGURES.get(table.stem)
        if module is None:
            print(f"[figures] no figure for {table}")
            continue
        name = "_".join(table.with_suffix("").parts[1:])
        try:
            paths = importlib.import_module(module).plot(table, FIG_DIR, name)
            print(f"[figures] {table} -> {', '.join(map(str, paths))}")
        except (ValueError, ModuleNotFoundError) as exc:
            print(f"[figures] {table}: skipped ({exc})")


if __name__ == "__main__":
    main()
