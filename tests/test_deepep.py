"""The DeepEP baselines on the CPU: catalogue entries, skip rules, the configs, and deepep's glue.

deepep: every limit of DeepEP's low-latency kernels as a skip reason naming it, the RDMA size
hint, the packed FFN over the real rows of a [E, W*M, H] receive buffer, and the whole system at
W=1 against the float32 oracle with a stand-in deep_ep (the low-latency dispatch and combine's
contract: per-expert rows plus a count, a weighted combine). megatron_deepep: its skip rules
(W=1, EP sizes, the intranode kernels' limits). Both in the layer and models configs.
The real kernels run on a GPU only (the lead's GPU session).
"""

from __future__ import annotations

import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from hydra import compose, initialize_config_dir

from harness.check import check
from harness.config import register_configs
from harness.layout import rank_layout
from harness.measure import expand_grid
from harness.reference import dispatch_local, reference_local
from harness.system import CellInputs, RunContext, get_system
from harness.workload import (
    WorkloadSpec,
    make_rank_fc1,
    make_rank_weights,
    make_tokens,
    routing_of,
)
from systems import deepep
from systems.deepep import UPSTREAM, DeepEPSystem, ll_rdma_bytes, packed_ffn
from systems.megatron_deepep import MegatronDeepEPSystem

ROOT = Path(__file__).resolve().parents[1]
CPU = torch.device("cpu")


def _spec(**kw) -> WorkloadSpec:
    base = dict(
        tokens_per_rank=8192,
        hidden=4096,
        out=4096,
        ffn=2048,
        experts_per_rank=16,
        top_k=2,
        world_size=1,
        routing="balanced",
        dtype="bfloat16",
    )
    base.update(kw)
    if base["ffn"]:
        base["out"] = base["hidden"]
    return WorkloadSpec(**base)


@pytest.fixture
def h200(monkeypatch):
    """unsupported() as on one H200: 132 SMs, 141 GiB."""
    monkeypatch.setattr(deepep, "device_sms", lambda: 132)
    monkeypatch.setattr(deepep, "device_memory", lambda: 141 * 2**30)


def _compose(*overrides):
    register_configs()
    with initialize_config_dir(str(ROOT / "conf"), version_base="1.3"):
        return compose("config", overrides=list(overrides))


# catalogue -----------------------------------------------------------------------------------


def test_both_systems_are_gpu_baselines_that_name_the_upstream_commit() -> None:
    for name, cls in (("deepep", DeepEPSystem), ("megatron_deepep", MegatronDeepEPSystem)):
        info = get_system(name)
        assert info.load() is cls and info.needs_gpu and info.label
        assert "deep_ep" in info.optional_imports and cls.layer_scope
    assert "567632d" in UPSTREAM
    assert get_system("deepep").min_ranks == 1
    assert get_system("megatron_deepep").min_ranks == 2
    gpu = RunContext(0, 1, torch.device("cuda"))  # only the device type is read
    assert "at least 2 ranks" in get_system("megatron_deepep").unavailable_reason(gpu, 1)
    cpu = RunContext(0, 1, CPU)
    assert "CUDA" in get_system("deepep").unavailable_reason(cpu, 1)


def test_loading_the_classes_imports_no_deep_ep() -> None:
    sys.modules.pop("deep_ep", None)
    get_system("deepep").load()
    get_system("megatron_deepep").load()
    assert "deep_ep" not in sys.modules


# deepep's skip rules -------------------------------------------------------------------------


def test_deepep_takes_the_h4096_layer_cells(h200) -> None:
    for E in (16, 64):
        assert DeepEPSystem.unsupported(_spec(experts_per_rank=E), {}) is None
    assert DeepEPSystem.unsupported(_spec(world_size=8, experts_per_rank=8), {}) is None


@pytest.mark.parametrize(
    "kw, limit",
    [
        ({"ffn": 0}, "operator cells"),
        ({"hidden": 768}, "hidden 768 is not one its kernels are compiled for"),
        ({"hidden": 768}, "launch.cuh:114-135"),
        ({"top_k": 12}, "top_k 12 > 11 (kNumMaxTopK, csrc/kernels/internode_ll.cu:494)"),
        ({"dtype": "float16"}, "takes bf16 only (csrc/deep_ep.cpp:1550)"),
        ({"experts_per_rank": 1, "top_k": 1}, "internode_ll.cu:282"),
        ({"tokens_per_rank": 6}, "W * M = 6 is not a multiple of 4"),
        (
            {"experts_per_rank": 1024, "world_size": 2},
            "at most 14 (csrc/kernels/internode_ll.cu:383)",
        ),
        ({"tokens_per_rank": 16384, "hidden": 8192, "experts_per_rank": 128}, "more than the GPU"),
    ],
)
def test_deepep_skips_each_limit_with_where_it_is(h200, kw, limit) -> None:
    reason = DeepEPSystem.unsupported(_spec(**kw), {})
    assert reason is not None and limit in reason


def test_deepep_names_every_limit_a_cell_exceeds(h200) -> None:
    reason = DeepEPSystem.unsupported(_spec(hidden=768, top_k=12, dtype="float32"), {})
    assert "hidden 768" in reason and "top_k 12" in reason and "dtype float32" in reason


def test_the_rdma_size_hint_is_deepeps_layout() -> None:
    """csrc/config.hpp LowLatencyLayout for M=128, H=4096, 8 experts (the vendor smoke's cell):
    messages of 16 + 8192 (dispatch) and 128 + 8192 (combine) bytes; the combine's send and
    receive buffers (8 x 128 messages) dominate; two of each, two 128-byte signal buffers, plus
    one alignment unit."""
    two_buffers = 2 * (8 * 128 * 8320 + 8 * 128 * 8320 + 128)
    assert ll_rdma_bytes(128, 4096, 1, 8) == two_buffers + 128
    # DeepSeek's H=7168: 56 bf16 pairs per combine message, 16 experts x 64 tokens
    assert ll_rdma_bytes(64, 7168, 2, 16) == 2 * (2 * 16 * 64 * (224 + 14336) + 128) + 128


# deepep's experts over the real rows ---------------------------------------------------------


def test_packed_ffn_computes_only_the_real_rows_of_each_expert() -> None:
    torch.manual_seed(0)
    E, S, H, F = 3, 8, 16, 24
    recv = torch.randn(E, S, H)
    count = torch.tensor([3, 0, 5], dtype=torch.int32)
    w1, w2 = torch.randn(E, H, F), torch.randn(E, F, H)
    y = torch.full((E * S + 1, H), 7.0)
    out = packed_ffn(recv, count, w1, w2, torch.arange(10), y)
    assert out.shape == (E, S, H)
    for e, c in enumerate(count.tolist()):
        want = torch.nn.functional.gelu(recv[e, :c] @ w1[e]) @ w2[e]
        torch.testing.assert_close(out[e, :c], want, rtol=1e-4, atol=1e-4)
        assert (out[e, c:] == 7.0).all()  # rows past the count are not written


class _FakeBuffer:
    """DeepEP's low-latency contract at W=1 in torch: dispatch -> recv [E, M, H] (each expert's
    rows first, in a scrambled order as its atomics give them), count [E] int32, a handle with
    the source token of each slot; combine -> out[t] = sum_j w[t, j] y[e(t, j), slot(t, j)]."""

    made: list = []

    def __init__(self, group, nvl, rdma, low_latency_mode, num_qps_per_rank, explicitly_destroy):
        import os

        assert low_latency_mode and explicitly_destroy and nvl == 0
        self.group, self.num_rdma_bytes, self.qps = group, rdma, num_qps_per_rank
        self.nvshmem_qp_depth = int(os.environ.get("NVSHMEM_QP_DEPTH", "1024"))
        self.destroyed = False
        _FakeBuffer.made.append(self)

    get_low_latency_rdma_size_hint = staticmethod(ll_rdma_bytes)

    def destroy(self):
        self.destroyed = True

    def clean_low_latency_buffer(self, M, H, G):
        assert not self.destroyed

    def low_latency_dispatch(self, x, ids, M, G, use_fp8=True):
        assert not use_fp8 and ids.dtype == torch.int64 and x.shape[0] <= M
        assert self.nvshmem_qp_depth >= 2 * (M + 1)  # deep_ep/buffer.py:602
        E = G  # one rank
        recv = torch.full((E, M, x.shape[1]), float("nan"), dtype=x.dtype)
        src = torch.full((E, M), -1, dtype=torch.int32)
        count = torch.zeros(E, dtype=torch.int32)
        for e in range(E):
            t = (ids == e).any(1).nonzero().squeeze(1).flip(0)
            recv[e, : t.numel()], src[e, : t.numel()], count[e] = x[t], t.int(), t.numel()
        return recv, count, (src, None, M, x.shape[1], G), None, None

    def low_latency_combine(self, y, ids, w, handle):
        src = handle[0]
        assert w.dtype == torch.float32 and w.is_contiguous()
        out = torch.zeros(ids.shape[0], y.shape[2], dtype=torch.float32)
        for t in range(ids.shape[0]):
            for j, e in enumerate(ids[t].tolist()):
                slot = int((src[e] == t).nonzero())
                out[t] += w[t, j] * y[e, slot].float()
        return out.to(y.dtype), None, None


@pytest.fixture
def fake_deep_ep(monkeypatch):
    monkeypatch.setitem(
        sys.modules, "deep_ep", SimpleNamespace(Buffer=_FakeBuffer, topk_idx_t=torch.int64)
    )
    monkeypatch.setattr(deepep._Held, "buffer", None)
    monkeypatch.setenv("NVSHMEM_QP_DEPTH", "1024")
    monkeypatch.setenv(deepep.PLAN_ENV, "")  # no run's plan (sized per cell); undone after
    _FakeBuffer.made = []
    yield
    from harness import teardown

    teardown._pending.clear()


def _inputs(spec: WorkloadSpec) -> CellInputs:
    lay = rank_layout(spec, 0)
    routing = routing_of(spec)
    return CellInputs(
        spec,
        lay,
        make_tokens(spec, 0, CPU),
        make_rank_weights(spec, 0, CPU),
        dispatch_local(spec, lay, CPU),
        make_rank_fc1(spec, 0, CPU),
        routing.expert_ids[0].clone(),
        routing.gate_weights[0].float().clone(),
    )


def _deepep(spec: WorkloadSpec) -> DeepEPSystem:
    system = DeepEPSystem(RunContext(0, 1, CPU), {})
    system.setup([_inputs(spec)])
    return system


def test_deepep_matches_the_oracle_through_the_low_latency_contract(fake_deep_ep) -> None:
    """W=1, float32 on the CPU (torch._grouped_mm takes fp32 there): dispatch, packed FFN and
    the gate-weighted combine give the reference layer, every step and the bounds."""
    spec = _spec(tokens_per_rank=40, hidden=32, ffn=48, experts_per_rank=4, dtype="float32")
    spec = WorkloadSpec(**{**spec.__dict__, "routing": "moderate_skew", "seed": 3})
    system = _deepep(spec)
    ref = reference_local(spec, 0, CPU)
    for _ in range(2):
        res = check(system.forward(), ref, 1e-4)
        assert res.ok, res.message
    assert system.comm_only().shape == (40, 32)  # timing only: DeepEP's slot order may differ
    assert system.compute_only().shape == (4, 40, 32)
    assert system.capture_blocker() is None and system.extra["host_syncs"] == 0
    assert system.extra["packed_rows"] == 40 * 2 and system.transport == "nvshmem"


def test_deepep_holds_one_buffer_and_grows_it(fake_deep_ep) -> None:
    small = _spec(tokens_per_rank=40, hidden=32, ffn=48, experts_per_rank=4, dtype="float32")
    first = _deepep(small).step.buffer
    assert _deepep(small).step.buffer is first  # the same cell: reused
    big = WorkloadSpec(**{**small.__dict__, "tokens_per_rank": 600})  # 2 (M + 1) > 1024
    grown = _deepep(big).step.buffer
    assert grown is not first and first.destroyed and not grown.destroyed
    assert grown.nvshmem_qp_depth == 1202 and grown.qps == 4
    assert grown.num_rdma_bytes == ll_rdma_bytes(600, 32, 1, 4)
    assert _deepep(small).step.buffer is grown  # a smaller cell fits the grown one
    assert len(_FakeBuffer.made) == 2


# megatron_deepep's skip rules ----------------------------------------------------------------


def test_megatron_deepep_takes_intranode_layer_cells() -> None:
    for W in (2, 4, 8):
        assert MegatronDeepEPSystem.unsupported(_spec(world_size=W), {}) is None


@pytest.mark.parametrize(
    "kw, limit",
    [
        ({"world_size": 1}, "'Unsupported number of EP ranks: 1'"),
        ({"world_size": 3}, "deep_ep/buffer.py:245-259"),
        ({"world_size": 2, "ffn": 0}, "operator cells"),
        ({"world_size": 2, "hidden": 8192}, "intranode.cu:290"),
        ({"world_size": 2, "hidden": 1000}, "multiple of 16"),
        ({"world_size": 2, "experts_per_rank": 129}, "intranode.cu:154"),
        ({"world_size": 2, "dtype": "float16"}, "combine takes bf16 only"),
    ],
)
def test_megatron_deepep_skips_each_limit_with_where_it_is(kw, limit) -> None:
    reason = MegatronDeepEPSystem.unsupported(_spec(**kw), {"permute_fusion": "auto"})
    assert reason is not None and limit in reason


# configs -------------------------------------------------------------------------------------


def test_the_layer_experiment_runs_both_systems_on_every_workload(h200) -> None:
    cells = expand_grid(_compose("experiment=layer"), 2)
    workloads = {c["cell_hash"] for c in cells if c["system"] == "serial"}
    for name, params in (("deepep", {}), ("megatron_deepep", {"permute_fusion": "auto"})):
        mine = [c for c in cells if c["system"] == name]
        assert len(mine) == len(workloads) and all(c["params"] == params for c in mine)
    spec = _spec(world_size=2, tokens_per_rank=16384, hidden=8192, experts_per_rank=8)
    assert DeepEPSystem.unsupported(spec, {}) is None
    assert "intranode.cu:290" in MegatronDeepEPSystem.unsupported(spec, {"permute_fusion": "auto"})


def test_the_models_experiment_runs_both_systems_and_skips_them_at_w1() -> None:
    from experiments import models as exp

    cfg = _compose("experiment=models")
    cells = exp.cells(cfg, 1)
    exp.validate(cfg, cells, 132)
    ctx = RunContext(0, 1, torch.device("cuda"))  # only the device type is read
    for cell in (c for c in cells if c["system"] in ("deepep", "megatron_deepep")):
        reason = exp.skip_reason(ctx, cell, exp.spec_of(cell))
        if cell["system"] == "megatron_deepep":
            assert "at least 2 ranks" in reason
        else:  # optional import first where deep_ep is absent; else the hidden size
            assert "deep_ep" in reason or f"hidden {cell['hidden']}" in reason
    assert {c["system"] for c in cells} >= {"deepep", "megatron_deepep"}
    for name in ("m_gpt", "m_bert", "m_transxl"):  # hidden 768 / 512: no low-latency kernel
        m = next(exp.spec_of(c) for c in cells if c["model"] == name)
        assert "is not one its kernels are compiled for" in DeepEPSystem.unsupported(
            m.moe_spec(1, 0), {}
        )
