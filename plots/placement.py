"""Where the consumer runs (own SMs, the paper's, or shared with the producer): the overlapped
step / compute alone on ALL SMs (compute_ms) against experts per rank, one panel per (N,
routing), one line per placement ("own:16", "shared:132"). Lower is better; 1.0 is the compute
bound, the dashed line the 1.05x target (there the combine alone is shorter than the compute)."""

from __future__ import annotations

from pathlib import Path

from plots.common import load, main, need, panel_grid, placements, save, transport_note


def plot(table: str | Path, out_dir: str | Path, name: str) -> list[Path]:
    o = need(placements(load(table, status=None)), table, "ok overlap rows")
    o["x_compute"] = o["latency_ms"] / o["compute_ms"]
    title = f"The overlapped step per consumer placement (consumer:cCTA)\n{transport_note(o)}"
    what = "step / compute on all SMs (lower is better)"
    fig = panel_grid(o, "placement", "x_compute", what, title, hlines=(1.0, 1.05))
    return save(fig, out_dir, name)


if __name__ == "__main__":
    main(plot, "results/operator_consumer_loopback.parquet", "placement")
