"""The `capacity` param of megatron_cutlass / megatron_te: Megatron's drop-and-pad route.

CPU, with the real megatron-core (skipped without it): the choices and their one-line error;
operator cells skip `padded`; the no-drop capacity and its factor; the router stub applying
Megatron's capacity step; and the real MoELayer + GroupedMLP on the padded route over gloo
(W=1, 2): equal to the oracle with 0 dropped tokens and the recorded capacity, capturable at
W=1 by its capture_blocker, and a forced smaller capacity detected: the dropped (token, expert)
pairs recorded in extra and setup failing with their count.
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


def _padded_cell(ctx: RunContext, spec: WorkloadSpec, rank: int, name: str = "padded") -> dict:
    from harness.check import check
    from harness.measure import cell_inputs
    from systems.megatron_cutlass import MegatronCutlassSystem

    inputs, ref = cell_inputs(ctx, spec, [rank])
    system = MegatronCutlassSystem(ctx, {"permute_fusion": False, "capacity": "padded"})
    try:
        system.setup(inputs)
    except RuntimeError as exc:
        return {"cell": name, "routing": spec.routing, "error": str(exc), "extra": system.extra}
    first = check(system.forward(), ref, 8e-3)
    system.compute_only()
    system.comm_only()
    again = check(system.forward(), ref, 8e-3)  # state intact after the bounds
    return {
        "cell": name,
        "routing": spec.routing,
        "ok": [first.ok, again.ok],
        "extra": system.extra,
        "rows": list(system.op.disp.shape),
        "blocker": system.capture_blocker(),
        "impl": system.impl,
    }


def _capacity_worker(rank: int, W: int, init: str, out: str) -> None:
    """The real MoELayer + GroupedMLP on the CPU; Megatron's CUDA-stream D2H bookkeeping is
    patched out only for the dropless cell (the padded route never calls it)."""
    from megatron.core.transformer.moe import experts as mexperts
    from megatron.core.transformer.moe.token_dispatcher import MoEAlltoAllTokenDispatcher as D

    from harness.measure import cell_inputs
    from systems import megatron_common as mc
    from systems.megatron_cutlass import MegatronCutlassSystem

    D.cuda_dtoh_stream = object()  # __init__ makes a torch.cuda.Stream() when None
    mexperts.jit_fuser = lambda f: f  # the torch.compile'd activation runs eager
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=W)
    try:
        ctx = RunContext(rank, W, torch.device("cpu"), None, "gloo")
        E = 4 if W == 1 else 3
        res = [_padded_cell(ctx, _layer_spec(r, W, E), rank) for r in ROUTINGS]
        no_drop = mc.no_drop_capacity  # the test-only path: one row less than no-drop
        mc.no_drop_capacity = lambda s: (
            no_drop(s)[0] - 1,
            mc.capacity_factor_for(s, no_drop(s)[0] - 1),
        )
        res.append(_padded_cell(ctx, _layer_spec("stress_skew", W, E), rank, "forced"))
        mc.no_drop_capacity = no_drop

        def cpu_dtoh(self, point, tokens_per_expert=None):
            if point == self.cuda_dtoh_point:
                for name in ("input_splits", "output_splits", "output_splits_tp"):
                    v = getattr(self, name)
                    if isinstance(v, torch.Tensor):
                        setattr(self, name, v.numpy())
            return tokens_per_expert

        D._maybe_dtoh_and_synchronize = cpu_dtoh
        torch.cuda.current_device = lambda: "cpu"  # where the uneven all-to-all allocates
        inputs, _ = cell_inputs(ctx, _layer_spec("balanced", W, E), [rank])
        dropless = MegatronCutlassSystem(ctx, {"permute_fusion": False})
        dropless.setup(inputs)
        res.append({"cell": "dropless", "blocker": dropless.capture_blocker(), **dropless.extra})
        Path(f"{out}.{rank}").write_text(json.dumps(res))
    finally:
        dist.destroy_process_group()


@needs_mcore
@pytest.mark.parametrize("W", [1, 2])
def test_padded_layer_matches_the_oracle_on_cpu(tmp_path: Path, W: int) -> None:
    out = tmp_path / "capacity"
    init = f"tcp://127.0.0.1:{free_port()}"
    mp.spawn(_capacity_worker, args=(W, init, str(out)), nprocs=W, join=True)
    E = 4 if W == 1 else 3
    for rank in range(W):
        res = {
            (r["cell"], r.get("routing")): r for r in json.loads(Path(f"{out}.{rank}").read_text())
        }
        for routing in ROUTINGS:
            r = res[("padded", routing)]
            c = int(_counts(_layer_spec(routing, W, E)).max())
            assert r["ok"] == [True, True], r
            x = r["extra"]
            assert x["dropped_tokens"] == 0 and x["capacity"] == c, r
            assert x["expert_rows"] == W * c and r["rows"] == [E * W * c, 32], r
            assert x["capacity_factor"] > 0 and "drop-and-pad" in x["dispatcher"], r
            if W == 1:
                assert r["blocker"] is None, r
            else:
                assert "W > 1" in r["blocker"], r
        counts = _counts(_layer_spec("stress_skew", W, E))
        c = int(counts.max()) - 1
        forced = res[("forced", "stress_skew")]
        dropped = int((counts - c).clamp(min=0).sum())
        assert dropped > 0 and forced["extra"]["dropped_tokens"] == dropped, forced
        assert forced["extra"]["capacity"] == c, forced
        assert f"dropped {dropped} (token, expert) pairs at capacity {c}" in forced.get("error", "")
        dropless = res[("dropless", None)]
        assert "host" in dropless["blocker"] and "capacity" not in dropless, dropless


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
