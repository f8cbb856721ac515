"""Megatron-core baselines: CPU parts with the real megatron-core, the layer itself on a GPU.

CPU (needs megatron-core installed, else skipped): config translation, the routing fed to the
dispatcher, Megatron's permute reproducing the harness send order, the weight copies into the
GroupedMLP fc1 and TE GroupedLinear layouts, the single-GEMM experts module, the idempotent
parallel-state initialisation (2 gloo ranks), and the registry's skip reasons.
GPU (`@pytest.mark.gpu`): the real MoELayer + all-to-all dispatcher on one rank for every
routing, checked against the reference; megatron_te only where transformer_engine imports.
"""

from __future__ import annotations

import importlib.util
import json
import socket
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from harness.layout import rank_layout
from harness.system import RunContext, get_system
from harness.workload import WorkloadSpec, make_rank_weights, make_tokens, routing_of

ROUTINGS = ("balanced", "moderate_skew", "stress_skew")
HAVE_MCORE = importlib.util.find_spec("megatron") is not None
needs_mcore = pytest.mark.skipif(not HAVE_MCORE, reason="megatron-core is not installed")
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def _spec(routing: str = "moderate_skew", W: int = 4, dtype: str = "float32") -> WorkloadSpec:
    return WorkloadSpec(
        tokens_per_rank=48,
        hidden=32,
        out=40,
        experts_per_rank=3,
        top_k=2,
        world_size=W,
        routing=routing,
        dtype=dtype,
        seed=5,
    )


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# registry ----------------------------------------------------------------------------------


def test_megatron_systems_are_registered_as_gpu_baselines() -> None:
    for name in ("megatron_cutlass", "megatron_te"):
        info = get_system(name)
        assert info.baseline and info.needs_gpu and info.label
    cpu = RunContext(0, 4, torch.device("cpu"))
    assert "CUDA" in get_system("megatron_te").unavailable_reason(cpu, 4)
    if importlib.util.find_spec("transformer_engine") is None:
        gpu = RunContext(0, 4, torch.device("cuda"))  # only the device type is read
        reason = get_system("megatron_te").unavailable_reason(gpu, 4)
        assert reason is not None
        assert "transformer_engine" in reason or "megatron" in reason


def test_megatron_modules_import_without_megatron() -> None:
    """The registry loads the classes on any machine; megatron is imported only at setup."""
    get_system("megatron_cutlass").load()
    get_system("megatron_te").load()


# CPU parts with the real megatron-core -----------------------------------------------------


@needs_mcore
def test_transformer_config_translation() -> None:
    from systems.megatron_common import transformer_config

    spec = _spec(dtype="bfloat16")
    cfg = transformer_config(spec)
    assert cfg.hidden_size == spec.hidden
    assert cfg.moe_ffn_hidden_size == spec.out
    assert cfg.num_moe_experts == spec.n_experts
    assert cfg.moe_router_topk == spec.top_k
    assert cfg.expert_model_parallel_size == spec.world_size
    assert cfg.moe_token_dispatcher_type == "alltoall"
    assert cfg.moe_expert_capacity_factor is None and not cfg.moe_pad_expert_input_to_capacity
    assert cfg.bf16 and cfg.params_dtype == torch.bfloat16 and not cfg.add_bias_linear
    assert not cfg.moe_permute_fusion and not cfg.gated_linear_unit


@needs_mcore
def test_routing_tensors_match_the_harness_routing() -> None:
    from systems.megatron_common import routing_tensors

    spec = _spec()
    probs, rmap = routing_tensors(spec, 1, torch.device("cpu"))
    r = routing_of(spec)
    assert probs.shape == rmap.shape == (spec.tokens_per_rank, spec.n_experts)
    assert (rmap.sum(1) == spec.top_k).all()
    assert torch.allclose(probs.sum(1), torch.ones(spec.tokens_per_rank))
    assert torch.equal(probs.gather(1, r.expert_ids[1]), r.gate_weights[1])
    assert torch.equal(
        rmap.nonzero()[:, 1].view(-1, spec.top_k).sort(1).values, r.expert_ids[1].sort(1).values
    )


@needs_mcore
@pytest.mark.parametrize("routing", ROUTINGS)
def test_megatron_permute_gives_the_harness_send_order(routing: str) -> None:
    """Megatron's permutation 1 (expert-major, then token) == our send order, rows and probs.

    With global expert = rank * E + e, expert-major order is destination-major order, so the
    EP all-to-all then delivers exactly the harness's x_recv on every rank.
    """
    from megatron.core.transformer.moe.moe_utils import permute

    from systems.megatron_common import routing_tensors

    spec = _spec(routing)
    for rank in range(spec.world_size):
        x = make_tokens(spec, rank, torch.device("cpu"))
        probs, rmap = routing_tensors(spec, rank, torch.device("cpu"))
        rows, p, _ = permute(x, rmap, probs=probs, num_out_tokens=int(rmap.sum()))
        lay = rank_layout(spec, rank)
        assert torch.equal(rows, x[lay.send_token])
        assert torch.equal(p, lay.send_weight)


@needs_mcore
def test_grouped_fc1_layout_round_trip() -> None:
    from systems.megatron_common import grouped_fc1_layout

    w = make_rank_weights(_spec(), 0, torch.device("cpu"))  # [E, K, N]
    E, K, N = w.shape
    w1 = grouped_fc1_layout(w)
    assert w1.shape == (K, E * N)
    assert torch.equal(w1.view(E, K, N), w)  # what GroupedMLP's forward reads


@needs_mcore
def test_te_weight_copy_layout() -> None:
    """TE GroupedLinear keeps weight{e} [N, K] with y = x @ weight{e}^T: copied as B_e^T."""
    from systems.megatron_common import copy_te_weights

    w = make_rank_weights(_spec(), 2, torch.device("cpu"))
    E, K, N = w.shape
    holder = torch.nn.Module()  # stands in for the parameters only; no TE math is imitated
    for e in range(E):
        holder.register_parameter(f"weight{e}", torch.nn.Parameter(torch.empty(N, K)))
    copy_te_weights(holder, w)
    x = torch.randn(5, K)
    for e in range(E):
        assert torch.equal(getattr(holder, f"weight{e}").data, w[e].t())
        assert torch.allclose(x @ getattr(holder, f"weight{e}").data.t(), x @ w[e], atol=1e-5)
    bad = torch.nn.Module()
    bad.register_parameter("weight0", torch.nn.Parameter(torch.empty(K, N)))
    with pytest.raises(ValueError, match="weight0"):
        copy_te_weights(bad, w[:1])


@needs_mcore
def test_single_gemm_grouped_mlp_matches_per_expert_gemm() -> None:
    """The experts module: rows sorted by expert [R, K] -> probs * (x @ B_e) [R, N]."""
    from systems.megatron_common import single_gemm_grouped_mlp_cls, transformer_config

    spec = _spec()
    cfg = transformer_config(spec)
    w = make_rank_weights(spec, 0, torch.device("cpu"))
    experts = single_gemm_grouped_mlp_cls()(spec.experts_per_rank, cfg)
    experts.load_weights(w)
    counts = torch.tensor([5, 0, 7])
    x = torch.randn(int(counts.sum()), spec.hidden)
    probs = torch.rand(x.shape[0])
    y, bias = experts(x, counts, probs)
    assert bias is None and y.shape == (x.shape[0], spec.out)
    want = torch.cat([x[:5] @ w[0], x[5:] @ w[2]]) * probs[:, None]
    assert torch.allclose(y, want, atol=1e-5)


def _parallel_state_worker(rank: int, init: str, out: str) -> None:
    from megatron.core import parallel_state as ps

    from systems.megatron_common import ensure_parallel_state

    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=2)
    try:
        ensure_parallel_state(2)
        ensure_parallel_state(2)  # idempotent: no new groups, no error
        res = {
            "ep": ps.get_expert_model_parallel_world_size(),
            "tp": ps.get_tensor_model_parallel_world_size(),
        }
        try:
            ensure_parallel_state(4)
            res["mismatch"] = "no error"
        except ValueError as exc:
            res["mismatch"] = str(exc)
        if rank == 0:
            Path(out).write_text(json.dumps(res))
    finally:
        dist.destroy_process_group()


@needs_mcore
def test_parallel_state_is_initialised_once(tmp_path: Path) -> None:
    out = tmp_path / "ps.json"
    init = f"tcp://127.0.0.1:{_free_port()}"
    mp.spawn(_parallel_state_worker, args=(init, str(out)), nprocs=2, join=True)
    res = json.loads(out.read_text())
    assert res["ep"] == 2 and res["tp"] == 1
    assert "EP size 4" in res["mismatch"]


# GPU: the real MoELayer on one rank --------------------------------------------------------


def _gpu_worker(rank: int, init: str, out: str, systems: list[str]) -> None:
    from harness.measure import measure_cell

    torch.cuda.set_device(0)
    dev = torch.device("cuda", 0)
    dist.init_process_group("nccl", init_method=init, rank=0, world_size=1, device_id=dev)
    try:
        ctx = RunContext(0, 1, dev, None, "nccl")
        cfg = SimpleNamespace(measure=SimpleNamespace(tol=8e-3, warmup=1, iters=3))
        params = {"tutel": {"degrees": [1, 2]}, "tutel_reimpl": {"degrees": [1, 2]}}
        rows = []
        for routing in ROUTINGS:
            for system in systems:
                cell = {
                    "experiment": "test_megatron_gpu",
                    "system": system,
                    "seed": 0,
                    "world_size": 1,
                    "tokens_per_rank": 512,
                    "hidden": 256,
                    "out": 384,
                    "experts_per_rank": 8,
                    "top_k": 2,
                    "routing": routing,
                    "dtype": "bfloat16",
                    # as expand_grid makes them: PARAMS defaults, then the test's
                    "params": {**get_system(system).load().PARAMS, **params.get(system, {})},
                    "cell_hash": f"{system}-{routing}",
                }
                r = measure_cell(ctx, cfg, cell)
                rows.append(
                    {
                        "system": system,
                        "routing": routing,
                        "status": r.status,
                        "reason": r.reason,
                        "err": r.max_rel_err,
                        "impl": r.impl,
                        "latency_ms": r.latency_ms,
                    }
                )
        Path(out).write_text(json.dumps(rows))
    finally:
        dist.destroy_process_group()


_NATIVE = {"tutel": "tutel", "fastermoe": "fmoe"}


def _run_gpu(tmp_path: Path, systems: list[str]) -> list[dict]:
    out = tmp_path / "gpu.json"
    init = f"tcp://127.0.0.1:{_free_port()}"
    mp.spawn(_gpu_worker, args=(init, str(out), systems), nprocs=1, join=True)
    return json.loads(out.read_text())


@pytest.mark.gpu
@needs_cuda
@needs_mcore
def test_megatron_cutlass_on_gpu_matches_reference(tmp_path: Path) -> None:
    systems = ["megatron_cutlass", "serial", "tutel_reimpl", "fastermoe_reimpl"]
    systems += [s for s in ("tutel",) if importlib.util.find_spec(_NATIVE[s])]  # K != N here
    rows = _run_gpu(tmp_path, systems)
    print(json.dumps(rows, indent=1))
    for r in rows:
        assert r["status"] == "ok", r
        assert r["err"] < 8e-3, r
    impls = {r["impl"] for r in rows if r["system"] == "megatron_cutlass"}
    assert all(i.startswith("native (mcore") for i in impls), impls


@pytest.mark.gpu
@needs_cuda
@needs_mcore
def test_megatron_te_on_gpu_matches_reference(tmp_path: Path) -> None:
    pytest.importorskip("transformer_engine")
    rows = _run_gpu(tmp_path, ["megatron_te"])
    for r in rows:
        assert r["status"] == "ok", r
        assert r["err"] < 8e-3, r


def test_permute_fusion_auto_follows_te_and_true_without_te_is_an_error() -> None:
    from systems import megatron_common as mc

    have = mc.fused_permute_available()
    assert mc.resolve_permute_fusion("auto") is have
    assert mc.resolve_permute_fusion(False) is False
    if not have:
        with pytest.raises(ValueError, match="fused permute"):
            mc.resolve_permute_fusion(True)
    with pytest.raises(ValueError, match="permute_fusion"):
        mc.resolve_permute_fusion("yes")
