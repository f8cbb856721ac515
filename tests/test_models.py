"""The models experiment (Fig 4): config, copy-in of new inputs into layer-scope systems, the
model check, the CPU smoke end to end with resume, the figure, bad input; GPU: every system."""

from __future__ import annotations

import dataclasses
import importlib.util
import re
import subprocess
import sys
import types
from pathlib import Path

import pandas as pd
import pytest
import torch
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from harness.check import check
from harness.config import register_configs
from harness.errors import HarnessUserError
from harness.layout import rank_layout
from harness.models import ModelSpec, ReferenceMoE, SystemMoE, owned_inputs
from harness.preflight import preflight
from harness.reference import dispatch_local
from harness.system import CellInputs, RunContext
from harness.workload import make_rank_fc1, make_rank_weights, make_tokens, routing_of
from tests.inprocess import launch

ROOT = Path(__file__).resolve().parents[1]
CPU = torch.device("cpu")
CTX = RunContext(0, 1, CPU)


def _compose(*overrides: str):
    register_configs()
    with initialize_config_dir(str(ROOT / "conf"), version_base="1.3"):
        return compose("config", overrides=list(overrides))


def _run(*overrides: str, timeout: int = 120):
    cmd = [sys.executable, "-m", "harness.run", "experiment=models_smoke", "progress=false"]
    return subprocess.run(
        [*cmd, *overrides], cwd=ROOT, capture_output=True, text=True, timeout=timeout
    )


def _inputs(spec) -> CellInputs:
    """One rank's CellInputs built as harness.measure.cell_inputs builds them (W=1, no group)."""
    lay = rank_layout(spec, 0)
    r = routing_of(spec)
    x = make_tokens(spec, 0, CPU)
    ids, gate = r.expert_ids[0].to(CPU), r.gate_weights[0].to(CPU, torch.float32)
    w1, w2 = make_rank_fc1(spec, 0, CPU), make_rank_weights(spec, 0, CPU)
    return CellInputs(spec, lay, x, w2, dispatch_local(spec, lay, CPU), w1, ids, gate)


def _new_routing(spec, seed: int):
    """Other tokens h [T, H], distinct top-k ids [T, k] and renormalised gates [T, k]."""
    g = torch.Generator().manual_seed(seed)
    T, G, k = spec.tokens_per_rank, spec.n_experts, spec.top_k
    h = torch.randn(T, spec.hidden, generator=g).to(spec.torch_dtype)
    ids = torch.rand(T, G, generator=g).argsort(1)[:, :k]
    gate = torch.rand(T, k, generator=g) + 0.1
    return h, ids, gate / gate.sum(1, keepdim=True)


TINY = ModelSpec("tiny", 2, (0, 1), 2, 8, 32, 4, True, experts=4, top_k=2, dtype="float32")


# -- config and bad input --------------------------------------------------------------------
def test_the_models_config_composes_with_the_papers_three_models():
    from experiments import models as exp

    cfg = _compose("experiment=models")
    cells = exp.cells(cfg, 4)
    assert len(cells) == 3 * 8 and len({c["cell_hash"] for c in cells}) == len(cells)
    specs = {m.name: m for m in exp.model_specs(cfg, "bfloat16")}
    assert specs["m_gpt"].moe_blocks == (11,) and specs["m_gpt"].tokens == 8 * 1024
    assert specs["m_bert"].moe_blocks == (2, 5, 8, 11) and not specs["m_bert"].causal
    assert specs["m_transxl"].moe_blocks == tuple(range(12)) and specs["m_transxl"].heads == 8
    assert all(m.blocks == 12 and m.experts == 64 and m.ffn == 4 * m.hidden for m in specs.values())
    spec = specs["m_bert"].moe_spec(4, 0)
    assert (spec.tokens_per_rank, spec.hidden, spec.out, spec.ffn) == (16384, 768, 768, 3072)
    assert spec.experts_per_rank == 16 and spec.top_k == 2
    exp.validate(cfg, cells, 132)
    assert {c["system"] for c in cells} == {
        "serial",
        "overlap",
        "megatron_cutlass",
        "megatron_te",
        "tutel",
        "fastermoe",
        "deepep",
        "megatron_deepep",
    }


@pytest.mark.parametrize(
    "override,message",
    [
        ("experiment.options.models.tiny_gpt.heads=5", "not a multiple of heads 5"),
        ("experiment.options.experts=7", "7 experts do not split over W=2"),
        ("experiment.options.models.tiny_bert.moe_blocks=[2]", "below blocks=2"),
        ("+experiment.options.expert=8", "unknown option(s) ['expert']"),
        ("+experiment.systems.tutel_reimpl={}", "tutel_reimpl has no layer scope"),
        ("experiment.options.model_tol=0", "model_tol must be in (0, 1)"),
        ("experiment.options.ffn_mult=abc", "models: ffn_mult must be an integer, got 'abc'"),
        ("experiment.options.models.tiny_gpt.moe_blocks=1", "moe_blocks must be a list, got 1"),
        ("experiment.options.models.tiny_gpt.heads=1.5", "tiny_gpt: heads must be an integer"),
    ],
)
def test_bad_input_is_an_error_before_any_process(override, message):
    with pytest.raises(HarnessUserError, match=re.escape(message)):
        preflight(_compose("experiment=models_smoke", override), 2, table=False)


def test_bad_input_on_the_command_line_is_one_line_and_exit_code_2(tmp_path):
    proc = _run(f"table={tmp_path / 't.parquet'}", "experiment.options.models.tiny_gpt.heads=5")
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert proc.stderr.strip().splitlines() == [
        "error: model tiny_gpt: hidden 64 is not a multiple of heads 5"
    ]
    assert not (tmp_path / "t.parquet").exists()


# -- copy-in: a layer-scope system follows new inputs copied into its CellInputs ------------
def test_serial_follows_inputs_copied_into_its_cellinputs():
    from systems.serial import SerialSystem

    spec = TINY.moe_spec(1, 0)
    harness_inputs = _inputs(spec)
    # on the CPU the harness's ids are a view of the cached routing: a copy-in needs own tensors
    assert harness_inputs.expert_ids.data_ptr() == routing_of(spec).expert_ids[0].data_ptr()
    inputs = owned_inputs(harness_inputs)
    assert inputs.expert_ids.data_ptr() != harness_inputs.expert_ids.data_ptr()
    system = SerialSystem(CTX, {})
    system.setup([inputs])
    first = system.timed()
    oracle = ReferenceMoE(spec, CPU)
    moe = SystemMoE(system, inputs)
    for seed in (1, 2):
        h, ids, gate = _new_routing(spec, seed)
        out = moe(0, h, ids, gate)
        res = check(out, oracle(0, h, ids, gate), 1e-4)
        assert res.ok, res.message
        assert not torch.allclose(out, first)
    assert torch.equal(routing_of(spec).expert_ids[0], harness_inputs.expert_ids)  # untouched


def test_tutel_router_stub_gives_back_the_copied_routing():
    """Tutel's gate (softmax, top-k, normalise) over router_logits returns exactly (ids, gate)."""
    from systems.tutel import router_logits

    spec = TINY.moe_spec(1, 0)
    for seed in (1, 2):
        _, ids, gate = _new_routing(spec, seed)
        probs = torch.softmax(router_logits(ids, gate, spec.n_experts), dim=1)
        vals, top = probs.topk(spec.top_k, dim=1)
        order = ids.gather(1, gate.argsort(1, descending=True))
        assert torch.equal(top, order)
        assert torch.allclose(
            vals / vals.sum(1, keepdim=True), gate.gather(1, gate.argsort(1, True))
        )


def _fake_fmoe(monkeypatch):
    """fmoe's schedule replaced by a W=1 pure-torch stand-in with its contract: rows [T*k, N],
    row t*k+j = expert_fn(x[t], ., gate[t, j]) (local expert = global at W=1)."""

    def forward(x, gate, expert_fn, n_expert, world_size, experts=None, stored_models=None):
        T, k = gate.shape
        rows = torch.empty(T * k, x.shape[1], dtype=x.dtype)
        flat = gate.reshape(-1)
        for e in range(n_expert):
            sel = (flat == e).nonzero().squeeze(1)
            if sel.numel():
                rows[sel] = expert_fn(x[sel // k], None, e)
        return rows

    schedule = types.ModuleType("fmoe.fastermoe.schedule")
    schedule._fmoe_general_global_forward = forward
    functions = types.ModuleType("fmoe.functions")
    functions.ensure_comm = lambda x, group: None
    for name, mod in {
        "fmoe": types.ModuleType("fmoe"),
        "fmoe.fastermoe": types.ModuleType("fmoe.fastermoe"),
        "fmoe.fastermoe.schedule": schedule,
        "fmoe.functions": functions,
    }.items():
        monkeypatch.setitem(sys.modules, name, mod)


def test_fastermoe_glue_follows_inputs_copied_into_its_cellinputs(monkeypatch):
    import systems.fastermoe as fm

    _fake_fmoe(monkeypatch)
    monkeypatch.setattr(fm, "_PROCESS_GROUP_SIZE", [])
    monkeypatch.setenv("FMOE_FASTER_GROUP_SIZE", "1")
    spec = TINY.moe_spec(1, 0)
    inputs = owned_inputs(_inputs(spec))
    system = fm.FasterMoESystem(CTX, {"group_size": 1})
    system.setup([inputs])
    oracle = ReferenceMoE(spec, CPU)
    for seed in (1, 2):
        h, ids, gate = _new_routing(spec, seed)
        res = check(SystemMoE(system, inputs)(0, h, ids, gate), oracle(0, h, ids, gate), 1e-4)
        assert res.ok, res.message


def test_the_model_check_catches_a_system_that_keeps_its_setup_routing():
    """A serial system fed a snapshot of the routing at setup fails the model's checked
    forward (a MoE call against the oracle); the real serial passes it."""
    from experiments import models as exp
    from systems.serial import SerialSystem

    class Stale(SerialSystem):
        def setup(self, ranks):
            (inp,) = ranks
            snap = dataclasses.replace(inp, expert_ids=inp.expert_ids.clone())
            super().setup([snap])

    cfg = OmegaConf.create({"measure": {"tol": 8e-3}, "experiment": {"options": {}}})
    ref = exp.reference(CTX, TINY, 0)
    statuses = {}
    for cls in (SerialSystem, Stale):
        inputs = owned_inputs(_inputs(TINY.moe_spec(1, 0)))
        system = cls(CTX, {})
        system.setup([inputs])
        row = exp._row(
            {
                "experiment": "t",
                "system": "serial",
                "cell_hash": "h",
                "world_size": 1,
                "params": {},
            },
            TINY,
        )
        exp.checked_forward(CTX, cfg, row, ref, SystemMoE(system, inputs))
        statuses[cls.__name__] = (row.status, row.reason)
    assert statuses["SerialSystem"] == ("ok", ""), statuses
    assert statuses["Stale"][0] == "fail" and "a MoE call" in statuses["Stale"][1], statuses


def _megatron_worker(rank: int, init: str, out: str) -> None:
    """Megatron's real MoELayer + GroupedMLP on the CPU (W=1 gloo), patched by
    tests/test_megatron_cpu_layer.megatron_on_cpu, fed two new routings by copy-in."""
    import json

    import torch.distributed as dist

    from systems.megatron_cutlass import MegatronCutlassSystem
    from tests.test_megatron_cpu_layer import megatron_on_cpu

    megatron_on_cpu()
    dist.init_process_group("gloo", init_method=init, rank=0, world_size=1)
    try:
        spec = dataclasses.replace(TINY, dtype="bfloat16").moe_spec(1, 0)
        inputs = owned_inputs(_inputs(spec))
        system = MegatronCutlassSystem(
            RunContext(0, 1, CPU, None, "gloo"), {"permute_fusion": False}
        )
        system.setup([inputs])
        oracle = ReferenceMoE(spec, CPU)
        res = []
        for seed in (1, 2):
            h, ids, gate = _new_routing(spec, seed)
            c = check(SystemMoE(system, inputs)(0, h, ids, gate), oracle(0, h, ids, gate), 8e-3)
            res.append([c.ok, c.max_rel_err, c.message])
        Path(out).write_text(json.dumps(res))
    finally:
        dist.destroy_process_group()


@pytest.mark.skipif(
    importlib.util.find_spec("megatron") is None, reason="megatron-core is not installed"
)
def test_megatron_layer_follows_inputs_copied_into_its_cellinputs(tmp_path):
    import json
    import socket

    import torch.multiprocessing as mp

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    out = tmp_path / "megatron.json"
    mp.spawn(_megatron_worker, args=(f"tcp://127.0.0.1:{port}", str(out)), nprocs=1, join=True)
    res = json.loads(out.read_text())
    assert [ok for ok, _, _ in res] == [True, True], res


# -- the smoke end to end, and its resume ----------------------------------------------------
def test_models_smoke_runs_on_the_cpu_and_resumes_without_duplicates(tmp_path, capsys):
    # in-process (the command line itself: tests/test_run.py; its one-line errors: above)
    table = tmp_path / "models_smoke.parquet"
    smoke = ("experiment=models_smoke", "progress=false", f"table={table}")
    assert launch(*smoke) == 0, capsys.readouterr()
    df = pd.read_parquet(table)
    assert len(df) == 2 * 6 and df["cell_hash"].is_unique
    ok = df[df["status"] == "ok"]
    assert set(ok["system"]) == {"serial"} and set(ok["model"]) == {"tiny_gpt", "tiny_bert"}
    assert (ok["scope"] == "model").all() and (ok["world_size"] == 2).all()
    assert (ok["max_rel_err"] < 5e-2).all() and (ok["m_moe_max_rel_err"] < 8e-3).all()
    assert dict(zip(ok["model"], ok["m_moe_blocks"])) == {"tiny_gpt": 1.0, "tiny_bert": 2.0}
    assert (ok["m_moe_ms"] > 0).all() and (ok["m_moe_ms"] < ok["latency_ms"]).all()
    assert (ok["tokens_per_rank"] == 32).all() and (ok["ffn"] == 256).all()
    skipped = df[df["status"] == "skipped"]
    assert skipped["reason"].str.contains("needs a CUDA GPU").all(), skipped["reason"]
    capsys.readouterr()
    assert launch(*smoke, ranks=False) == 0  # every cell is in: no rank starts
    again = capsys.readouterr().out
    assert "12 already in" in again and "0 to run" in again, again
    assert len(pd.read_parquet(table)) == len(df)


# -- the figure ------------------------------------------------------------------------------
def _table(path: Path) -> Path:
    from experiments.models import ModelRow
    from harness.records import ResultsTable

    rows = []
    for model, base in (("m_gpt", 10.0), ("m_bert", 20.0)):
        for system, e2e, moe in (("overlap", 1.0, 0.5), ("serial", 1.2, 1.0), ("tutel", 2.0, 2.0)):
            rows.append(
                ModelRow(
                    "models",
                    system,
                    cell_hash=f"{model}{system}",
                    world_size=4,
                    dtype="bfloat16",
                    transport="nccl",
                    model=model,
                    latency_ms=base * e2e,
                    metrics={"moe_ms": base * moe / 4},
                    gpu_name="fixture",
                )
            )
    ResultsTable(path).append(rows)
    return path


def test_models_figure_and_its_speedups(tmp_path):
    from plots import models as fig

    t = _table(tmp_path / "models.parquet")
    sp = fig.speedups(pd.read_parquet(t)).set_index(["model", "baseline"])
    assert sp.loc[("m_gpt", "serial"), "e2e"] == pytest.approx(1.2)
    assert sp.loc[("m_bert", "tutel"), "moe"] == pytest.approx(4.0)
    assert len(sp) == 4
    paths = fig.plot(t, tmp_path / "figs", "models")
    assert all(p.exists() and p.stat().st_size > 0 for p in paths)
    df = pd.read_parquet(t)
    with pytest.raises(ValueError, match="no ok overlap rows"):
        fig.speedups(df[df["system"] != "overlap"])


# -- GPU tier --------------------------------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 1, reason="needs at least one CUDA GPU")
def test_models_smoke_every_layer_scope_system_on_gpus(tmp_path):
    """The smoke's tiny models with one process per GPU over NCCL: every layer-scope system ok,
    or skipped with a reason (a missing package); none fails or errs."""
    n = torch.cuda.device_count()
    table = tmp_path / "models_smoke_gpu.parquet"
    gpu = ["hardware.name=h200", "hardware.device=cuda", "hardware.backend=nccl"]
    proc = _run(
        f"table={table}",
        *gpu,
        "hardware.world_size=0",
        "hardware.timeout_s=600",
        f"experiment.options.experts={4 * n}",
        timeout=900,
    )
    df = pd.read_parquet(table)
    bad = df[df["status"].isin(["fail", "error"])]
    assert bad.empty, bad[["model", "system", "status", "reason"]].to_string()
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    ok = df[df["status"] == "ok"]
    assert {"serial", "overlap"} <= set(ok["system"]), df[["system", "status", "reason"]]
    assert (ok["m_moe_max_rel_err"] < 8e-3).all() and (ok["max_rel_err"] < 5e-2).all()
    assert (ok["m_moe_ms"] > 0).all() and (ok["world_size"] == n).all()
    assert df[df["status"] == "skipped"]["reason"].str.len().gt(0).all()
    if n == 1:  # the played device dispatch: serial and overlap capture whole (measure.graph=auto)
        host_free = ok[ok["system"].isin(["serial", "overlap"])]
        assert host_free["graph"].all(), host_free[["system", "graph_reason"]]
