"""The CUTLASS producer's host glue on any machine: the errors it gives before any GPU work,
the flag increments, the experiment's config names. Its kernel runs in
tests/test_cutlass_producer_gpu.py."""

from __future__ import annotations

import pytest
import torch

from systems.overlap import cutlass_producer as cp


def test_band_increment_counts_256_column_tiles():
    assert cp.band_increment(8192) == 32
    assert cp.band_increment(4096) == 16
    assert cp.band_increment(100) == 1
    assert cp.band_increment(257) == 2


def test_bad_cluster_or_grouping_is_one_line_error():
    with pytest.raises(ValueError, match="cluster"):
        cp.CutlassProducer((2, 2))
    with pytest.raises(ValueError, match="grouping"):
        cp.CutlassProducer((1, 2), "token")


def test_missing_library_names_the_build_step(monkeypatch, tmp_path):
    monkeypatch.setenv("MOE_CUTLASS_LIB", str(tmp_path / "nope.so"))
    monkeypatch.setattr(cp, "_LIB", None)
    with pytest.raises(cp.CutlassUnavailable, match="make cutlass"):
        cp.load()


def test_shape_and_dtype_errors_before_launch():
    # the operand contract (systems/overlap/operands.py), then the CUTLASS kernel's own limits
    prod = cp.CutlassProducer()
    x = torch.zeros(128, 64, dtype=torch.bfloat16)
    w = torch.zeros(2, 64, 256, dtype=torch.bfloat16)
    ready = torch.zeros(1, dtype=torch.int32)
    with pytest.raises(ValueError, match="shapes"):
        prod.launch(x, w, torch.zeros(128, 128, dtype=torch.bfloat16), None, ready, num_programs=1)
    with pytest.raises(ValueError, match="bf16/fp16"):
        prod.launch(x.float(), w.float(), torch.zeros(128, 256), None, ready, num_programs=1)
    with pytest.raises(ValueError, match="multiples of 8"):
        x3 = torch.zeros(128, 60, dtype=torch.bfloat16)
        w3 = torch.zeros(2, 60, 256, dtype=torch.bfloat16)
        y3 = torch.zeros(128, 256, dtype=torch.bfloat16)
        prod.launch(x3, w3, y3, None, ready, num_programs=1)


def test_nvcc_command_targets_sm90a_with_the_wheel_headers():
    pytest.importorskip("cutlass_library")
    cmd = cp.nvcc_command(cp.DEFAULT_LIB)
    assert "-gencode=arch=compute_90a,code=sm_90a" in cmd and str(cp.SOURCE) in cmd
    assert any(c.startswith("-I") and c.endswith("include") for c in cmd)


def test_producer_experiment_accepts_the_cutlass_configs():
    from experiments import producer

    assert set(producer.CUTLASS_CONFIGS) == {"cutlass", "cutlass_expert", "cutlass_expert_c12"}
    for grouping, cluster in producer.CUTLASS_CONFIGS.values():
        assert grouping in cp.GROUPINGS and cluster in cp.CLUSTERS


def test_both_producers_refuse_the_same_operands_in_one_line():
    from systems.overlap.operands import check_producer_operands

    x = torch.zeros(128, 64, dtype=torch.bfloat16)
    w = torch.zeros(2, 64, 256, dtype=torch.bfloat16)
    y = torch.zeros(128, 256, dtype=torch.bfloat16)
    ready = torch.zeros(1, dtype=torch.int32)
    assert check_producer_operands("p", x, w, y, ready) == (128, 64, 2, 256)
    with pytest.raises(ValueError, match=r"^p operands must be contiguous$"):
        check_producer_operands("p", x.t().contiguous().t(), w, y, ready)
    with pytest.raises(ValueError, match=r"^band_ready must be int32$"):
        check_producer_operands("p", x, w, y, ready.long())
    with pytest.raises(ValueError, match=r"^cutlass producer operands must be contiguous$"):
        cp.CutlassProducer().launch(x, w, y.t().contiguous().t(), None, ready, num_programs=1)
