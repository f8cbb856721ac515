"""The layer_w1 figure draws a Megatron system with both routes (capacity dropless: eager;
padded: CUDA graph) as one line, its faster route per cell, and says so in the label."""

from pathlib import Path

import pandas as pd

from plots.layer_w1 import CELL, systems

W1 = Path(__file__).resolve().parents[1] / "results/reference/h200/layer_w1.parquet"


def test_megatron_is_one_line_at_its_faster_route_per_cell():
    df = pd.read_parquet(W1)
    s = systems(df)
    mc = s[s["system"] == "megatron_cutlass"]
    assert set(mc["line"]) == {
        "Megatron-core + CUTLASS GroupedGEMM [faster of padded, CUDA graph / dropless, eager]"
    }
    ok = df[(df["status"] == "ok") & (df["system"] == "megatron_cutlass")]
    graph = ok[ok["graph"]]  # padded rows: captured
    eager = ok[~ok["graph"] & (ok["p_capacity"] == "dropless")]
    want = pd.concat([graph, eager]).groupby(CELL)["latency_ms"].min()
    got = mc.set_index(CELL)["latency_ms"]
    assert len(got) == len(want) == 8
    assert (got.sort_index() <= want.sort_index() + 1e-9).all()
    assert (got.sort_index() >= want.sort_index() - 1e-9).all()
