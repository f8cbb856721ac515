"""The overlap system's parameters on the CPU (systems/overlap/params.py): one frozen type, its
one-line validation per knob, the reasons a valid cell is skipped, and setup handing the resolved
knobs to the played ranks and the runner."""

import subprocess
import sys
from dataclasses import FrozenInstanceError, asdict
from types import SimpleNamespace

import pytest
import torch

from harness.measure import system_points
from harness.system import RunContext
from harness.workload import WorkloadSpec
from systems.overlap import system as osys
from systems.overlap.params import OverlapParams

P = osys.OverlapSystem.PARAMS


def _spec(ffn=0, world_size=4, dtype="bfloat16"):
    return WorkloadSpec(256, 64, 64, 4, 2, world_size, "balanced", dtype=dtype, ffn=ffn)


def _bad(params: dict, spec=None) -> str:
    """The one-line message validate gives for these params (on a 132-SM GPU)."""
    with pytest.raises(ValueError) as exc:
        osys.OverlapSystem.validate(spec or _spec(), {**P, **params}, 132)
    assert "\n" not in str(exc.value)
    return str(exc.value)


def _resolved(monkeypatch, params: dict, spec=None) -> OverlapParams:
    """The resolved knobs setup hands the played ranks for these params (loopback, CPU)."""
    seen = {}

    class FakeLoopback:
        timed_rank = 0

        def __init__(self, ranks, k):
            seen["k"] = k
            tile = SimpleNamespace(block_n=1, block_k=1)
            self.runner, self.facts = SimpleNamespace(tile=tile, residency=None), {}

    monkeypatch.setattr(osys.steps, "PlayedOperatorStep", FakeLoopback)
    ctx = RunContext(rank=0, world_size=1, device=torch.device("cpu"))
    sysm = osys.OverlapSystem(ctx, {**params, "transport": "loopback"})
    sysm.setup([SimpleNamespace(spec=spec or _spec())])
    return seen["k"]


def test_the_params_are_one_frozen_type_with_eight_knobs_importable_without_triton():
    assert P == asdict(OverlapParams())
    keys = ["ccta", "mgb", "tile_m", "transport", "layout", "order", "consumer", "dispatch"]
    assert list(P) == keys
    assert P == {
        "ccta": 16,
        "mgb": 1,
        "tile_m": 128,
        "transport": "",
        "layout": "aligned",
        "order": "auto",
        "consumer": "own",
        "dispatch": "auto",
    }
    with pytest.raises(FrozenInstanceError):
        OverlapParams().ccta = 8  # type: ignore[misc]
    code = "import sys, systems.overlap.params; assert 'triton' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_an_unknown_or_retired_knob_is_a_one_line_error_naming_the_accepted_ones():
    for knob in ("local", "swizzle", "backoff_ns", "handshake", "handshake_stream"):
        with pytest.raises(ValueError) as exc:
            OverlapParams.from_dict({**P, knob: 0})
        msg = str(exc.value)
        assert msg.startswith(f"overlap has no parameter {knob!r}; it accepts: ccta, consumer")
        assert "\n" not in msg
        with pytest.raises(ValueError, match=f"no parameter '{knob}'"):
            system_points("overlap", {"params": {knob: 0}})


def test_every_kept_choice_validates_and_a_bad_one_is_named_in_one_line():
    ok = [
        {"layout": "compact"},
        {"order": "remote_first"},
        {"order": "expert"},
        {"consumer": "shared", "ccta": 132},
        {"tile_m": 64},
        {"transport": "nvshmem"},
        {"ccta": "auto", "mgb": "auto"},
    ]
    for params in ok:
        osys.OverlapSystem.validate(_spec(), {**P, **params}, 132)
    assert (
        _bad({"layout": "packed"})
        == "overlap: layout must be one of aligned, compact, got 'packed'"
    )
    assert _bad({"order": "tail"}) == (
        "overlap: order must be one of remote_first, expert, auto, got 'tail'"
    )
    assert _bad({"consumer": "both"}) == "overlap: consumer must be one of own, shared, got 'both'"
    assert _bad({"transport": "ib"}).startswith("overlap: unknown transport 'ib'; choices:")
    assert _bad({}, _spec(dtype="float32")) == (
        "overlap: dtype must be float16 or bfloat16, got float32"
    )
    odd = WorkloadSpec(256, 60, 64, 4, 2, 4, "balanced", dtype="bfloat16")
    assert _bad({}, odd) == "overlap: K and N must be multiples of 8 (16-byte rows)"


def test_consumer_bounds_ccta():
    # own: the consumer's SMs come out of the producer's, so ccta < SMs; shared: ccta <= SMs
    assert "ccta=132 must be in [1, 132) or 'auto'" in _bad({"ccta": 132})
    assert "ccta=133 must be in [1, 132] with consumer=shared" in _bad(
        {"consumer": "shared", "ccta": 133}
    )
    osys.OverlapSystem.validate(_spec(), {**P, "ccta": 500}, 0)  # SM count unknown: no bound


def test_refuse_names_every_run_the_transport_and_dispatch_cannot_make():
    """Before any process starts: (params, spec, processes, device) -> a word of the error, or
    None where the run can go."""
    loop, layer = {**P, "transport": "loopback"}, _spec(ffn=128)
    cases = [
        (loop, layer, 2, "cuda", "plays every rank in one process"),  # issue 59's SIGSEGV
        (loop, _spec(), 2, "cpu", "plays every rank in one process"),
        ({**P, "transport": "p2p"}, _spec(), 1, "cuda", "needs one process per rank"),
        ({**P, "transport": "shm"}, _spec(), 2, "cuda", "cannot run on cuda"),
        ({**P, "transport": "p2p"}, _spec(), 2, "cpu", "cannot run on cpu"),
        ({**loop, "dispatch": "nccl"}, layer, 1, "cuda", "nccl needs one process per rank"),
        ({**P, "dispatch": "device"}, layer, 2, "cuda", None),  # harness/dispatch_peer.py
        ({**P, "ccta": 1000}, _spec(), 1, "cpu", "at most 16"),
        ({**loop, "dispatch": "device"}, layer, 1, "cuda", None),
        ({**P, "dispatch": "device"}, _spec(), 2, "cuda", None),  # operator cells never dispatch
        ({**P, "dispatch": "nccl"}, layer, 2, "cpu", None),  # shm, the NCCL-style dispatch
        ({**P, "transport": "p2p", "layout": "compact"}, layer, 2, "cuda", None),
        ({**P, "ccta": "auto"}, _spec(), 1, "cpu", None),
    ]
    for params, spec, processes, device, word in cases:
        if word is None:
            osys.OverlapSystem.refuse(spec, params, processes, device)
            continue
        with pytest.raises(ValueError, match=word) as exc:
            osys.OverlapSystem.refuse(spec, params, processes, device)
        assert "\n" not in str(exc.value)


def test_setup_hands_the_resolved_knobs_to_the_played_ranks(monkeypatch):
    for layout in ("aligned", "compact"):
        k = _resolved(monkeypatch, {"layout": layout, "order": "expert", "consumer": "shared"})
        assert (k.layout, k.order, k.consumer) == (layout, "expert", "shared")
        assert (k.ccta, k.mgb, k.tile_m) == (16, 1, 128)


def test_the_runner_gets_the_kept_knobs_only(monkeypatch):
    seen = {}
    fake = SimpleNamespace(OverlapRunner=lambda *a, **kw: seen.update(kw) or "r")
    monkeypatch.setitem(sys.modules, "systems.overlap.runner", fake)
    k = OverlapParams(ccta=8, mgb=2, order="expert", consumer="shared")
    from systems.overlap.rank_experts import make_runner

    gpu_weights = SimpleNamespace(device=torch.device("cuda"))  # no interpreter settings
    plan, transport = SimpleNamespace(world_size=2), SimpleNamespace(world=2)
    assert make_runner(plan, gpu_weights, transport, k) == "r"
    with pytest.raises(ValueError, match="a plan of W=2 on a transport of 1"):
        make_runner(plan, gpu_weights, SimpleNamespace(world=1), k)
    assert seen == {"ccta": 8, "order": "expert", "consumer_sms": "shared"}


def test_every_kept_knob_enters_the_cell_hash():
    from harness.measure import hash_cell

    cfg = SimpleNamespace(
        measure=SimpleNamespace(warmup=1, iters=2, tol=0.01, rounds=1),
        hardware=SimpleNamespace(name="cpu", device="cpu", backend="gloo"),
    )
    cells = [{"system": "overlap", "params": dict(P)}]
    for key, value in (("layout", "compact"), ("order", "expert"), ("consumer", "shared")):
        cells.append({"system": "overlap", "params": {**P, key: value}})
    hashes = [hash_cell(cfg, 1, c) for c in cells]
    assert len(set(hashes)) == len(hashes)


@pytest.mark.parametrize("handshake", [True, False])
def test_the_distributed_step_runs_its_handshake_before_its_puts(monkeypatch, handshake):
    """PerProcessOperatorStep.timed: the all-reduce on the step's stream, then the step, the
    receive wait and the scale, in that order (handshake=False: the racy run of the GPU test)."""
    import torch.distributed as dist

    from systems.overlap.steps import PerProcessOperatorStep

    calls = []
    runner = SimpleNamespace(wait_received=lambda: calls.append("wait"))
    rank = SimpleNamespace(
        runner=runner,
        step=lambda: calls.append("step"),
        scaled=lambda: calls.append("scale") or "out",
    )
    monkeypatch.setattr(dist, "all_reduce", lambda t, group: calls.append(f"allreduce {group}"))
    mode = object.__new__(PerProcessOperatorStep)
    mode.rk, mode.group, mode.epoch, mode.handshake = rank, "g", torch.zeros(1), handshake
    assert mode.timed() == "out"
    assert calls == ["allreduce g"] * handshake + ["step", "wait", "scale"]
