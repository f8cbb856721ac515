"""The `capacity` param of megatron_cutlass / megatron_te: Megatron's drop-and-pad route.

CPU, with the real megatron-core (skipped without it): the choices and their one-line error;
operator cells skip `padded`; the no-drop capacity and its factor; the router stub applying
Megatron's capacity step. The real MoELayer on the padded route over gloo (W=1, 2):
tests/test_megatron_cpu_layer.py. GPU: the padded layer captured in a CUDA graph.
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from harness.measure import system_points
from harness.system import RunContext, get_system
from harness.workload import WorkloadSpec, routing_of
from tests.multigpu import free_port

HAVE_MCORE = importlib.util.find_spec("megatron") is not None
needs_mcore = pytest.mark.skipif(not HAVE_MCORE, reason="megatron-core is not installed")
SYSTEMS = ("megatron_cutlass", "megatron_te")
ROUTINGS = ("balanced", "stress_skew")


def _layer_spec(routing: str = "stress_skew", W: int = 1, E: int = 4) -> WorkloadSpec:
    return WorkloadSpec(
        tokens_per_rank=64,
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


def _counts(spec: WorkloadSpec) -> torch.Tensor:
    """Tokens each rank routes to each global expert, [W, G], counted here independently."""
    ids = routing_of(spec).expert_ids
    return torch.stack([torch.bincount(r.flatten(), minlength=spec.n_experts) for r in ids])


@pytest.mark.parametrize("name", SYSTEMS)
def test_capacity_choices_and_their_one_line_error(name: str) -> None:
    cls = get_system(name).load()
    assert cls.PARAMS["capacity"] == "dropless"
    spec = _layer_spec()
    for ok in ("dropless", "padded"):
        cls.validate(spec, {**cls.PARAMS, "capacity": ok}, 0)
    with pytest.raises(ValueError) as exc:
        cls.validate(spec, {**cls.PARAMS, "capacity": "dropped"}, 0)
    msg = str(exc.value)
    assert "\n" not in msg and "capacity must be one of dropless, padded" in msg, msg
    points = system_points(name, {"sweep": {"capacity": ["dropless", "padded"]}})
    assert [p["capacity"] for p in points] == ["dropless", "padded"]
    get_system("megatron_deepep").load().validate(spec, {"permute_fusion": "auto"}, 0)


@pytest.mark.parametrize("name", SYSTEMS)
def test_padded_is_a_layer_route(name: str) -> None:
    cls = get_system(name).load()
    operator = WorkloadSpec(64, 32, 40, 4, 2, 1, "balanced", dtype="bfloat16")
    assert "layer route" in cls.unsupported(operator, {"capacity": "padded"})
    assert cls.unsupported(operator, {"capacity": "dropless"}) is None
    assert cls.unsupported(_layer_spec(), {"capacity": "padded"}) is None


@needs_mcore
@pytest.mark.parametrize("W", [1, 3])
def test_no_drop_capacity_is_the_busiest_rank_and_expert(W: int) -> None:
    from systems.megatron_common import capacity_factor_for, megatron_capacity, no_drop_capacity

    spec = _layer_spec("stress_skew", W=W, E=4)
    capacity, factor = no_drop_capacity(spec)
    assert capacity == int(_counts(spec).max()) > 1
    assert megatron_capacity(spec, factor) == capacity
    # one row fewer is the largest capacity that drops a token
    assert megatron_capacity(spec, capacity_factor_for(spec, capacity - 1)) == capacity - 1
    with pytest.raises(ValueError, match="capacity"):
        capacity_factor_for(spec, 0)


@needs_mcore
def test_router_stub_applies_megatrons_capacity_step() -> None:
    """Padded to capacity c: every expert column holds exactly c tokens; the routed pairs past
    c are dropped, the rest keep their gate weights and the padding has weight 0."""
    from systems.megatron_common import (
        FixedRouter,
        capacity_factor_for,
        topk_to_dense,
        transformer_config,
    )

    spec = _layer_spec("stress_skew")
    r = routing_of(spec)
    counts = _counts(spec)[0]
    c = int(counts.max()) - 1
    cfg = transformer_config(
        spec,
        moe_expert_capacity_factor=capacity_factor_for(spec, c),
        moe_pad_expert_input_to_capacity=True,
    )
    router = FixedRouter(cfg)
    router.set_topk(r.expert_ids[0], r.gate_weights[0], spec.n_experts)
    probs, rmap = router(torch.zeros(spec.tokens_per_rank, 1, spec.hidden))
    want_p, want_m = topk_to_dense(r.expert_ids[0], r.gate_weights[0], spec.n_experts)
    assert (rmap.sum(0) == c).all()
    kept = want_m & rmap
    assert int((want_m & ~rmap).sum()) == int((counts - c).clamp(min=0).sum()) > 0
    assert torch.equal(probs[kept], want_p[kept]) and not probs[rmap & ~want_m].any()
    assert FixedRouter(transformer_config(spec)).token_dropping(want_p, want_m)[1] is want_m


def _gpu_capture_worker(rank: int, init: str, out: str, names: list[str]) -> None:
    """One NCCL process on cuda:0: each system's padded layer checked eagerly, captured by the
    harness's graphs.capture, replayed and checked again (permute_fusion auto)."""
    from harness.check import check
    from harness.graphs import capture
    from harness.measure import cell_inputs

    torch.cuda.set_device(0)
    dev = torch.device("cuda", 0)
    dist.init_process_group("nccl", init_method=init, rank=0, world_size=1, device_id=dev)
    try:
        ctx = RunContext(0, 1, dev, None, "nccl")
        spec = WorkloadSpec(256, 128, 128, 4, 2, 1, "stress_skew", dtype="bfloat16", ffn=64)
        inputs, ref = cell_inputs(ctx, spec, [0])
        res = []
        for name in names:
            system = get_system(name).load()(ctx, {"capacity": "padded"})
            system.setup(inputs)
            eager = check(system.forward(), ref, 8e-3)
            graph = capture(system.timed, dev)
            graph.replay()
            torch.cuda.synchronize()
            res.append(
                {
                    "system": name,
                    "ok": [eager.ok, check(graph.out, ref, 8e-3).ok],
                    "blocker": system.capture_blocker(),
                    "extra": system.extra,
                }
            )
        Path(out).write_text(json.dumps(res))
    finally:
        dist.destroy_process_group()


@pytest.mark.gpu
@needs_mcore
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_padded_layer_captures_in_a_cuda_graph(tmp_path: Path) -> None:
    names = ["megatron_cutlass"]
    names += ["megatron_te"] if importlib.util.find_spec("transformer_engine") else []
    out = tmp_path / "capture.json"
    init = f"tcp://127.0.0.1:{free_port()}"
    mp.spawn(_gpu_capture_worker, args=(init, str(out), names), nprocs=1, join=True)
    for r in json.loads(out.read_text()):
        assert r["ok"] == [True, True] and r["blocker"] is None, r
        assert r["extra"]["dropped_tokens"] == 0, r
