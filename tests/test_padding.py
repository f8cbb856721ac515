"""Padding study: the exact count equals the plan's padding; a tiny end-to-end run and figure."""

from pathlib import Path

import pandas as pd
import pytest
import torch

from experiments.padding import counts_of, padding_metrics
from harness.layout import counts_matrix
from harness.routing import owner_expert_counts
from harness.workload import WorkloadSpec
from plots.padding import plot
from systems.overlap.plan import padding_rows, row_tiles
from tests.inprocess import launch
from tests.overlap_testing import plans_for_spec


@pytest.mark.parametrize("routing", ["balanced", "moderate_skew", "stress_skew"])
@pytest.mark.parametrize(
    "W,E,T,tm", [(1, 3, 50, 16), (2, 4, 300, 64), (3, 2, 100, 16), (5, 7, 90, 8)]
)
def test_exact_count_equals_the_plans_padding(routing, W, E, T, tm):
    spec = WorkloadSpec(
        tokens_per_rank=T,
        hidden=4,
        out=4,
        experts_per_rank=E,
        top_k=2,
        world_size=W,
        routing=routing,
    )
    C, _ = counts_of(spec)
    assert torch.equal(C.view(W, W, E).sum(2), counts_matrix(spec))
    pad = padding_rows(C, E, tm)
    plans, _ = plans_for_spec(spec, tile_m=tm, mgb=1)
    assert pad.tolist() == [p.n_padded - p.n_rows for p in plans]
    m = padding_metrics(C, E, tm)
    assert m["pad_rows_total"] == sum(p.n_padded - p.n_rows for p in plans)
    assert m["gemm_rows_total"] == sum(p.n_padded for p in plans)
    assert m["pad_rows_max"] <= m["bound_expert_rows"]
    assert 0 <= m["pad_share"] < 1
    for layout in ("aligned", "compact"):
        bands = [p.n_bands for p in plans_for_spec(spec, tile_m=tm, mgb=1, layout=layout)[0]]
        assert m[f"tiles_{layout}_total"] == sum(bands) and m[f"tiles_{layout}_max"] == max(bands)
    assert m["tiles_compact_total"] <= m["tiles_aligned_total"]


def test_row_tiles_hand_example():
    # W=2, E=1, tile_m=4; rank 0 holds 1 local row and 2 from rank 1: aligned tiles them in 2
    # bands, compact in 1 (the local row fills the remote band's padding)
    C = torch.tensor([[1, 0], [2, 0]])
    assert [row_tiles(C, 1, 4, lay)[0].item() for lay in ("aligned", "compact")] == [2, 1]
    with pytest.raises(ValueError, match="layout must be one of"):
        row_tiles(C, 1, 4, "dense")


def test_padding_rows_hand_example():
    # W=2, E=1, tile_m=4: rank 0 gets 5 rows from rank 1 (pad 3), rank 1 gets 2 from rank 0 (pad 2)
    ids = torch.tensor([[[1], [1], [0]], [[0]] * 3])  # [W=2, T=3, k=1] -> 2 rows 0->1, 1 row 0->0
    C = owner_expert_counts(ids, 1)
    assert C.tolist() == [[1, 2], [3, 0]]
    assert padding_rows(C, 1, 4).tolist() == [1, 2]


def test_padding_experiment_tiny_run_and_figure(tmp_path):
    table = tmp_path / "padding.parquet"
    code = launch(
        "experiment=padding",
        "progress=false",
        f"table={table}",
        "experiment.grid.world_size=[2,4]",
        "experiment.grid.tokens_per_rank=[64]",
        "experiment.grid.experts_per_rank=[2,16]",
        "experiment.systems.overlap.sweep.tile_m=[16,128]",
    )
    assert code == 0
    df = pd.read_parquet(table)
    assert len(df) == 2 * 2 * 3 * 2 and set(df["status"]) == {"ok"}
    assert {"m_pad_share", "m_pad_rows_max", "m_bound_paper_rows", "m_bound_expert_rows"} <= set(df)
    assert ((df["m_pad_rows_max"] <= df["m_bound_expert_rows"]) & (df["m_pad_share"] < 1)).all()
    assert (df["world_size"].isin([2, 4])).all() and (df["gpu_count"] == 0).all()
    assert sorted(df["p_tile_m"].unique()) == [16, 128]
    paths = plot(table, tmp_path / "fig", "padding")
    assert all(p.exists() and p.stat().st_size > 0 for p in paths)


def test_a_knob_the_padding_study_does_not_use_is_an_error():
    """Only tile_m shapes the padding; another overlap knob would be ignored without a word."""
    from hydra import compose, initialize_config_dir

    from experiments import padding
    from harness.config import register_configs

    register_configs()
    conf = str(Path(__file__).resolve().parents[1] / "conf")
    for override, message in (
        ("+experiment.systems.overlap.params.consumer=shared", "consumer='shared' would be"),
        ("experiment.systems.overlap.sweep.tile_m=[1.5]", "padding: tile_m must be an integer"),
    ):
        with initialize_config_dir(conf, version_base="1.3"):
            cfg = compose("config", overrides=["experiment=padding", override])
        with pytest.raises(ValueError, match=message):
            padding.validate(cfg, padding.cells(cfg, 1), 0)
