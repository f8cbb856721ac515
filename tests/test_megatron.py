"""Megatron-core baselines: CPU parts with the real megatron-core, the layer itself on a GPU.

CPU (needs megatron-core installed, else skipped): config translation, the routing fed to the
dispatcher, Megatron's permute reproducing the harness send order, the weight copies into the
GroupedMLP fc1 and TE GroupedLinear layouts, the single-GEMM experts module, and the
registry's skip reasons.
GPU (`@pytest.mark.gpu`): the real MoELayer + all-to-all dispatcher on one rank for every
routing, checked against the reference; megatron_te only where transformer_engine imports.
Layer scope (FFN cells): config translation, the W1/W2 layouts of GroupedMLP and TEGroupedMLP,
and the experts from Megatron's own MoE spec; on a GPU, small layer cells through the harness.
The real MoELayer on the CPU over gloo (and the parallel state): tests/test_megatron_cpu_layer.py.
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
import torch

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


def routing_tensors(
    spec: WorkloadSpec, rank: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """The harness routing as Megatron's router output: probs [T, G] f32, routing_map [T, G]."""
    from systems.megatron_common import topk_to_dense

    routing = routing_of(spec)
    ids, gate = routing.expert_ids[rank].to(device), routing.gate_weights[rank].to(device)
    return topk_to_dense(ids, gate, spec.n_experts)


# registry ----------------------------------------------------------------------------------


def test_megatron_systems_are_registered_as_gpu_baselines() -> None:
    for name in ("megatron_cutlass", "megatron_te"):
        info = get_system(name)
        assert info.needs_gpu and info.label
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
    from systems.megatron_common import single_gemm_experts_cls, transformer_config

    spec = _spec()
    cfg = transformer_config(spec)
    w = make_rank_weights(spec, 0, torch.device("cpu"))
    experts = single_gemm_experts_cls()(spec.experts_per_rank, cfg)
    experts.load_weights(w)
    counts = torch.tensor([5, 0, 7])
    x = torch.randn(int(counts.sum()), spec.hidden)
    probs = torch.rand(x.shape[0])
    y, bias = experts(x, counts, probs)
    assert bias is None and y.shape == (x.shape[0], spec.out)
    want = torch.cat([x[:5] @ w[0], x[5:] @ w[2]]) * probs[:, None]
    assert torch.allclose(y, want, atol=1e-5)


# GPU: the real MoELayer on one rank --------------------------------------------------------


OPERATOR = dict(tokens_per_rank=512, hidden=256, out=384, experts_per_rank=8, top_k=2)
LAYER = dict(tokens_per_rank=256, hidden=128, out=128, experts_per_rank=4, top_k=2, ffn=64)
TUTEL = {"tutel": {"degrees": [1, 2]}, "tutel_reimpl": {"degrees": [1, 2]}}
_NATIVE = {"tutel": "tutel", "fastermoe": "fmoe"}


def _run_gpu(tmp_path: Path, systems: list[str], shape: dict = OPERATOR) -> list[dict]:
    from tests.multigpu import one_gpu_cells

    return one_gpu_cells(tmp_path, systems, {**shape, "dtype": "bfloat16"}, TUTEL)


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


# layer scope (FFN cells) -------------------------------------------------------------------


def _layer_spec(routing: str = "moderate_skew", W: int = 1, E: int = 4, T: int = 64):
    return WorkloadSpec(
        tokens_per_rank=T,
        hidden=32,
        out=32,
        experts_per_rank=E,
        top_k=2,
        world_size=W,
        routing=routing,
        dtype="bfloat16",
        seed=7,
        ffn=24,
    )


def test_megatron_systems_declare_the_layer_scope() -> None:
    cutlass = get_system("megatron_cutlass").load()
    te = get_system("megatron_te").load()
    assert cutlass.layer_scope and te.layer_scope
    assert (cutlass.layer_experts, te.layer_experts) == ("grouped", "te")
    fp32 = WorkloadSpec(64, 32, 32, 2, 2, 1, "balanced", dtype="float32", ffn=16)
    assert "bf16" in cutlass.unsupported(fp32, {})
    assert cutlass.unsupported(_layer_spec(), {}) is None
    assert cutlass.unsupported(_spec(dtype="float32"), {}) is None  # operator cells unchanged
    assert te.unsupported(fp32, {}) is None


@needs_mcore
def test_transformer_config_translation_for_layer_cells() -> None:
    from systems.megatron_common import transformer_config

    spec = _layer_spec(W=2)
    cfg = transformer_config(spec)
    assert cfg.hidden_size == spec.hidden == spec.out
    assert cfg.moe_ffn_hidden_size == cfg.ffn_hidden_size == spec.ffn
    assert cfg.activation_func is torch.nn.functional.gelu
    assert not cfg.gated_linear_unit and not cfg.add_bias_linear
    assert not cfg.use_te_activation_func and not cfg.bias_activation_fusion
    assert cfg.bf16 and cfg.params_dtype == torch.bfloat16
    assert cfg.num_moe_experts == spec.n_experts and cfg.moe_router_topk == spec.top_k
    assert cfg.expert_model_parallel_size == 2 and cfg.moe_token_dispatcher_type == "alltoall"
    assert cfg.moe_expert_capacity_factor is None and cfg.moe_grouped_gemm
    assert not cfg.moe_apply_probs_on_input and cfg.moe_latent_size is None
    assert transformer_config(_spec()).moe_ffn_hidden_size == _spec().out  # operator cells


def _ffn_weights(spec: WorkloadSpec, rank: int = 0):
    from harness.workload import make_rank_fc1

    dev = torch.device("cpu")
    return make_rank_fc1(spec, rank, dev).float(), make_rank_weights(spec, rank, dev).float()


@needs_mcore
def test_grouped_mlp_layout_is_what_grouped_mlp_reads() -> None:
    """weight1 [H, E*F], weight2 [E*F, H]; GroupedMLP.forward views them [E, H, F], [E, F, H]."""
    from harness.experts import ffn_experts
    from systems.megatron_common import grouped_mlp_layout

    spec = _layer_spec()
    w1, w2 = _ffn_weights(spec)
    E, H, F = w1.shape
    weight1, weight2 = grouped_mlp_layout(w1, w2)
    assert weight1.shape == (H, E * F) and weight2.shape == (E * F, H)
    assert torch.equal(weight1.view(E, H, -1), w1) and torch.equal(weight2.view(E, -1, H), w2)
    counts = [5, 0, 7, 3]
    x = torch.randn(sum(counts), H)
    probs = torch.rand(x.shape[0])
    # GroupedMLP's math on the viewed weights: fc1, gelu x probs, fc2 per expert
    v1, v2, ys, start = weight1.view(E, H, -1), weight2.view(E, -1, H), [], 0
    for e, c in enumerate(counts):
        h = torch.nn.functional.gelu(x[start : start + c] @ v1[e]) * probs[start : start + c, None]
        ys.append(h @ v2[e])
        start += c
    want = ffn_experts(x, counts, w1, w2) * probs[:, None]
    assert torch.allclose(torch.cat(ys), want, atol=1e-5)
    with pytest.raises(ValueError, match="W2"):
        grouped_mlp_layout(w1, w2.transpose(1, 2))


@needs_mcore
def test_te_mlp_layout_and_copy() -> None:
    """TEGroupedMLP: linear_fc1.weight{e} [F, H] = W1_e^T, linear_fc2.weight{e} [H, F] = W2_e^T."""
    from systems.megatron_common import copy_mlp_weights

    spec = _layer_spec()
    w1, w2 = _ffn_weights(spec)
    E, H, F = w1.shape
    fc1, fc2 = w1.transpose(1, 2), w2.transpose(1, 2)  # weight{e} = W_e^T
    experts = torch.nn.Module()  # parameters only, named as TEGroupedMLP's; no TE math imitated
    for name, shape in (("linear_fc1", (F, H)), ("linear_fc2", (H, F))):
        lin = torch.nn.Module()
        for e in range(E):
            lin.register_parameter(f"weight{e}", torch.nn.Parameter(torch.empty(shape)))
        experts.add_module(name, lin)
    copy_mlp_weights(experts, w1, w2)
    x = torch.randn(6, H)
    for e in range(E):
        a = experts.linear_fc1.get_parameter(f"weight{e}").data
        b = experts.linear_fc2.get_parameter(f"weight{e}").data
        assert torch.equal(a, fc1[e]) and torch.equal(b, fc2[e])
        y = torch.nn.functional.gelu(x @ a.t()) @ b.t()  # y = x W^T, TE's convention
        assert torch.allclose(y, torch.nn.functional.gelu(x @ w1[e]) @ w2[e], atol=1e-5)
    bad = torch.nn.Module()
    bad.add_module("linear_fc1", experts.linear_fc2)
    bad.add_module("linear_fc2", experts.linear_fc1)
    with pytest.raises(ValueError, match="weight0"):
        copy_mlp_weights(bad, w1, w2)


@needs_mcore
def test_copy_into_grouped_mlp_parameters() -> None:
    from systems.megatron_common import copy_mlp_weights

    spec = _layer_spec()
    w1, w2 = _ffn_weights(spec)
    E, H, F = w1.shape
    holder = torch.nn.Module()
    holder.weight1 = torch.nn.Parameter(torch.empty(H, E * F))
    holder.weight2 = torch.nn.Parameter(torch.empty(E * F, H))
    copy_mlp_weights(holder, w1, w2)
    assert torch.equal(holder.weight1.data.view(E, H, F), w1)
    assert torch.equal(holder.weight2.data.view(E, F, H), w2)


@needs_mcore
def test_topk_router_stub_matches_routing_tensors() -> None:
    from systems.megatron_common import FixedRouter, topk_to_dense

    spec = _layer_spec(W=2)
    r = routing_of(spec)
    probs, rmap = topk_to_dense(r.expert_ids[1], r.gate_weights[1], spec.n_experts)
    want_p, want_m = routing_tensors(spec, 1, torch.device("cpu"))
    assert torch.equal(probs, want_p) and torch.equal(rmap, want_m)
    router = FixedRouter()
    router.set_topk(r.expert_ids[1], r.gate_weights[1], spec.n_experts)
    p2, m2 = router(torch.zeros(spec.tokens_per_rank, 1, spec.hidden))
    assert torch.equal(p2, want_p) and torch.equal(m2, want_m)
    with pytest.raises(RuntimeError, match="set_topk"):
        router(torch.zeros(3, spec.hidden))


@needs_mcore
def test_layer_experts_come_from_megatrons_moe_spec() -> None:
    from megatron.core.transformer.moe.experts import GroupedMLP

    from systems.megatron_common import layer_experts_spec

    assert layer_experts_spec("grouped", 8).module is GroupedMLP
    if importlib.util.find_spec("transformer_engine") is None:
        with pytest.raises(RuntimeError, match="TEGroupedMLP"):
            layer_experts_spec("te", 8)
    else:
        from megatron.core.extensions.transformer_engine import (
            TEColumnParallelGroupedLinear,
            TERowParallelGroupedLinear,
        )

        te = layer_experts_spec("te", 8)
        assert te.submodules.linear_fc1 is TEColumnParallelGroupedLinear
        assert te.submodules.linear_fc2 is TERowParallelGroupedLinear
    with pytest.raises(ValueError, match="experts"):
        layer_experts_spec("sequential", 8)


@needs_mcore
def test_grouped_gemm_fallback_is_gmm_and_is_scoped() -> None:
    from megatron.core.transformer.moe import grouped_gemm_util as gg

    from harness.experts import expert_gemm
    from systems.megatron_common import TORCH_GMM, grouped_gemm_fallback

    before = gg.grouped_gemm
    with grouped_gemm_fallback() as real:
        assert real == (before is not None)
        gg.assert_grouped_gemm_is_available()  # what GroupedMLP's constructor asserts
    assert gg.grouped_gemm is before  # the availability check is restored
    if before is None:
        assert gg.ops is TORCH_GMM.ops
    x, w = torch.randn(9, 8), torch.randn(3, 8, 12)
    counts = torch.tensor([4, 0, 5])
    y = TORCH_GMM.ops.gmm(x, w, counts, trans_b=False)
    assert torch.allclose(y, expert_gemm(x, [4, 0, 5], w))
    yt = TORCH_GMM.ops.gmm(x, w.transpose(1, 2).contiguous(), counts, trans_b=True)
    assert torch.allclose(yt, y, atol=1e-6)


@pytest.mark.gpu
@needs_cuda
@needs_mcore
def test_megatron_cutlass_layer_on_gpu_matches_reference(tmp_path: Path) -> None:
    """A small FFN cell (T=256, H=128, F=64, E=4, bf16): the real MoELayer + GroupedMLP."""
    rows = _run_gpu(tmp_path, ["megatron_cutlass", "serial"], LAYER)
    print(json.dumps(rows, indent=1))
    for r in rows:
        assert r["status"] == "ok", r
        assert r["err"] < 8e-3 and r["scope"] == "layer", r
        assert r["latency_ms"] > 0 and r["compute_ms"] > 0 and r["comm_ms"] > 0, r
    impls = {r["impl"] for r in rows if r["system"] == "megatron_cutlass"}
    assert all("GroupedMLP" in i for i in impls), impls


@pytest.mark.gpu
@needs_cuda
@needs_mcore
def test_megatron_te_layer_on_gpu_matches_reference(tmp_path: Path) -> None:
    """The same FFN cell with TEGroupedMLP (TE GroupedLinear fc1 / fc2)."""
    pytest.importorskip("transformer_engine")
    rows = _run_gpu(tmp_path, ["megatron_te"], LAYER)
    print(json.dumps(rows, indent=1))
    for r in rows:
        assert r["status"] == "ok", r
        assert r["err"] < 8e-3 and r["scope"] == "layer", r
    assert all("TEGroupedMLP" in r["impl"] for r in rows), rows


def test_loaded_library_dir_reads_the_first_match_of_a_maps_text():
    from systems.megatron_common import loaded_library_dir

    maps = (
        "7f00-7f01 r-xp 00000000 08:01 12 /usr/lib/libc.so.6\n"
        "7f02-7f03 r--p 00000000 00:00 0 \n"
        "7f04-7f05 r-xp 00000000 08:01 13 /site/nvidia/cudnn/lib/libcudnn.so.9\n"
        "7f06-7f07 r-xp 00000000 08:01 14 /lib/x86_64-linux-gnu/libcudnn.so.9\n"
    )
    assert loaded_library_dir("libcudnn.so", maps) == "/site/nvidia/cudnn/lib"
    assert loaded_library_dir("libcudnn_graph", maps) is None


def test_pin_cudnn_leaves_a_user_setting_alone(monkeypatch):
    from systems.megatron_common import pin_cudnn_to_torch

    monkeypatch.setenv("CUDNN_PATH", "/opt/cudnn")
    monkeypatch.delenv("CUDNN_HOME", raising=False)
    assert pin_cudnn_to_torch() is None
    import os

    assert "CUDNN_HOME" not in os.environ
