"""The producer kernel experiment (experiments/producer.py): its grid, its input checks, the
expert problem it hands torch._grouped_mm, and the skipped row off a GPU."""

from pathlib import Path

import pytest
import torch
from hydra import compose, initialize_config_dir
from omegaconf import open_dict

from experiments import producer
from harness.config import register_configs
from harness.workload import WorkloadSpec

ROOT = Path(__file__).resolve().parents[1]


def _cfg(*overrides):
    register_configs()
    with initialize_config_dir(str(ROOT / "conf"), version_base="1.3"):
        return compose("config", overrides=["experiment=producer", *overrides])


def test_grid_has_the_references_and_one_producer_per_tile_layout_and_order():
    cfg = _cfg()
    cells = producer.cells(cfg, 1)
    per_workload = 3 + 2 * 2 * 2  # references + tile_m x layout x order (flags on)
    assert len(cells) == 2 * 5 * 3 * per_workload  # N x E x routings
    refs = {"torch_grouped_mm", "cublas", "cublas_bmm"}
    assert {c["system"] for c in cells} == refs | {"overlap"}
    knobs = {tuple(sorted(c["params"].items())) for c in cells if c["system"] == "overlap"}
    assert len(knobs) == 8 and all(dict(k)["flags"] is True for k in knobs)
    assert {k for knob in knobs for k, _ in knob} == {"tile_m", "layout", "order", "flags"}
    assert len({c["cell_hash"] for c in cells}) == len(cells)
    producer.validate(cfg, cells, 132)


def test_a_ccta_sweep_does_not_multiply_the_producer_cells():
    cfg = _cfg("+experiment.systems.overlap.params.ccta=8")
    base = producer.cells(_cfg(), 1)
    assert len(producer.cells(cfg, 1)) == len(base)
    cfg = _cfg("experiment.options.flags=[true,false]")
    cells = producer.cells(cfg, 1)
    assert len(cells) == len(base) + 2 * 5 * 3 * 8
    producer.validate(cfg, cells, 132)


def test_bad_input_is_one_line_before_any_gpu_work():
    cfg = _cfg()
    cells = producer.cells(cfg, 1)
    bad = [dict(cells[-1], params={**cells[-1]["params"], "tile_m": 32})]
    with pytest.raises(ValueError, match="tile_m must be 64 or 128"):
        producer.validate(cfg, bad, 132)
    with pytest.raises(ValueError, match="dtype must be float16 or bfloat16"):
        producer.validate(cfg, [dict(cells[0], dtype="float32")], 132)
    with open_dict(cfg):
        cfg.experiment.options = {"flag": [True]}
    with pytest.raises(ValueError, match="unknown option"):
        producer.validate(cfg, cells, 132)
    for override, message in (
        ("experiment.systems.overlap.sweep.layout=[dense]", "layout must be one of aligned"),
        ("experiment.grid.hidden=[100]", "K and N must be multiples of 8"),
        ("experiment.options.flags=[maybe]", "options.flags holds true / false, got ['maybe']"),
        ("experiment.options.flags=[]", "options.flags must be a non-empty list, got []"),
        ("experiment.options.flags=true", "options.flags must be a non-empty list, got True"),
    ):
        with pytest.raises(ValueError) as exc:
            cfg = _cfg(override)
            producer.validate(cfg, producer.cells(cfg, 1), 132)
        assert message in str(exc.value), override


@pytest.mark.parametrize("layout", ["aligned", "compact"])
def test_valid_rows_are_grouped_by_expert_as_grouped_mm_reads_them(layout):
    spec = WorkloadSpec(256, 32, 16, 4, 2, 2, "stress_skew", dtype="float32", seed=3)
    pb = producer.problem(spec, 64, layout, torch.device("cpu"))
    ref = pb.ref_y()[pb.valid]
    starts = [0, *pb.offsets.tolist()[:-1]]
    assert pb.offsets.tolist()[-1] == pb.x_valid.shape[0] == sum(pb.per_expert)
    assert pb.plan.n_padded > pb.x_valid.shape[0] or layout != "aligned"
    assert pb.plan.n_padded == pb.x_valid.shape[0] or layout != "compact"
    for e, (a, b) in enumerate(zip(starts, pb.offsets.tolist())):
        got = pb.x_valid[a:b].float() @ pb.w[e].float()
        torch.testing.assert_close(got, ref[a:b], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("order", ["remote_first", "expert"])
def test_an_overlap_cell_builds_its_plan_for_its_order_and_the_tables_groups(order):
    spec = WorkloadSpec(64, 32, 4096, 4, 2, 2, "stress_skew", dtype="bfloat16", seed=3)
    params = {"tile_m": 128, "layout": "aligned", "order": order, "flags": True}
    cell = {"system": "overlap", "params": params}
    pb = producer._cell_problem(cell, spec, torch.device("cpu"))
    plan = pb.plan
    assert pb.cfg.expert_groups and plan.group_cap == pb.cfg.group_cap == pb.cfg.group_m
    assert plan.order == order and (plan.visit is not None) == (order == "expert")
    assert plan.groups is not None and plan.groups.numel() == plan.max_bands
    # the float32 reference by expert equals the one by band
    ref = pb.ref_y()
    rows, n, e = (t.tolist() for t in (plan.band_row, plan.band_rows, plan.band_expert))
    for r0, k, ex in zip(rows, n, e):
        got = pb.x[r0 : r0 + k].float() @ pb.w[ex].float()
        torch.testing.assert_close(ref[r0 : r0 + k], got)
    assert bool((ref[~pb.valid] == 0).all())
    reference = producer._cell_problem({"system": "cublas", "params": {}}, spec, pb.x.device)
    assert reference.plan.visit is None and reference.plan.groups is None


@pytest.mark.parametrize("tokens", [256, 1])
def test_the_batched_reference_has_the_weights_and_about_the_rows_of_the_grouped_gemm(tokens):
    from harness.system import RunContext

    spec = WorkloadSpec(tokens, 32, 16, 4, 2, 2, "stress_skew", dtype="float32", seed=3)
    pb = producer.problem(spec, 64, "compact", torch.device("cpu"))
    ctx = RunContext(rank=0, world_size=1, device=torch.device("cpu"), group=None, backend="gloo")
    cell = {"system": "cublas_bmm", "params": {}}
    go, out, ref, m = producer._kernel(ctx, cell, pb)
    r, e = pb.x_valid.shape[0], spec.experts_per_rank
    m_rows = max(1, r // e)
    assert out.shape == (e, m_rows, spec.out) and m["gemm_rows"] == e * m_rows
    assert r - e < e * m_rows <= max(r, e)  # the same FLOPs, less up to E - 1 rows
    torch.testing.assert_close(out.float(), ref, rtol=1e-5, atol=1e-5)
    if r >= e:  # expert e multiplies the valid rows [e m, (e + 1) m) by its own weights
        last = pb.x_valid[(e - 1) * m_rows : e * m_rows].float() @ pb.w[e - 1].float()
        torch.testing.assert_close(out[e - 1].float(), last, rtol=1e-5, atol=1e-5)
    go()


def test_off_a_gpu_every_cell_is_skipped_with_the_reason():
    from harness.system import RunContext

    cfg = _cfg()
    cell = producer.cells(cfg, 1)[0]
    ctx = RunContext(rank=0, world_size=1, device=torch.device("cpu"), group=None, backend="gloo")
    (row,) = producer.run_cell(ctx, cfg, cell)
    assert row.status == "skipped" and "CUDA GPU" in row.reason


def test_the_plot_ratios_pair_each_producer_with_its_references(tmp_path):
    import pandas as pd

    from plots.producer import plot, ratios

    w = dict(world_size=2, tokens_per_rank=8, hidden=4, out=4, experts_per_rank=2)
    rows = [
        {**w, "routing": "balanced", "system": "torch_grouped_mm", "latency_ms": 1.2},
        {**w, "routing": "balanced", "system": "cublas", "latency_ms": 0.9},
        {**w, "routing": "balanced", "system": "cublas_bmm", "latency_ms": 1.1},
        {
            **w,
            "routing": "balanced",
            "system": "overlap",
            "latency_ms": 1.0,
            "p_tile_m": 128,
            "p_layout": "aligned",
            "p_flags": True,
        },  # fmt: skip
    ]
    df = pd.DataFrame([{**r, "status": "ok"} for r in rows])
    (r,) = ratios(df).itertuples()
    assert r.variant == "tile_m 128, aligned"
    direct = df.assign(p_local=[None, None, None, "direct"])  # a retired knob labels nothing
    assert ratios(direct)["variant"].tolist() == ["tile_m 128, aligned"]
    assert r.vs_grouped_mm == pytest.approx(1.2) and r.vs_cublas == pytest.approx(0.9)
    assert r.vs_bmm == pytest.approx(1.1)
    older = ratios(df[df["system"] != "cublas_bmm"])  # a table from before the bmm reference
    assert older["vs_bmm"].isna().all() and older["vs_grouped_mm"].tolist() == [pytest.approx(1.2)]
    df.to_parquet(tmp_path / "producer.parquet")
    assert all(p.exists() for p in plot(tmp_path / "producer.parquet", tmp_path, "p"))
