"""The benchmark scripts run end to end on a small shape anywhere (their numbers come from GPUs)."""

import pandas as pd
import pytest

from benchmarks import scale_bound


def test_scale_bound_writes_its_ratio_row(tmp_path, monkeypatch):
    monkeypatch.setattr("sys.argv", ["scale_bound", "--out", str(tmp_path), "--small"])
    scale_bound.main()
    df = pd.read_parquet(tmp_path / "scale_bound.parquet")
    assert len(df) == 1
    r = df.iloc[0]
    assert r["rel_err"] < 1e-2  # the timed scale is the right one
    assert abs(r["bound_ms"] * r["copy_gbps"] * 1e6 - 3 * 64 * 128 * 2) < 1e-3
    assert r["ratio"] == r["scale_ms"] / r["bound_ms"]
    assert r["timing"] == "host" and r["scale_eager_ms"] > 0 and r["copy_eager_ms"] > 0


def test_consumer_summary_pivots_placements_against_the_first_and_the_compute_bound():
    import pandas as pd

    from benchmarks.consumer_summary import summarize

    base = dict(out=8192, routing="balanced", system="overlap", status="ok", compute_ms=1.0)
    rows = [
        {**base, "experts_per_rank": 4, "p_consumer": None, "p_ccta_used": 16, "latency_ms": 1.2},
        {
            **base,
            "experts_per_rank": 4,
            "p_consumer": "shared",
            "p_ccta_used": 32,
            "latency_ms": 0.9,
        },
        {
            **base,
            "experts_per_rank": 4,
            "p_consumer": "shared",
            "p_ccta_used": 64,
            "latency_ms": 2.0,
            "status": "error",
        },
    ]
    text = summarize(pd.DataFrame(rows))
    assert "own:16" in text and "shared:32" in text and "shared:64" not in text
    slept = summarize(pd.DataFrame([*rows, {**rows[1], "p_backoff_ns": 200}]))
    assert "shared:32:b200" in slept
    # an auto cCTA is one placement, whatever each cell picked
    auto = [
        {**rows[0], "p_ccta": "auto", "p_ccta_used": c, "experts_per_rank": e}
        for e, c in ((4, 8), (8, 12))
    ]
    assert "own:auto" in summarize(pd.DataFrame(auto)) and "own:8" not in summarize(
        pd.DataFrame(auto)
    )
    assert "0.75" in text  # 0.9 / 1.2
    per = text.split("per placement")[1]
    assert "shared:32" in per and per.strip().splitlines()[-1].split()[-1] == "1"


def test_table_summary_reports_the_host_share_of_a_step_where_rows_have_it():
    import pandas as pd

    from benchmarks.table_summary import summarize

    base = dict(status="ok", reason="", cell_hash="h", tokens_per_rank=8, out=8, routing="b")
    rows = [
        dict(base, system="overlap", experts_per_rank=4, latency_ms=0.5, m_host_ms=0.6),
        dict(base, system="overlap", experts_per_rank=8, latency_ms=1.0, m_host_ms=0.2),
        dict(base, system="serial", experts_per_rank=4, latency_ms=1.0, m_host_ms=float("nan")),
    ]
    text = summarize(pd.DataFrame(rows))
    assert "host time / step (median, max): overlap 0.70, 1.20" in text
    assert "serial" not in text.splitlines()[-1]  # no host time, no entry
    assert "host time" not in summarize(pd.DataFrame(rows).drop(columns="m_host_ms"))


def test_table_summary_reports_the_host_syncs_per_step_where_rows_have_them():
    import pandas as pd

    from benchmarks.table_summary import summarize

    base = dict(status="ok", reason="", cell_hash="h", tokens_per_rank=8, out=8, routing="b")
    rows = [
        dict(base, system="overlap", experts_per_rank=4, latency_ms=0.5, m_host_syncs=0.0),
        dict(base, system="serial", experts_per_rank=4, latency_ms=1.0, m_host_syncs=1.0),
        dict(base, system="serial", experts_per_rank=8, latency_ms=1.0, m_host_syncs=2.0),
        dict(base, system="tutel", experts_per_rank=4, latency_ms=1.0, m_host_syncs=float("nan")),
    ]
    last = summarize(pd.DataFrame(rows)).splitlines()[-1]
    assert last == "host syncs / step (min, max): overlap 0, 0, serial 1, 2"
    assert "host syncs" not in summarize(pd.DataFrame(rows).drop(columns="m_host_syncs"))


def test_table_summary_by_pivots_the_variants_and_their_speedup_over_serial():
    import pandas as pd

    from benchmarks.table_summary import variants

    base = dict(status="ok", tokens_per_rank=8, out=8, routing="b")
    rows = [
        dict(base, system="serial", experts_per_rank=4, latency_ms=1.0),
        dict(base, system="overlap", experts_per_rank=4, latency_ms=0.5, p_layout="compact"),
        dict(base, system="overlap", experts_per_rank=4, latency_ms=0.8, p_layout=None),
        dict(base, system="overlap", experts_per_rank=8, latency_ms=0.4, p_layout="compact"),
        dict(base, system="serial", experts_per_rank=8, latency_ms=9.0, status="fail"),
    ]
    got = variants(pd.DataFrame(rows), ["p_layout", "p_consumer"])  # no p_consumer column
    assert list(got.index) == [4, 8]  # the one grid key that varies
    assert got.loc[4, "overlap/compact/"] == 0.5 and got.loc[4, "overlap//"] == 0.8
    assert got.loc[4, "x_overlap/compact/"] == 2.0 and got.loc[4, "x_overlap//"] == 1.25
    assert pd.isna(got.loc[8, "serial//"]) and pd.isna(got.loc[8, "x_overlap/compact/"])
    no_serial = variants(pd.DataFrame(rows[1:4]), ["p_layout"])
    assert not [c for c in no_serial.columns if c.startswith("x_")]


def test_device_idle_splits_steps_at_the_markers_and_sums_the_gaps_before_each_kernel():
    """benchmarks/profiling.py: steps start at the marker kernel, the next marker closes a step
    (the host's time between steps is idle before "(next step)"), overlapping kernels of two
    streams count once as busy."""
    from benchmarks.profiling import busy_union, idle_gaps, split_steps

    assert busy_union([(0, 10), (5, 12), (20, 25), (21, 22)]) == 17
    mark = "at::cuda::(anonymous namespace)::spin_kernel(long)"
    ks = [(0, 1, mark), (2, 10, "a"), (5, 12, "b"), (20, 25, "c"), (26, 27, mark)]
    ks += [(30, 31, "d"), (40, 41, mark), (50, 51, "after the last marker")]
    steps = split_steps(ks)
    assert [[k[2] for k in st] for st in steps] == [
        [mark, "a", "b", "c", "(next step)"],
        [mark, "d", "(next step)"],
    ]
    one = idle_gaps(steps[0])
    assert (one["span_us"], one["busy_us"], one["idle_us"]) == (27, 17, 10)
    assert one["gaps"] == {"c": 8, "a": 1, "(next step)": 1}
    assert idle_gaps(steps[1])["gaps"] == {"(next step)": 9, "d": 3}


def test_label_bound_times_each_bound_and_checks_its_labels(tmp_path):
    """benchmarks/label_bound.py in Triton's interpreter on its small grid: a row per mode,
    every one checked (the real rows labelled, -1 past them)."""
    import pytest

    from tests.interpreted import run_interpreted

    pytest.importorskip("triton")
    script = (
        "import sys; from benchmarks import label_bound; "
        f"sys.argv = ['label_bound', '--small', '--out', {str(tmp_path)!r}]; label_bound.main()"
    )
    run_interpreted(script, timeout=300)
    df = pd.read_parquet(tmp_path / "label_bound.parquet")
    assert len(df) == 6 and set(df["mode"]) == {"exact", "most", "bound"}
    assert (df.status == "ok").all()
    r = df[df.world_size == 4].set_index("mode").label_rows
    assert r["exact"] == 32 and r["most"] == 128 and r["bound"] == 64


def test_producer_summary_counts_cells_at_or_above_each_reference():
    from benchmarks.producer_summary import summarize

    w = dict(status="ok", world_size=2, tokens_per_rank=8, hidden=4, out=4, routing="balanced")
    rows = []
    for e, (gmm, bmm) in {4: (1.1, 0.9), 8: (0.8, 0.7)}.items():
        rows += [
            dict(w, experts_per_rank=e, system="torch_grouped_mm", latency_ms=gmm),
            dict(w, experts_per_rank=e, system="cublas", latency_ms=0.5),
            dict(w, experts_per_rank=e, system="cublas_bmm", latency_ms=bmm),
            dict(w, experts_per_rank=e, system="overlap", latency_ms=1.0, p_tile_m=128,
                 p_layout="compact", p_flags=True),
        ]  # fmt: skip
    text = summarize(pd.DataFrame(rows))
    gmm = text.split("time(grouped_mm) / time(producer)")[1].splitlines()[3].split()
    assert gmm[-5:] == ["0.8", "0.95", "1.1", "1", "2"]  # min, median, max, >= 1, cells
    assert "time(bmm) / time(producer)" in text
    rel = text.split("time(cuBLAS) / time(reference) per workload")[1].splitlines()
    assert rel[-1].split()[-2:] == ["0.714", "0.625"]  # E=8: 0.5/0.7 (bmm), 0.5/0.8 (grouped_mm)


def test_ab_table_joins_the_runs_with_their_run_number(tmp_path):
    import pandas as pd

    from benchmarks.ab_table import join_runs

    for name, rev in (("old_r1", "a"), ("new_r1", "b"), ("old_r2", "a"), ("new_r12", "b")):
        pd.DataFrame({"git_rev": [rev], "latency_ms": [1.0]}).to_parquet(
            tmp_path / f"{name}.parquet"
        )
    d = join_runs(tmp_path)
    assert len(d) == 4 and list(d.index) == [0, 1, 2, 3]
    assert sorted(zip(d.git_rev, d.ab_rep)) == [("a", 1), ("a", 2), ("b", 1), ("b", 12)]


def test_step_profile_cuts_a_step_into_parts_and_the_waits_the_compute_does_not_hide():
    """benchmarks/step_profile.py: times from the marker's end, a part's busy time counts its
    overlapping kernels once, the derived waits, the median over steps."""
    from benchmarks.step_profile import derived, median_parts, part_of, step_parts

    assert part_of("ncclDevKernel_AllReduce_Sum_i32_RING_LL") == "handshake"
    assert part_of("ncclDevKernel_SendRecv") == "nccl"
    assert part_of("_producer_kernel") == "producer" and part_of("x" * 80) == "x" * 60
    step = [
        (0.0, 1.0, "at::spin_kernel"),
        (1.0, 11.0, "ncclDevKernel_AllReduce_Sum"),
        (12.0, 112.0, "_producer_kernel"),
        (13.0, 130.0, "_consumer_kernel"),
        (131.0, 132.0, "_wait_signals_kernel"),
        (132.0, 150.0, "_scale_kernel"),
        (160.0, 161.0, "(next step)"),
    ]
    parts = step_parts(step)
    assert parts["handshake"] == {"start_us": 0.0, "end_us": 10.0, "busy_us": 10.0}
    assert parts["step"] == {"start_us": 0.0, "end_us": 149.0, "busy_us": 147.0}
    assert derived(parts) == {"lead_us": 11.0, "tail_us": 18.0, "after_us": 20.0}
    assert derived({k: v for k, v in parts.items() if k != "consumer"}) == {}
    later = step_parts(
        [(s + 5, e + 5, n) if n != "at::spin_kernel" else (s, e, n) for s, e, n in step]
    )
    mid = median_parts([parts, later, parts])
    assert mid["producer"]["start_us"] == 11.0
    assert set(median_parts([parts, step_parts(step[:3])])) == {"handshake", "producer", "step"}


def test_step_profile_rows_carry_the_cell_its_rank_and_provenance():
    from benchmarks.step_profile import cell_rows

    cell = dict(system="overlap", world_size=2, out=8, experts_per_rank=4, routing="balanced")
    cell["params"] = {"mgb": 1, "ccta": 8}
    parts = {
        "producer": {"start_us": 2.0, "end_us": 10.0, "busy_us": 8.0},
        "consumer": {"start_us": 3.0, "end_us": 12.0, "busy_us": 9.0},
        "step": {"start_us": 2.0, "end_us": 15.0, "busy_us": 13.0},
    }
    rows = cell_rows(cell, 1, 2, parts, {"git_rev": "abc"})
    assert len(rows) == 3 and {r["part"] for r in rows} == set(parts)
    r = rows[0]
    assert r["params"] == "ccta=8 mgb=1" and r["rank"] == 1 and r["processes"] == 2
    assert (r["lead_us"], r["tail_us"], r["after_us"], r["git_rev"]) == (2.0, 2.0, 3.0, "abc")


def test_step_profile_says_bad_input_in_one_line_before_any_gpu_work():
    import subprocess
    import sys

    import torch

    cases = [(["--steps", "0"], "error: --steps must be >= 1, got 0")]
    if not torch.cuda.is_available():
        cases.append(([], "error: step_profile profiles CUDA kernels: it needs a CUDA GPU"))
    for args, message in cases:
        proc = subprocess.run(
            [sys.executable, "-m", "benchmarks.step_profile", *args, "--", "experiment=smoke"],
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert proc.returncode == 2 and proc.stderr.strip() == message, proc.stderr


def test_token_ready_times_follow_the_producers_visiting_order():
    """W=1, two experts of one band each: a token of expert 0 is ready at half the producer,
    one of expert 1 at its end; on 2 ranks every token is ready by the end, none before 0."""
    import torch

    from benchmarks.token_ready import ready_times, table
    from harness.workload import WorkloadSpec, routing_of

    spec = WorkloadSpec(
        tokens_per_rank=64,
        hidden=1,
        out=1,
        experts_per_rank=2,
        top_k=1,
        world_size=1,
        routing="balanced",
    )
    expert = routing_of(spec).expert_ids[0][:, 0]  # [T]
    for order in ("remote_first", "expert"):
        r = ready_times(spec, tile_m=64, layout="compact", order=order)[0]
        assert torch.equal(r, torch.where(expert == 0, 0.5, 1.0)), order
    df = table(2, 256, 2, [4], ["balanced"], 16, "compact")
    assert len(df) == 2 and df["auto"].sum() == 1
    assert (df["ready_by_0.5"] <= df["ready_by_0.75"]).all()
    assert (df["ready_by_0.75"] <= df["ready_by_0.9"]).all() and (df["ready_by_0.9"] < 1).all()
    assert ((df["mean_ready"] > 0) & (df["mean_ready"] <= 1)).all()


def test_band_times_says_bad_input_in_one_line_before_any_gpu_work(monkeypatch, capsys):
    import pytest

    from benchmarks import band_times

    monkeypatch.setattr("sys.argv", ["band_times", "--routing", "zipf"])
    with pytest.raises(SystemExit) as exc:
        band_times.main()
    assert exc.value.code == 2 and "unknown routing ['zipf']" in capsys.readouterr().err
    monkeypatch.setattr("sys.argv", ["band_times", "--experts", "4,x"])
    with pytest.raises(SystemExit):
        band_times.main()
    assert "comma-separated integers" in capsys.readouterr().err
    monkeypatch.setattr("sys.argv", ["band_times", "--swizzles", "table,rows"])
    with pytest.raises(SystemExit):
        band_times.main()
    assert "swizzle must be one of" in capsys.readouterr().err
    monkeypatch.setattr("torch.cuda.is_available", lambda: False)
    monkeypatch.setattr("sys.argv", ["band_times"])
    with pytest.raises(SystemExit) as exc:
        band_times.main()
    assert str(exc.value).startswith("error: band_times needs a CUDA GPU")


def test_token_ready_waves_model_follows_the_producers_tile_order():
    """One band per expert, N=1024 (the table's band-major tiles, flags not deferred): on one
    program the first band ends at half the tiles; on 8 programs it ends with the first wave."""
    import torch

    from benchmarks.token_ready import rank_plans, wave_band_times
    from harness.workload import WorkloadSpec

    spec = WorkloadSpec(
        tokens_per_rank=128,
        hidden=2048,
        out=1024,
        experts_per_rank=2,
        top_k=1,
        world_size=1,
        routing="balanced",
    )
    _, plan = rank_plans(spec, 128, "compact")[0]
    assert plan.n_bands == 2  # 8 column tiles of 128 each
    first, last = plan.schedule.tolist()
    for grid in (1, 8):
        t = wave_band_times(plan, "remote_first", 1024, 2048, grid)
        assert t[first] == 0.5 and t[last] == 1.0, (grid, t)
    assert torch.equal(wave_band_times(plan, "remote_first", 1024, 2048, 16), torch.ones(2))


def test_token_ready_waves_model_walks_a_swizzle_group_column_tile_by_column_tile():
    """N=4096 (the table's expert groups of up to 16 bands, deferred flags) on ONE program: the
    bands of a group end in the group's last tiles, one tile apart; band by band (fixed1) they
    end tiles_n tiles apart; on as many programs as tiles, all end in the one wave."""
    import torch

    from benchmarks.token_ready import rank_plans, wave_band_times
    from harness.workload import WorkloadSpec
    from systems.overlap.modes import GROUP_CODE
    from systems.overlap.plan import producer_groups, producer_order

    spec = WorkloadSpec(
        tokens_per_rank=2048,
        hidden=2048,
        out=4096,
        experts_per_rank=4,
        top_k=2,
        world_size=2,
        routing="balanced",
    )
    _, plan = rank_plans(spec, 128, "compact")[0]
    b, tn = plan.n_bands, 4096 // 256
    visit = producer_order(plan).long()
    band_at = plan.schedule.long()[visit]  # band of each visiting position
    tiles = b * tn
    t = wave_band_times(plan, "expert", 4096, 2048, 1) * tiles  # in tiles (the last ends at T)
    groups = producer_groups(plan, visit, 16).long()
    first, size = (groups // GROUP_CODE).tolist(), (groups % GROUP_CODE).tolist()
    for f, g in sorted(set(zip(first, size))):
        ends = t[band_at[f : f + g]]
        expect = torch.arange(g) + f * tn + (tn - 1) * g + 2.0  # its last tiles, then the flag
        expect[expect > tiles] = tiles  # the program's last tile publishes at the loop's end
        assert torch.equal(ends, expect.double()), (f, g, ends, expect)
    t1 = wave_band_times(plan, "expert", 4096, 2048, 1, "fixed1") * tiles
    assert torch.equal(t1[band_at], (torch.arange(b) * tn + tn + 1.0).clamp(max=tiles).double())
    assert torch.equal(wave_band_times(plan, "expert", 4096, 2048, tiles), torch.ones(b).double())


def test_ready_scale_says_bad_input_in_one_line_before_any_gpu_work(monkeypatch, capsys):
    import pytest

    from benchmarks import ready_scale

    monkeypatch.setattr("sys.argv", ["ready_scale", "--variants", "own16,fast"])
    with pytest.raises(SystemExit) as exc:
        ready_scale.main()
    assert exc.value.code == 2 and "(got ['fast'])" in capsys.readouterr().err
    monkeypatch.setattr("sys.argv", ["ready_scale", "--n", "0"])
    with pytest.raises(SystemExit) as exc:
        ready_scale.main()
    assert exc.value.code == 2
    monkeypatch.setattr("torch.cuda.is_available", lambda: False)
    monkeypatch.setattr("sys.argv", ["ready_scale"])
    with pytest.raises(SystemExit) as exc:
        ready_scale.main()
    assert "needs a CUDA GPU" in str(exc.value)


def test_ready_scale_survives_a_process_that_dies_and_resumes_without_duplicates(
    monkeypatch, tmp_path
):
    """A workload's process that dies on a CUDA fault leaves one error row for the variant it
    was running; the next process runs only the rest; a second pass adds nothing."""
    import json
    import subprocess

    from benchmarks import ready_scale

    calls = []

    def fake_run(cmd, **kw):
        path = tmp_path / "w.jsonl"
        todo = cmd[cmd.index("--variants") + 1].split(",")
        calls.append(todo)
        have = {r["variant"] for r in ready_scale.read_rows(path)}
        out = ""
        with path.open("a") as f:
            for v in ["sequential"] * ("sequential" not in have) + todo:
                out += f"[ready_scale] variant {v}\n"
                if v == "beside132":  # dies mid-variant, as an illegal address does
                    err = "torch.AcceleratorError: CUDA error: an illegal memory access\n[W1] x"
                    return subprocess.CompletedProcess(cmd, 1, out, err)
                f.write(json.dumps({"variant": v, "status": "ok"}) + "\n")
        return subprocess.CompletedProcess(cmd, 0, out, "")

    monkeypatch.setattr(subprocess, "run", fake_run)
    monkeypatch.setattr(ready_scale, "provenance", lambda: {"git_rev": "x"})
    path, variants = tmp_path / "w.jsonl", ["beside32", "beside132", "own16"]
    ready_scale.run_workload("4096,4,balanced", variants, 3, path, 60)
    rows = ready_scale.read_rows(path)
    assert sorted(r["variant"] for r in rows) == sorted(["sequential", *variants])
    (bad,) = [r for r in rows if r["status"] == "error"]
    assert bad["variant"] == "beside132" and "illegal memory access" in bad["reason"]
    assert calls == [variants, ["own16"]]
    ready_scale.run_workload("4096,4,balanced", variants, 3, path, 60)
    assert len(ready_scale.read_rows(path)) == len(rows) and len(calls) == 2


def test_ready_scale_model_counts_the_tiles_left_when_the_producer_ends():
    import torch

    from benchmarks.ready_scale_model import time_left

    ready = torch.zeros(8)  # 4 tiles of 2 tokens, all ready at once: 2 done by 0.5 ms of 1 ms
    assert time_left(ready, 2, 1.0, 0.4, 0.5) == pytest.approx(0.2)
    late = torch.full((8,), 0.9)  # ready only after the producer's end: all of it left
    assert time_left(late, 2, 1.0, 0.4, 0.5) == pytest.approx(0.4)
    # tiles 0, 1 done by 0.5; tile 2 waits to 0.6 and runs 0.2 of its 0.25 ms by 0.8: 2.8
    # tiles done (3.2 without the wait), 1.2 left at 0.1 ms each
    half = torch.tensor([0.0] * 4 + [0.6] * 4)
    assert time_left(half, 2, 1.0, 0.4, 0.8) == pytest.approx(1.2 * 0.1)
    assert time_left(ready, 3, 0.9, 0.3, 10.0) == 0.0  # a last partial tile, all done


def test_ready_scale_model_with_the_producer_as_it_ran_beside_the_scale():
    """model_hidden_beside equals model_hidden when the producer ran as long as alone, and
    drops by at most the producer's extra time over the scale's when it ran longer."""
    import pandas as pd

    from benchmarks.ready_scale_model import model_rows

    w = {"out": 4096, "experts_per_rank": 4, "routing": "balanced", "status": "ok"}
    v = {**w, "alone_ms": 0.08, "block_t": 4, "producer_sms": 132, "taken": 0, "hidden": 0.1}
    df = pd.DataFrame([
        {**w, "variant": "producer", "ms": 0.37}, {**w, "variant": "scale", "ms": 0.05},
        {**v, "variant": "same", "producer_beside_ms": 0.37},
        {**v, "variant": "slow", "producer_beside_ms": 0.42},
    ])  # fmt: skip
    res = model_rows(df).set_index("variant")
    same, slow = res.loc["same"], res.loc["slow"]
    assert same["model_hidden_beside"] == pytest.approx(same["model_hidden"])
    assert 0 < same["model_hidden"] < 1
    # 0.05 ms longer, a whole scale's time: the step loses it, less what the later end leaves
    # the scale more time for (left no larger)
    assert slow["model_hidden_beside"] < same["model_hidden_beside"]
    assert slow["model_hidden_beside"] >= same["model_hidden"] - 1.0 - 1e-9


def test_ready_scale_model_says_a_bad_table_in_one_line(monkeypatch, capsys, tmp_path):
    import pandas as pd

    from benchmarks import ready_scale_model

    monkeypatch.setattr("sys.argv", ["ready_scale_model", str(tmp_path / "none.parquet")])
    with pytest.raises(SystemExit) as exc:
        ready_scale_model.main()
    assert exc.value.code == 2 and "no table at" in capsys.readouterr().err
    old = tmp_path / "old.parquet"  # a table from before the variants' columns
    pd.DataFrame({"variant": ["beside32"], "status": ["ok"], "ms": [1.0]}).to_parquet(old)
    monkeypatch.setattr("sys.argv", ["ready_scale_model", str(old)])
    with pytest.raises(SystemExit) as exc:
        ready_scale_model.main()
    assert exc.value.code == 2 and "lacks ['alone_ms'" in capsys.readouterr().err


def test_profile_stage_a_says_bad_input_in_one_line_before_any_gpu_work(monkeypatch, capsys):
    import pytest

    from benchmarks import profile_stage_a

    for argv, says in (
        (["--layouts", "packed"], "builds aligned or compact"),
        (["--experts", "16,x"], "comma-separated integers"),
        (["--experts", "0"], "comma-separated integers"),
    ):
        monkeypatch.setattr("sys.argv", ["profile_stage_a", *argv])
        with pytest.raises(SystemExit) as exc:
            profile_stage_a.main()
        assert exc.value.code == 2 and says in capsys.readouterr().err
    monkeypatch.setattr("torch.cuda.is_available", lambda: False)
    monkeypatch.setattr("sys.argv", ["profile_stage_a"])
    with pytest.raises(SystemExit) as exc:
        profile_stage_a.main()
    assert "needs a CUDA GPU" in str(exc.value)


@pytest.mark.parametrize(
    "name", ["host_profile", "kernels_h200", "ncu_producer", "profile_producer"]
)
def test_gpu_benchmarks_say_so_in_one_line_without_a_gpu(name, monkeypatch):
    import importlib

    mod = importlib.import_module(f"benchmarks.{name}")
    monkeypatch.setattr("torch.cuda.is_available", lambda: False)
    monkeypatch.setattr("sys.argv", [name])
    with pytest.raises(SystemExit) as exc:
        mod.main()
    assert f"{name} needs a CUDA GPU" in str(exc.value)
