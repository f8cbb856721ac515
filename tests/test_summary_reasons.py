"""The run's summary names why cells were skipped (issue 42 #10): one line per (system, reason),
after the fail and error cells' lines, within the summary's cap."""

from harness.run import summary


def _row(system, status, i, reason=""):
    return {"system": system, "status": status, "cell_hash": f"{system}{i}", "reason": reason,
            "routing": "balanced", "experts_per_rank": 2, "world_size": 4}  # fmt: skip


def test_skipped_rows_print_their_reason_once_per_system_and_reason(tmp_path):
    tutel = "optional package 'tutel' is not installed"
    rows = [_row("serial", "ok", i) for i in range(3)]
    rows += [_row("tutel", "skipped", i, tutel) for i in range(3)]
    rows += [_row("megatron_te", "skipped", 0, "megatron_te needs a CUDA GPU; this run is on cpu")]
    lines = summary(rows, tmp_path / "t.parquet")
    said = [line for line in lines if line.startswith("[harness] skipped:")]
    assert said == [
        "[harness] skipped: megatron_te (1 cell): megatron_te needs a CUDA GPU; this run is on cpu",
        f"[harness] skipped: tutel (3 cells): {tutel}",
    ], lines
    assert "3 ok, 4 skipped" in lines[-1]


def test_errors_come_before_skip_reasons_and_the_rest_is_pointed_to(tmp_path):
    rows = [_row("overlap", "error", i, f"crashed {i}") for i in range(3)]
    rows += [_row(f"s{i}", "skipped", 0, f"why {i}") for i in range(3)]
    lines = summary(rows, tmp_path / "t.parquet")
    reasons = [line for line in lines if line.startswith("[harness] ") and ": " in line]
    assert [r.split(":")[0] for r in reasons[:4]] == ["[harness] error"] * 3 + ["[harness] skipped"]
    assert "2 more reason(s)" in lines[-2] and len(lines) <= 22
