"""The real Megatron-core MoELayer + all-to-all dispatcher + GroupedMLP on the CPU over gloo.

One spawn per world size (W=1, 2; importing megatron-core costs each process about 9 s, so
every check of a world size shares its processes): Megatron's CUDA-stream D2H bookkeeping is
replaced by its CPU equivalent (splits as host arrays), its collectives allocate on the CPU and
the torch.compile'd activation runs eager; everything else is Megatron's code.
- dropless (our W1/W2 copied in, fed the harness routing): equal to the float32 oracle; the
  bounds run and leave the layer intact; the dispatched rows are the harness's;
- padded (the capacity param): equal to the oracle with 0 dropped tokens at the recorded
  capacity, capturable at W=1 by its capture_blocker, and a forced smaller capacity detected
  (the dropped (token, expert) pairs recorded in extra and setup failing with their count);
- W=2: the parallel state is initialised once (idempotent) and a different EP size is refused.
Skipped without megatron-core.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from harness.system import RunContext
from harness.workload import WorkloadSpec, routing_of
from tests.multigpu import free_port
from tests.test_megatron_capacity import ROUTINGS, _layer_spec, needs_mcore

pytestmark = needs_mcore  # evaluated before the fixture spawns anything


def megatron_on_cpu() -> None:
    """This process only: Megatron's dispatcher and experts made to run on the CPU."""
    from megatron.core.transformer.moe import experts as mexperts
    from megatron.core.transformer.moe.token_dispatcher import MoEAlltoAllTokenDispatcher as D

    def cpu_dtoh(self, point, tokens_per_expert=None):
        if point == self.cuda_dtoh_point:
            for name in ("input_splits", "output_splits", "output_splits_tp"):
                v = getattr(self, name)
                if isinstance(v, torch.Tensor):
                    setattr(self, name, v.numpy())
        return tokens_per_expert

    D.cuda_dtoh_stream = object()  # __init__ makes a torch.cuda.Stream() when None
    D._maybe_dtoh_and_synchronize = cpu_dtoh  # the padded route never calls it
    torch.cuda.current_device = lambda: "cpu"  # where the W>1 counts all-gather and the
    # uneven all-to-all allocate their outputs
    mexperts.jit_fuser = lambda f: f


def _dropless_cell(ctx: RunContext, spec: WorkloadSpec, rank: int) -> dict:
    from harness.check import check
    from harness.measure import cell_inputs
    from systems.megatron_cutlass import MegatronCutlassSystem

    inputs, ref = cell_inputs(ctx, spec, [rank])
    (inp,) = inputs
    system = MegatronCutlassSystem(ctx, {"permute_fusion": False})
    system.setup(inputs)
    y_out = system.forward()
    c = check(y_out, ref, 8e-3)
    again = check(system.forward(), ref, 8e-3)
    y, unperm = system.compute_only()
    disp, back = system.comm_only()
    after = check(system.forward(), ref, 8e-3)  # state intact after the bounds
    R = spec.tokens_per_rank * spec.top_k  # rows sent; received differ per rank
    return {
        "routing": spec.routing,
        "shape": list(y_out.shape),
        "dtype": str(y_out.dtype),
        "ok": [c.ok, again.ok, after.ok],
        "impl": system.impl,
        "bounds": [
            list(y.shape) == [inp.x_recv.shape[0], spec.hidden],
            list(unperm.shape) == [spec.tokens_per_rank, 1, spec.hidden],
            torch.equal(disp, system.step.op.disp),
            list(back.shape) == [R, spec.hidden],
        ],
        "disp_is_x_recv": torch.equal(system.step.op.disp, inp.x_recv),
        "extra": system.extra,
        "blocker": system.capture_blocker(),
    }


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
        "rows": list(system.step.op.disp.shape),
        "blocker": system.capture_blocker(),
    }


def _parallel_state(W: int) -> dict:
    from megatron.core import parallel_state as ps

    from systems.megatron_common import ensure_parallel_state

    ensure_parallel_state(W)
    ensure_parallel_state(W)  # idempotent: no new groups, no error
    res = {
        "ep": ps.get_expert_model_parallel_world_size(),
        "tp": ps.get_tensor_model_parallel_world_size(),
    }
    try:
        ensure_parallel_state(2 * W)
        res["mismatch"] = "no error"
    except ValueError as exc:
        res["mismatch"] = str(exc)
    return res


def _worker(rank: int, W: int, init: str, out: str) -> None:
    """Every cell of this world size on rank `rank`, written to out.<rank> as JSON."""
    from systems import megatron_common as mc

    megatron_on_cpu()
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=W)
    try:
        ctx = RunContext(rank, W, torch.device("cpu"), None, "gloo")
        E = 4 if W == 1 else 3
        res = {"dropless": [_dropless_cell(ctx, _layer_spec(r, W, E), rank) for r in ROUTINGS]}
        res["padded"] = [_padded_cell(ctx, _layer_spec(r, W, E), rank) for r in ROUTINGS]
        no_drop = mc.no_drop_capacity  # the test-only path: one row less than no-drop
        mc.no_drop_capacity = lambda s: (
            no_drop(s)[0] - 1,
            mc.capacity_factor_for(s, no_drop(s)[0] - 1),
        )
        res["forced"] = _padded_cell(ctx, _layer_spec("stress_skew", W, E), rank, "forced")
        mc.no_drop_capacity = no_drop
        res["parallel_state"] = _parallel_state(W)
        Path(f"{out}.{rank}").write_text(json.dumps(res))
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module", params=[1, 2], ids=["W1", "W2"])
def ranks(request, tmp_path_factory) -> tuple[int, list[dict]]:
    """(W, every rank's results) of one spawn of W gloo processes."""
    W = request.param
    out = tmp_path_factory.mktemp(f"megatron_w{W}") / "res"
    init = f"tcp://127.0.0.1:{free_port()}"
    mp.spawn(_worker, args=(W, init, str(out)), nprocs=W, join=True)
    return W, [json.loads(Path(f"{out}.{r}").read_text()) for r in range(W)]


def _counts(spec: WorkloadSpec) -> torch.Tensor:
    """Tokens each rank routes to each global expert, [W, G], counted here independently."""
    ids = routing_of(spec).expert_ids
    return torch.stack([torch.bincount(r.flatten(), minlength=spec.n_experts) for r in ids])


def test_dropless_layer_matches_the_oracle_and_survives_its_bounds(ranks) -> None:
    W, res = ranks
    for rank_res in res:
        for r in rank_res["dropless"]:
            assert r["ok"] == [True, True, True], r
            assert r["shape"] == [64, 32] and r["dtype"] == "torch.bfloat16", r
            assert all(r["bounds"]), r
            assert r["disp_is_x_recv"], r  # Megatron's dispatched rows == the harness's
            assert "GroupedMLP" in r["impl"] and r["extra"]["experts"] == "GroupedMLP", r
            assert "host" in r["blocker"] and "capacity" not in r["extra"], r


def test_padded_layer_matches_the_oracle_and_a_smaller_capacity_is_detected(ranks) -> None:
    W, res = ranks
    E = 4 if W == 1 else 3
    for rank_res in res:
        for r in rank_res["padded"]:
            c = int(_counts(_layer_spec(r["routing"], W, E)).max())
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
        forced = rank_res["forced"]
        dropped = int((counts - c).clamp(min=0).sum())
        assert dropped > 0 and forced["extra"]["dropped_tokens"] == dropped, forced
        assert forced["extra"]["capacity"] == c, forced
        assert f"dropped {dropped} (token, expert) pairs at capacity {c}" in forced.get("error", "")


def test_parallel_state_is_initialised_once(ranks) -> None:
    W, res = ranks
    for rank_res in res:
        ps = rank_res["parallel_state"]
        assert ps["ep"] == W and ps["tp"] == 1, ps
        assert f"EP size {2 * W}" in ps["mismatch"], ps
