"""Native Tutel and native FasterMoE in the layer scope (FFN cells, ffn = F > 0).

CPU: Tutel's FFN weight layout, the int32 guard counting F, fmoe's FFN expert_fn, FasterMoE's
wiring around a stub of fmoe's schedule (W=1), and, where the tutel package imports (a CPU build
works: pip install --no-build-isolation from its source), the real Tutel moe_layer on FFN cells
over gloo (W=1 and W=2, float32).
GPU (`@pytest.mark.gpu`): tutel and fastermoe on a small bf16 FFN cell through the harness, one
process (W=1, NCCL) and, with 2 GPUs, two processes (W=2) via harness.run.
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
import types
from pathlib import Path
from types import SimpleNamespace

import pandas as pd
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from harness.check import check
from harness.experts import ffn_experts
from harness.layout import rank_layout
from harness.reference import dispatch_local, reference_local
from harness.system import CellInputs, RunContext
from harness.workload import (
    WorkloadSpec,
    make_rank_fc1,
    make_rank_weights,
    make_tokens,
    routing_of,
)
from tests.multigpu import free_port

ROOT = Path(__file__).resolve().parents[1]
ROUTINGS = ("balanced", "moderate_skew", "stress_skew")
NATIVE = {"tutel": "tutel", "fastermoe": "fmoe"}
HAVE_TUTEL = importlib.util.find_spec("tutel") is not None
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


TUTEL = {"tutel": {"degrees": [1, 2]}}


def _ffn_spec(routing: str = "stress_skew", W: int = 1, dtype: str = "float32") -> WorkloadSpec:
    """The GPU tests' small FFN cell: T=256, H=128, F=64, E=4, top-2."""
    return WorkloadSpec(256, 128, 128, 4, 2, W, routing, dtype, ffn=64)


# CPU: pure functions ------------------------------------------------------------------------


def test_tutel_ffn_weights_reproduce_the_ffn_in_tutels_formula() -> None:
    """FusedExpertsNetwork.forward computes gelu(x @ fc1_w^T) @ fc2_w over [E, C, H]; with
    the mapped weights that is our gelu(x @ W1_e) @ W2_e (H != F, so a transposed or swapped
    weight fails on shape or value)."""
    from systems.tutel import tutel_ffn_weights

    E, C, H, F = 3, 5, 12, 8  # fp32 rows of 16-byte multiples (torch._grouped_mm on CPU)
    g = torch.Generator().manual_seed(0)
    w1, w2 = torch.randn(E, H, F, generator=g), torch.randn(E, F, H, generator=g)
    x = torch.randn(E, C, H, generator=g)
    fc1_w, fc2_w = tutel_ffn_weights(w1, w2)
    assert fc1_w.shape == fc2_w.shape == (E, F, H) and fc1_w.is_contiguous()
    y = torch.nn.functional.gelu(torch.matmul(x, fc1_w.permute(0, 2, 1)))
    y = torch.matmul(y, fc2_w)  # tutel/experts/ffn.py, biases off
    ref = ffn_experts(x.reshape(E * C, H), [C] * E, w1, w2).view(E, C, H)
    assert torch.allclose(y, ref, rtol=1e-5, atol=1e-5)


@pytest.mark.skipif(not HAVE_TUTEL, reason="the tutel package is not importable")
def test_tutels_own_ffn_module_with_our_weights_matches_ffn_experts() -> None:
    """The real FusedExpertsNetwork subclass: no biases, GELU erf, our weights, our result."""
    from systems.tutel import _tutel_ffn, tutel_ffn_weights

    E, C, H, F = 3, 5, 12, 8
    g = torch.Generator().manual_seed(1)
    w1, w2 = torch.randn(E, H, F, generator=g), torch.randn(E, F, H, generator=g)
    x = torch.randn(E, C, H, generator=g)
    mod = _tutel_ffn()(H, E, 1, *tutel_ffn_weights(w1, w2))
    assert mod.batched_fc1_bias is None and mod.batched_fc2_bias is None
    ctx = SimpleNamespace(megablocks_size=0, adaptive_degree=1, sharded_count=1)
    y = mod(x, ctx)
    ref = ffn_experts(x.reshape(E * C, H), [C] * E, w1, w2).view(E, C, H)
    assert torch.allclose(y, ref, rtol=1e-5, atol=1e-5)


def test_native_tutel_int32_guard_counts_the_ffn_width() -> None:
    """An FFN cell's widest buffer is experts x capacity x max(H, F): F alone can push it past
    2^31 where the same cell with width H stays under."""
    from systems.tutel import TutelSystem, buffer_width

    params = dict(TutelSystem.PARAMS)

    def ffn(E: int, F: int) -> WorkloadSpec:
        return WorkloadSpec(8192, 2048, 2048, E, 2, 2, "stress_skew", "bfloat16", ffn=F)

    assert buffer_width(ffn(32, 8192)) == 8192 and buffer_width(ffn(32, 1024)) == 2048
    reason = TutelSystem.unsupported(ffn(32, 8192), params)
    assert reason is not None and "int32" in reason and "max(H, F) 8192" in reason
    assert TutelSystem.unsupported(ffn(32, 2048), params) is None
    assert TutelSystem.unsupported(ffn(64, 4096), params) is not None
    operator = WorkloadSpec(8192, 2048, 2048, 64, 2, 2, "stress_skew", "bfloat16")
    assert TutelSystem.unsupported(operator, params) is None  # width H: 0.72 x 2^31
    assert TutelSystem.unsupported(ffn(64, 2048), params) is None
    assert TutelSystem.unsupported(ffn(32, 8192), {**params, "capacity_factor": 1.0}) is None


def test_native_systems_take_layer_cells_and_fastermoe_never_skips_them_for_width() -> None:
    from systems.fastermoe import FasterMoESystem
    from systems.fastermoe_reimpl import FasterMoEReimplSystem
    from systems.tutel import TutelSystem
    from systems.tutel_reimpl import TutelReimplSystem

    assert TutelSystem.layer_scope and FasterMoESystem.layer_scope
    assert not TutelReimplSystem.layer_scope and not FasterMoEReimplSystem.layer_scope
    for F in (64, 256):
        spec = WorkloadSpec(64, 128, 128, 4, 2, 2, "balanced", ffn=F)
        assert FasterMoESystem.unsupported(spec, {"group_size": 1}) is None


def test_fastermoe_expert_fn_is_the_ffn_on_ffn_cells() -> None:
    """fmoe calls expert_fn(x [m, H], counts, e) per local expert e."""
    from systems.fastermoe import expert_fn

    E, m, H, F = 3, 6, 12, 4
    g = torch.Generator().manual_seed(2)
    w1, w2 = torch.randn(E, H, F, generator=g), torch.randn(E, F, H, generator=g)
    x = torch.randn(m, H, generator=g)
    counts = torch.tensor([m])
    for e in range(E):
        ref = ffn_experts(x, [m], w1[e : e + 1], w2[e : e + 1])
        assert torch.allclose(expert_fn(w2, w1)(x, counts, e), ref, rtol=1e-5, atol=1e-5)
    b = torch.randn(E, H, H, generator=g)
    assert torch.allclose(expert_fn(b)(x, counts, 1), x @ b[1])


def _stub_fmoe(monkeypatch, calls: list) -> None:
    """fmoe's modules with its schedule's contract (W=1): rows [T*k, N] in (token, slot)
    order, expert_fn called once per local expert on that expert's rows."""

    def forward(inp, gate, expert_fn, n_expert, world_size, experts=None, stored_models=None):
        assert world_size == 1 and len(experts) == n_expert and not stored_models.any()
        k = gate.shape[1]
        flat = gate.reshape(-1)
        rows = None
        for e in range(n_expert):
            idx = (flat == e).nonzero().squeeze(1)
            if idx.numel() == 0:
                continue
            y = expert_fn(inp[idx // k], torch.tensor([idx.numel()]), e)
            calls.append((e, tuple(y.shape)))
            if rows is None:
                rows = y.new_zeros(flat.numel(), y.shape[1])
            rows[idx] = y
        return rows

    mods = {name: types.ModuleType(name) for name in ("fmoe", "fmoe.fastermoe")}
    mods["fmoe.fastermoe.schedule"] = types.ModuleType("fmoe.fastermoe.schedule")
    mods["fmoe.fastermoe.schedule"]._fmoe_general_global_forward = forward
    mods["fmoe.functions"] = types.ModuleType("fmoe.functions")
    mods["fmoe.functions"].ensure_comm = lambda t, comm: None
    for name, mod in mods.items():
        monkeypatch.setitem(sys.modules, name, mod)


def _inputs(spec: WorkloadSpec, rank: int = 0) -> CellInputs:
    dev = torch.device("cpu")
    lay = rank_layout(spec, rank)
    routing = routing_of(spec)
    return CellInputs(
        spec,
        lay,
        make_tokens(spec, rank, dev),
        make_rank_weights(spec, rank, dev),
        dispatch_local(spec, lay, dev),
        make_rank_fc1(spec, rank, dev) if spec.ffn else None,
        routing.expert_ids[rank],
        routing.gate_weights[rank].float(),
    )


@pytest.mark.parametrize("routing", ["balanced", "stress_skew"])
def test_fastermoe_layer_wiring_around_fmoes_schedule_matches_the_oracle(monkeypatch, routing):
    """W=1, float32: the FFN experts reach fmoe's schedule and the weighted sum of its rows is
    the layer's output (the schedule itself is a stub here; the GPU test runs the real one)."""
    import systems.fastermoe as fm

    calls: list = []
    _stub_fmoe(monkeypatch, calls)
    monkeypatch.setattr(fm, "_PROCESS_GROUP_SIZE", [])
    monkeypatch.delenv("FMOE_FASTER_GROUP_SIZE", raising=False)
    spec = _ffn_spec(routing)
    system = fm.FasterMoESystem(RunContext(0, 1, torch.device("cpu")), {})
    system.setup([_inputs(spec)])
    res = check(system.forward(), reference_local(spec, 0, torch.device("cpu")), 1e-5)
    assert res.ok, res.message
    assert calls and all(shape[1] == spec.hidden for _, shape in calls)
    assert system.extra["experts"] == "ffn (gelu)"


# CPU: the real Tutel (where a CPU build is importable) --------------------------------------


def _tutel_cpu_worker(rank: int, W: int, init: str, out: str) -> None:
    from harness.measure import cell_inputs
    from systems.tutel import TutelSystem

    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=W)
    try:
        ctx = RunContext(rank, W, torch.device("cpu"), None, "gloo")
        res = []
        for routing in ROUTINGS:
            spec = _ffn_spec(routing, W)
            inputs, ref = cell_inputs(ctx, spec, [rank])
            system = TutelSystem(ctx, {"degree": 1})
            system.setup(inputs)
            r = check(system.forward(), ref, 1e-5)
            res.append({"routing": routing, "ok": r.ok, "err": r.max_rel_err, **system.extra})
        Path(f"{out}.{rank}").write_text(json.dumps(res))
    finally:
        dist.destroy_process_group()


@pytest.mark.skipif(not HAVE_TUTEL, reason="the tutel package is not importable")
@pytest.mark.parametrize("W", [1, 2])
def test_native_tutel_ffn_cells_on_cpu_with_gloo(tmp_path: Path, W: int) -> None:
    """The real moe_layer (gate stub, encode, all-to-all, Tutel's FFN experts, decode) equals
    the float32 oracle on every routing."""
    out = tmp_path / "tutel"
    init = f"tcp://127.0.0.1:{free_port()}"
    mp.spawn(_tutel_cpu_worker, args=(W, init, str(out)), nprocs=W, join=True)
    for rank in range(W):
        for r in json.loads(Path(f"{out}.{rank}").read_text()):
            assert r["ok"] and r["err"] < 1e-5, r
            assert r["experts"] == "tutel.experts.ffn.FusedExpertsNetwork" and r["dropless"]


# GPU ----------------------------------------------------------------------------------------


def _native_or_skip(systems: tuple[str, ...]) -> list[str]:
    have = [s for s in systems if importlib.util.find_spec(NATIVE[s])]
    if not have:
        pytest.skip(f"none of {[NATIVE[s] for s in systems]} is importable")
    return have


def _run_gpu(tmp_path: Path, systems: list[str], ffn: int) -> list[dict]:
    """T=256 H=128 N=128 E=4 top-2 bf16 cells (ffn F, 0 = the operator) on one GPU."""
    from tests.multigpu import one_gpu_cells

    shape = dict(tokens_per_rank=256, hidden=128, out=128, experts_per_rank=4, top_k=2, ffn=ffn)
    return one_gpu_cells(tmp_path, systems, {**shape, "dtype": "bfloat16"}, TUTEL)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("system", ["tutel", "fastermoe"])
def test_native_ffn_layer_on_one_gpu_matches_the_reference(tmp_path: Path, system: str) -> None:
    """W=1, bf16, T=256 H=128 F=64 E=4 top-2, every routing: ok against the float32 oracle,
    timed as a layer (each system in its own process: fmoe keeps per-process state)."""
    systems = _native_or_skip((system,))
    rows = _run_gpu(tmp_path, systems, ffn=64)
    assert len(rows) == len(ROUTINGS)
    for r in rows:
        assert r["status"] == "ok", r
        assert r["err"] < 8e-3 and r["scope"] == "layer", r
        assert r["impl"].startswith("native ("), r


@pytest.mark.gpu
@needs_cuda
def test_native_fastermoe_operator_cell_with_k_equal_n_on_one_gpu(tmp_path: Path) -> None:
    """The single-GEMM expert_fn through fmoe's schedule (K == N = 128), every routing."""
    systems = _native_or_skip(("fastermoe",))
    for r in _run_gpu(tmp_path, systems, ffn=0):
        assert r["status"] == "ok", r
        assert r["err"] < 8e-3, r


@pytest.mark.gpu
@needs_cuda
def test_native_ffn_layer_on_two_gpus_via_the_harness(tmp_path: Path) -> None:
    """W = every visible GPU (up to 8), one process per GPU over NCCL: tutel (degrees tuned,
    d > 1 runs Tutel's a2a_ffn_overlap) and fastermoe next to serial on the FFN cell, two
    routings."""
    from tests.multigpu import gpu_world

    if gpu_world() < 2:
        pytest.skip("needs 2 GPUs")
    systems = _native_or_skip(("tutel", "fastermoe"))
    table = tmp_path / "t.parquet"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "harness.run",
            "hardware=h200",
            "progress=false",
            f"table={table}",
            f"hardware.world_size={gpu_world()}",
            "experiment.grid.ffn=[64]",
            "experiment.grid.experts_per_rank=[4]",
            "experiment.grid.dtype=[bfloat16]",
            *[f"+experiment.systems.{s}={{}}" for s in systems],
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    df = pd.read_parquet(table)
    print(df[["system", "routing", "status", "reason", "max_rel_err", "latency_ms"]])
    assert set(df["system"]) == {"serial", *systems}
    assert set(df["status"]) == {"ok"}, df[["system", "status", "reason"]]
    assert (df["scope"] == "layer").all() and (df["ffn"] == 64).all()
    assert (df["transport"] == "nccl").all() and (df["max_rel_err"] < 8e-3).all()
