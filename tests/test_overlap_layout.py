"""The overlap system's `layout` (aligned | packed | compact) and `swizzle` params on the CPU:
validation, the skip of FFN cells, the cell hash at the default, and setup handing them to the
played ranks."""

from types import SimpleNamespace

import pytest
import torch

from harness.measure import hashed_params, system_points
from harness.system import RunContext
from harness.workload import WorkloadSpec
from systems.overlap import system as osys

P = osys.OverlapSystem.PARAMS


def _spec(ffn=0):
    return WorkloadSpec(256, 64, 64, 4, 2, 4, "balanced", dtype="bfloat16", ffn=ffn)


def _runner_kw(monkeypatch, params: dict) -> dict:
    """The runner kwargs that setup hands a played rank for these params (loopback, CPU)."""
    seen = {}

    class FakeLoopback:
        def __init__(self, ranks, tile_m, mgb, ccta, runner_kw, layout):
            seen.update(runner_kw)
            raise RuntimeError("stop")

    monkeypatch.setattr(osys, "_Loopback", FakeLoopback)
    ctx = RunContext(rank=0, world_size=1, device=torch.device("cpu"))
    sysm = osys.OverlapSystem(ctx, {**params, "transport": "loopback"})
    with pytest.raises(RuntimeError, match="stop"):
        sysm.setup([SimpleNamespace(spec=_spec())])
    return seen


def test_validate_rejects_an_unknown_layout_in_one_line():
    osys.OverlapSystem.validate(_spec(), {**P, "layout": "packed"}, 132)
    osys.OverlapSystem.validate(_spec(), {**P, "layout": "compact"}, 132)
    with pytest.raises(ValueError) as exc:
        osys.OverlapSystem.validate(_spec(), {**P, "layout": "dense"}, 132)
    assert str(exc.value) == "overlap: layout must be one of aligned, packed, compact, got 'dense'"


def test_packed_skips_ffn_cells_with_a_reason_and_runs_operator_cells():
    reason = osys.OverlapSystem.unsupported(_spec(ffn=128), {**P, "layout": "packed"})
    assert reason is not None and "layout=packed" in reason and "layer scope" in reason
    assert osys.OverlapSystem.unsupported(_spec(ffn=128), {**P, "transport": "p2p"}) is None
    assert osys.OverlapSystem.unsupported(_spec(), {**P, "layout": "packed"}) is None
    # the device plan builds compact: FFN cells run it
    compact = {**P, "layout": "compact", "transport": "p2p"}
    assert osys.OverlapSystem.unsupported(_spec(ffn=128), compact) is None


def test_layout_at_its_default_stays_out_of_the_cell_hash():
    assert P["layout"] == "aligned" and osys.OverlapSystem.HASH_OPTIONAL["layout"] == "aligned"
    pts = system_points("overlap", {"sweep": {"layout": ["aligned", "packed"]}})
    assert [p["layout"] for p in pts] == ["aligned", "packed"]  # the row records both
    assert "layout" not in hashed_params("overlap", pts[0])
    assert hashed_params("overlap", pts[1])["layout"] == "packed"


def test_setup_hands_the_layout_to_the_played_ranks(monkeypatch):
    seen = {}

    class FakeLoopback:
        name = "loopback"

        def __init__(self, ranks, tile_m, mgb, ccta, runner_kw, layout):
            seen["layout"] = layout
            plan = SimpleNamespace(n_padded=1, n_rows=1, n_bands=1, n_remote_bands=0, n_segments=1)
            tile = SimpleNamespace(block_n=256, block_k=64)
            runner = SimpleNamespace(num_programs=100, tile=tile)
            self.ranks, self.busy = [SimpleNamespace(plan=plan, runner=runner)], 0

    monkeypatch.setattr(osys, "_Loopback", FakeLoopback)
    monkeypatch.setattr(osys.OverlapSystem, "_describe", lambda self, inp: None)  # GPU timing
    ctx = RunContext(rank=0, world_size=1, device=torch.device("cpu"))
    for layout in ("aligned", "packed", "compact"):
        sysm = osys.OverlapSystem(ctx, {"layout": layout, "transport": "loopback"})
        sysm.setup([SimpleNamespace(spec=_spec())])
        assert seen["layout"] == layout
    layer = osys.OverlapSystem(ctx, {"layout": "packed", "transport": "loopback"})
    with pytest.raises(ValueError, match="layout aligned or compact only"):
        layer.setup([SimpleNamespace(spec=_spec(ffn=128))])


def test_swizzle_is_checked_in_one_line_stays_out_of_the_hash_at_table_and_reaches_the_runner(
    monkeypatch,
):
    for ok in ("table", "fixed8", "expert32"):
        osys.OverlapSystem.validate(_spec(), {**P, "swizzle": ok}, 132)
    with pytest.raises(ValueError, match=r"^swizzle must be one of table, fixed<m>, expert<cap>"):
        osys.OverlapSystem.validate(_spec(), {**P, "swizzle": "expert0"}, 132)
    pts = system_points("overlap", {"sweep": {"swizzle": ["table", "expert32"]}})
    assert "swizzle" not in hashed_params("overlap", pts[0])
    assert hashed_params("overlap", pts[1])["swizzle"] == "expert32"
    seen = _runner_kw(monkeypatch, {"swizzle": "expert16"})
    assert seen["swizzle"] == "expert16"


def test_with_swizzle_sets_the_tile_configs_groups():
    from systems.overlap.kernels import TileConfig, with_swizzle

    cfg = TileConfig(group_m=8)
    assert with_swizzle(cfg, "table") == cfg
    assert with_swizzle(cfg, "expert32") == TileConfig(group_m=32, expert_groups=True)
    assert with_swizzle(TileConfig(expert_groups=True), "fixed4") == TileConfig(group_m=4)


def test_consumer_is_checked_in_one_line_bounds_ccta_and_stays_out_of_the_hash_at_own(monkeypatch):
    osys.OverlapSystem.validate(_spec(), {**P, "consumer": "shared", "ccta": 132}, 132)
    with pytest.raises(ValueError) as exc:
        osys.OverlapSystem.validate(_spec(), {**P, "consumer": "both"}, 132)
    assert str(exc.value) == "overlap: consumer must be one of own, shared, got 'both'"
    # own: the consumer's SMs come out of the producer's, so ccta < SMs; shared: ccta <= SMs
    with pytest.raises(ValueError, match=r"ccta=132 must be in \[1, 132\) or 'auto'"):
        osys.OverlapSystem.validate(_spec(), {**P, "ccta": 132}, 132)
    with pytest.raises(ValueError, match=r"ccta=133 must be in \[1, 132\] with consumer=shared"):
        osys.OverlapSystem.validate(_spec(), {**P, "consumer": "shared", "ccta": 133}, 132)
    # a shared cell with an auto knob runs (autotune reads the shared rows, or its default)
    auto = {**P, "consumer": "shared", "ccta": "auto"}
    assert osys.OverlapSystem.unsupported(_spec(), auto) is None
    assert osys.OverlapSystem.unsupported(_spec(), {**P, "consumer": "shared"}) is None
    assert osys.OverlapSystem.unsupported(_spec(), {**P, "ccta": "auto"}) is None
    pts = system_points("overlap", {"sweep": {"consumer": ["own", "shared"]}})
    assert "consumer" not in hashed_params("overlap", pts[0])
    assert hashed_params("overlap", pts[1])["consumer"] == "shared"
    seen = _runner_kw(monkeypatch, {"consumer": "shared"})
    assert seen["consumer_sms"] == "shared"


def test_backoff_ns_is_checked_in_one_line_and_stays_out_of_the_hash_at_zero():
    osys.OverlapSystem.validate(_spec(), {**P, "backoff_ns": 500}, 132)
    for bad in (-1, 2_000_000, "100", 1.5):
        with pytest.raises(ValueError, match=r"^overlap: backoff_ns must be an integer in"):
            osys.OverlapSystem.validate(_spec(), {**P, "backoff_ns": bad}, 132)
    pts = system_points("overlap", {"sweep": {"backoff_ns": [0, 200]}})
    assert "backoff_ns" not in hashed_params("overlap", pts[0])
    assert hashed_params("overlap", pts[1])["backoff_ns"] == 200


def test_handshake_is_checked_in_one_line_skips_off_p2p_and_stays_out_of_the_hash():
    osys.OverlapSystem.validate(_spec(), {**P, "handshake": "barrier"}, 132)
    with pytest.raises(ValueError) as exc:
        osys.OverlapSystem.validate(_spec(), {**P, "handshake": "nccl"}, 132)
    assert str(exc.value) == "overlap: handshake must be one of allreduce, barrier, got 'nccl'"
    # barrier: p2p operator cells only (W>1 with no transport named means p2p)
    assert osys.OverlapSystem.unsupported(_spec(), {**P, "handshake": "barrier"}) is None
    p2p = {**P, "handshake": "barrier", "transport": "p2p"}
    assert osys.OverlapSystem.unsupported(_spec(), p2p) is None
    for params, spec in (
        ({**p2p, "transport": "loopback"}, _spec()),
        ({**p2p, "transport": "nvshmem"}, _spec()),
        (p2p, _spec(ffn=128)),
    ):
        assert "handshake=barrier" in osys.OverlapSystem.unsupported(spec, params)
    pts = system_points("overlap", {"sweep": {"handshake": ["allreduce", "barrier"]}})
    assert "handshake" not in hashed_params("overlap", pts[0])
    assert hashed_params("overlap", pts[1])["handshake"] == "barrier"


@pytest.mark.parametrize("handshake", ["allreduce", "barrier", None])
@pytest.mark.parametrize("stream", ["step", "consumer"])
def test_the_distributed_step_runs_its_handshake_before_its_puts(monkeypatch, handshake, stream):
    """_Distributed.timed: the handshake (NCCL all-reduce or the counters' symmetric-memory
    barrier, with its time-out), then the step, the receive wait and the scale, in that order.
    handshake_stream=consumer hands it to the step, which runs it ahead of the consumer (the
    runner enqueues it on the consumer's stream), not before the step."""
    import torch.distributed as dist

    calls = []
    handle = SimpleNamespace(barrier=lambda **kw: calls.append(("barrier", kw)))
    runner = SimpleNamespace(
        transport=SimpleNamespace(signal_handle=handle, recv="recv"),
        wait_received=lambda: calls.append(("wait", None)),
    )

    def step(before_consume=None):
        calls.append(("step", None))
        if before_consume is not None:
            before_consume()
            calls.append(("consumer", None))

    rank = SimpleNamespace(
        runner=runner, step=step, scale=lambda recv: calls.append(("scale", recv)) or "out"
    )
    monkeypatch.setattr(dist, "all_reduce", lambda t, group: calls.append(("allreduce", group)))
    mode = object.__new__(osys._Distributed)
    mode.ranks, mode.group, mode.epoch = [rank], "group", torch.zeros(1)
    mode.handshake, mode.barrier_timeout_ms = handshake, 5000
    mode.handshake_stream = stream
    hs = {
        "allreduce": [("allreduce", "group")],
        "barrier": [("barrier", {"channel": 0, "timeout_ms": 5000})],
        None: [],
    }[handshake]
    assert mode.timed() == "out"
    if stream == "step":
        assert calls == [*hs, ("step", None), ("wait", None), ("scale", "recv")]
    else:
        assert calls == [("step", None), *hs, ("consumer", None), ("wait", None), ("scale", "recv")]


def test_handshake_stream_is_checked_in_one_line_skips_without_peers_and_stays_out_of_the_hash():
    osys.OverlapSystem.validate(_spec(), {**P, "handshake_stream": "consumer"}, 132)
    with pytest.raises(ValueError) as exc:
        osys.OverlapSystem.validate(_spec(), {**P, "handshake_stream": "producer"}, 132)
    assert str(exc.value) == (
        "overlap: handshake_stream must be one of step, consumer, got 'producer'"
    )
    on = {**P, "handshake_stream": "consumer"}
    for transport in ("", "p2p", "nvshmem"):  # W>1 with no transport named means p2p
        assert osys.OverlapSystem.unsupported(_spec(), {**on, "transport": transport}) is None
    for params, spec in (({**on, "transport": "loopback"}, _spec()), (on, _spec(ffn=128))):
        assert "handshake_stream=consumer" in osys.OverlapSystem.unsupported(spec, params)
    pts = system_points("overlap", {"sweep": {"handshake_stream": ["step", "consumer"]}})
    assert "handshake_stream" not in hashed_params("overlap", pts[0])
    assert hashed_params("overlap", pts[1])["handshake_stream"] == "consumer"


def test_the_runner_runs_before_consume_ahead_of_the_consumer(monkeypatch):
    """OverlapRunner.overlapped on the CPU path: the hook, then the producer and consumer."""
    from systems.overlap.runner import OverlapRunner

    calls = []
    runner = object.__new__(OverlapRunner)
    runner.device = torch.device("cpu")
    monkeypatch.setattr(runner, "_next_target", lambda: 7, raising=False)
    monkeypatch.setattr(
        runner, "sequential", lambda x, y, target: calls.append(("run", target)), raising=False
    )
    runner.overlapped("x", "y", before_consume=lambda: calls.append(("hook", None)))
    runner.overlapped("x", "y")
    assert calls == [("hook", None), ("run", 7), ("run", 7)]
