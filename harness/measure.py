"""Cell expansion and the generic measurement of one system on one cell.

A cell = one workload (the grid's axes) x one system x one point of its sweep (params). Per
cell: gates -> setup on every played rank's inputs -> check against the float32 reference ->
timed region and bounds -> one Row (a failed check: status fail, no latency). Every stage a rank
can fail in ends in an agreement over the ranks (`stage`, `settle`), so every rank ends the cell
with the same row naming the failed rank ("rank 2: ...").
"""

from __future__ import annotations

import itertools
import json
import os
import random
import traceback
from datetime import timedelta
from functools import partial
from typing import Any

import torch
import torch.distributed as dist
from omegaconf import DictConfig, OmegaConf

from harness.check import check
from harness.errors import CommFailure, is_comm_failure
from harness.graphs import capture, graph_choice, graph_mode
from harness.layout import rank_layout
from harness.records import Row, cell_hash, cell_row, overlap_ratio
from harness.reference import dispatch, dispatch_local, reference_local, reference_train
from harness.system import CellInputs, RunContext, get_system
from harness.timing import STATE, Timing, barrier, count_host_syncs, summarize, time_fn, waiting
from harness.workload import (
    WorkloadSpec,
    imbalance_of,
    make_grad,
    make_rank_fc1,
    make_rank_weights,
    make_tokens,
    routing_of,
)

LAYER_RATIO_NOTE = (
    "undefined in the layer scope: compute_ms and comm_ms leave out the dispatch's counts "
    "exchange, sort and host sync, so they do not partition the timed region"
)
SPEC_KEYS = ("tokens_per_rank", "hidden", "out", "experts_per_rank", "top_k", "routing", "dtype")


def system_points(name: str, conf: Any) -> list[dict[str, Any]]:
    """Every parameter set one system runs per workload: PARAMS overridden by the experiment's
    `params`, times the product of its `sweep` lists; bad input is a ValueError naming it."""
    cls = get_system(name).load()
    if isinstance(conf, DictConfig):
        conf = OmegaConf.to_container(conf, resolve=True)
    conf = conf or {}
    if not isinstance(conf, dict) or set(conf) - {"params", "sweep"}:
        raise ValueError(
            f"experiment.systems.{name} must be a mapping with keys params and/or sweep, "
            f"got {conf!r}"
        )
    params, sweep = dict(conf.get("params") or {}), dict(conf.get("sweep") or {})
    cls.check_params({**params, **sweep})
    both = sorted(set(params) & set(sweep))
    if both:
        raise ValueError(f"system {name!r}: {both} both fixed (params) and swept (sweep)")
    axes = []
    for key, values in sweep.items():
        if isinstance(values, (str, bytes)) or not hasattr(values, "__iter__"):
            raise ValueError(f"system {name!r}: sweep.{key} must be a list, got {values!r}")
        values = list(values)
        if not values:
            raise ValueError(f"system {name!r}: sweep.{key} is empty")
        twice = sorted({repr(v) for i, v in enumerate(values) if v in values[:i]})
        if twice:
            raise ValueError(f"system {name!r}: sweep.{key} lists {', '.join(twice)} twice")
        axes.append([(key, v) for v in values])
    base = {**cls.PARAMS, **params}
    return [{**base, **dict(point)} for point in itertools.product(*axes)]


def unused_knobs(experiment: str, system: str, params: dict[str, Any], used: tuple) -> None:
    """A ValueError where `params` move a `system` knob `experiment` ignores off its default."""
    defaults = get_system(system).load().PARAMS
    bad = [f"{k}={v!r}" for k, v in params.items() if k not in used and v != defaults.get(k, v)]
    if bad:
        raise ValueError(
            f"{experiment} uses {system}'s {', '.join(used)} only; {', '.join(bad)} would be "
            "ignored"
        )


def selected_systems(cfg: Any) -> dict[str, Any]:
    """The experiment's systems (name -> {params, sweep}), narrowed to `experiment.select`."""
    systems = dict(cfg.experiment.systems)
    for name in systems:
        get_system(name)  # unknown system -> error with the choices
    select = list(cfg.experiment.get("select") or [])
    missing = [s for s in select if s not in systems]
    if missing:
        raise ValueError(
            f"experiment.select names {missing}, not systems of this experiment; "
            f"choices: {sorted(systems)}"
        )
    return {k: v for k, v in systems.items() if not select or k in select}


def experiment_options(cfg: Any, name: str, defaults: dict[str, Any]) -> dict[str, Any]:
    """`defaults` overridden by experiment.options (an unknown key is a ValueError)."""
    given = dict(cfg.experiment.get("options") or {})
    unknown = sorted(set(given) - set(defaults))
    if unknown:
        raise ValueError(f"{name}: unknown option(s) {unknown}; accepted: {sorted(defaults)}")
    return {**defaults, **given}


def hash_cell(cfg: Any, process_world: int, cell: dict) -> str:
    """The cell hash: the cell and what else changes its numbers (measure settings, process
    count, backend, the machine found on CUDA so no row resumes another GPU model's or count's
    cell, else the preset's name); not the time-out or table path. queue_ahead and graph enter
    only where they change the timing, so eager rows keep their hashes."""
    from harness.records import this_machine  # looked up per call: tests patch it

    m, hw = cfg.measure, cfg.hardware
    timing = dict(warmup=int(m.warmup), iters=int(m.iters), tol=float(m.tol), rounds=int(m.rounds))
    if bool(getattr(m, "queue_ahead", False)):
        timing["queue_ahead"] = True
    graph = graph_mode(getattr(m, "graph", "false"))
    if hw.device == "cuda" and graph != "false":
        timing["graph"] = graph
    name = this_machine() if hw.device == "cuda" and this_machine() != "cpu" else hw.name
    hardware = {"name": name, "device": hw.device, "backend": hw.backend}
    run = {"measure": timing, "hardware": hardware, "processes": process_world}
    return cell_hash({**cell, "run": run})


def expand_grid(cfg: Any, process_world: int) -> list[dict]:
    """All cells: per workload (the grid axes' product; FFN: out = hidden) every system per point of
    its sweep, in a seeded random order (the same on every rank) so slow drift favours none."""
    g = cfg.experiment.grid
    worlds = list(g.world_size) or [process_world]
    axes = {k: list(getattr(g, k)) for k in (*SPEC_KEYS, "ffn")}
    points = {name: system_points(name, conf) for name, conf in selected_systems(cfg).items()}
    cells = []
    rng = random.Random(cfg.seed)
    seen: list[dict] = []
    trains = [bool(t) for t in getattr(g, "train", [False])]
    for train, *values in itertools.product(trains, worlds, *axes.values()):
        base = {"world_size": values[0], **dict(zip(axes, values[1:]))}
        if train:  # only where set: the other cells keep their hashes
            base["train"] = True
        if base["ffn"]:  # an FFN layer returns its input width: out is hidden
            base["out"] = base["hidden"]
            if base in seen:
                continue
            seen.append(dict(base))
        cells += workload_cells(cfg, process_world, base, points, rng)
    return cells


def workload_cells(
    cfg: Any, process_world: int, base: dict, points: dict[str, list[dict]], rng: random.Random
) -> list[dict]:
    """One workload's cells (base: its axes), the systems in an order drawn from rng."""
    order = list(points)
    rng.shuffle(order)
    cells = []
    for system in order:
        for params in points[system]:
            cell = {"experiment": cfg.experiment.name, "system": system, "seed": cfg.seed}
            cell |= {**base, "params": params}
            cell["cell_hash"] = hash_cell(cfg, process_world, cell)
            cells.append(cell)
    return cells


def spec_of(cell: dict) -> WorkloadSpec:
    """The cell's workload; a hand-built cell without `ffn` is the single-GEMM operator."""
    given = {k: cell[k] for k in ("world_size", "seed", *SPEC_KEYS)}
    return WorkloadSpec(**given, ffn=cell.get("ffn", 0), train=cell.get("train", False))


def validate_cells(cells: list[dict], sm_count: int, processes: int, device: str) -> None:
    """Errors before GPU work: routing, shapes, params, what `processes` of `device` cannot run."""
    for cell in cells:
        cls = get_system(cell["system"]).load()
        params, spec = {**cls.PARAMS, **cell["params"]}, spec_of(cell)
        cls.validate(spec, params, sm_count)
        if spec.world_size in (1, processes):
            cls.refuse(spec, params, processes, device)


def base_row(cell: dict, spec: WorkloadSpec) -> Row:
    return cell_row(cell, **{k: cell[k] for k in SPEC_KEYS}, ffn=spec.ffn, **imbalance_of(spec))


def played_ranks(ctx: RunContext, spec: WorkloadSpec) -> list[int] | None:
    """The logical ranks this process plays: its own rank when the cell has one process per
    rank, every rank when one process runs the cell alone, None when neither holds."""
    if spec.world_size == ctx.world_size:
        return [ctx.rank]
    if ctx.world_size == 1:
        return list(range(spec.world_size))
    return None


#: (workload, played ranks) -> inputs and stacked reference, of the last such key only: shared
#: by the systems of a workload (built untimed, once)
_INPUTS: dict[tuple, tuple[list[CellInputs], torch.Tensor]] = {}


def cell_inputs(
    ctx: RunContext, spec: WorkloadSpec, played: list[int]
) -> tuple[list[CellInputs], torch.Tensor]:
    """One CellInputs per played rank and their references stacked [len(played) * T, N]."""
    key = (spec.key(), tuple(played))
    if key not in _INPUTS:
        _INPUTS.clear()  # the last workload's tensors go before this one's are made
        inputs, refs = [], []
        for r in played:
            lay = rank_layout(spec, r)
            x = make_tokens(spec, r, ctx.device)
            w = make_rank_weights(spec, r, ctx.device)
            w1 = make_rank_fc1(spec, r, ctx.device) if spec.ffn else None
            if played == [ctx.rank] and ctx.world_size > 1:
                with waiting():  # the real exchange between processes
                    x_recv = dispatch(x, lay, ctx.group)
            else:
                x_recv = dispatch_local(spec, lay, ctx.device)
            routing = routing_of(spec)
            ids = routing.expert_ids[r].to(ctx.device)
            gate = routing.gate_weights[r].to(device=ctx.device, dtype=torch.float32)
            dy = make_grad(spec, r, ctx.device) if spec.train else None
            inputs.append(CellInputs(spec, lay, x, w, x_recv, w1, ids, gate, dy))
            if not spec.train:
                refs.append(reference_local(spec, r, ctx.device))
        ref = reference_train(spec, played, ctx.device) if spec.train else torch.cat(refs)
        _INPUTS[key] = (inputs, ref)
    return _INPUTS[key]


def agree(ctx: RunContext, value: float) -> float:
    """The max of value over the ranks of the run (the value itself alone)."""
    t = torch.tensor([value], dtype=torch.float64, device=ctx.device)
    if dist.is_initialized():
        with waiting():
            dist.all_reduce(t, op=dist.ReduceOp.MAX, group=ctx.group)
    return float(t.item())


#: a rank's outcome of a stage as the agreement carries it; the worst is the cause
_OUTCOME = {"ok": 0.0, "fail": 1.0, "error": 2.0}


class _Agreement:
    """The process group the stages' agreements use (open_agreement), or None: the run's."""

    group: dist.ProcessGroup | None = None


def open_agreement(timeout: timedelta) -> None:
    """Give the stages' agreements a gloo group of their own (call on every rank, after the
    process group is up): an agreement then never pairs with a collective of a system that a
    failed rank left out, and on a GPU it costs no device synchronisation."""
    if dist.is_initialized() and dist.get_world_size() > 1:
        _Agreement.group = dist.new_group(backend="gloo", timeout=timeout)


def close_agreement() -> None:
    """Forget the agreements' group (before the run's process group is destroyed with it)."""
    _Agreement.group = None


def _encode(v: float) -> float:
    return -float("inf") if v != v else v  # NaN (not measured) loses every MAX


def _decode(v: float) -> float:
    return float("nan") if v == -float("inf") else v


def settle(ctx: RunContext, row: Row, values: list[float] | None, n: int = 0) -> list[float] | None:
    """The agreement that ends every stage of a cell: one all-reduce (MAX) of each rank's outcome
    (ok; fail: its check failed; error: it raised), the row's worst check errors and this rank's
    `n` values (None: it has none). Where any rank failed, every row takes the status and reason
    of the lowest rank that raised (else whose check failed), "rank r: <reason>", and None is
    returned; else the values, each the MAX over the ranks (NaN where no rank has one). A stuck
    rank leaves the others waiting here until the parent ends the cell (hardware.timeout_s)."""
    mine = [_encode(float(v)) for v in values] if row.status == "ok" and values is not None else []
    mine += [-float("inf")] * (n - len(mine))
    errs = [_encode(row.max_rel_err), _encode(row.max_row_rel_err)]
    W = ctx.world_size if dist.is_initialized() else 1
    if W > 1:
        group = _Agreement.group
        device = ctx.device if group is None else torch.device("cpu")
        group = ctx.group if group is None else group
        codes = [0.0] * W
        codes[ctx.rank] = _OUTCOME.get(row.status, _OUTCOME["error"])
        t = torch.tensor(codes + errs + mine, dtype=torch.float64, device=device)
        with waiting():
            dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
        agreed = t.tolist()
        codes, errs, mine = agreed[:W], agreed[W : W + 2], agreed[W + 2 :]
        row.max_rel_err, row.max_row_rel_err = (_decode(v) for v in errs)
        worst = max(codes)
        if worst > 0:
            cause = codes.index(worst)  # the lowest rank with the worst outcome
            box = [row.reason if ctx.rank == cause else None]
            src = cause if group is None else dist.get_global_rank(group, cause)
            with waiting():
                dist.broadcast_object_list(box, src=src, group=group, device=device)
            status = "error" if worst >= _OUTCOME["error"] else "fail"
            row.status, row.reason = status, f"rank {cause}: {box[0]}"[:500]
    STATE.failure = None  # agreed: the ranks end the cell together
    if row.status != "ok":
        return None
    return [_decode(v) for v in mine]


def stage(ctx: RunContext, row: Row, name: str, fn, n: int = 0) -> list[float] | None:
    """One stage a rank can fail in: fn() here (guarded), then settle: the agreed `n` numbers fn
    returned where it ended ok on every rank, else None (every row names the failed rank). A
    stage holds at most one call that makes collectives of the harness (time_fn), so a rank
    that failed before it is never left out of one its peers wait in."""
    STATE.stage = name
    values = guarded(ctx, row, fn) if row.status == "ok" else None
    if row.status != "ok":
        if row.status == "error" and ctx.world_size > 1:
            row.reason = f"{name}: {row.reason}"[:500]
        # for the parent, until the ranks agree
        STATE.failure = row.reason if row.reason.startswith(name) else f"{name}: {row.reason}"
    return settle(ctx, row, values if n else None, n)


def _checked(row: Row, res: Any, when: str) -> bool:
    """This rank's check into row (worst errors, NaN as worst; failed: fail); True if it passed."""

    def worst(prev: float, new: float) -> float:
        new = new if new == new else 1e30
        return new if prev != prev else max(prev, new)

    row.max_rel_err = worst(row.max_rel_err, res.max_rel_err)
    row.max_row_rel_err = worst(row.max_row_rel_err, res.max_row_rel_err)
    if res.ok:
        return True
    reason = res.message or "check failed"
    row.status, row.reason = "fail", f"{when}: {reason}" if when else reason
    return False


class _Prepared:
    """A cell set up and checked, ready to be timed; `step`: system.timed or its graph's replay."""

    def __init__(self, row: Row, system: Any, ref: torch.Tensor, spec: WorkloadSpec) -> None:
        self.row, self.system, self.ref, self.spec = row, system, ref, spec
        self.step = system.timed
        #: what earlier checked calls returned: poisoned before the next one (a cached output)
        self.returned: list[torch.Tensor] = []
        self.samples: list[float] = []
        #: per timed call: the host's median enqueue time (ms) and whether it queued ahead
        self.host_ms: list[float] = []
        self.queued: list[bool | None] = []

    def timed_ref(self) -> torch.Tensor:
        """The reference of what the step returns: rows [T, N] of played rank timed_rank in the
        stacked reference (all of it for None or a train step)."""
        r, T = self.system.timed_rank, self.spec.tokens_per_rank
        if r is None or isinstance(self.ref, dict):
            return self.ref
        return self.ref[r * T : (r + 1) * T]


def poison(ctx: RunContext, p: _Prepared) -> None:
    """NaN into every floating tensor the step keeps between calls (Step.poison) and every
    output an earlier checked call returned, then a barrier (no peer's puts of the next call land
    before this rank's poison): a call passes its check only with work it did itself."""
    p.system.step.poison()
    for t in p.returned:
        if t.is_floating_point():
            t.fill_(float("nan"))
    if ctx.world_size > 1 and dist.is_initialized():
        barrier(ctx.group, ctx.device)


def checked_call(ctx: RunContext, p: _Prepared, call) -> Any:
    """call() from poisoned buffers; its output is remembered to poison next time."""
    poison(ctx, p)
    out = call()
    if isinstance(out, torch.Tensor):
        p.returned = [out]
    elif isinstance(out, dict):  # a train step's output and gradients
        p.returned = list(out.values())
    return out


def check_forward(ctx: RunContext, cfg: Any, p: _Prepared, when: str) -> bool:
    """forward() once from poisoned buffers, every played rank's output checked."""
    out = checked_call(ctx, p, p.system.forward)
    return _checked(p.row, check(out, p.ref, cfg.measure.tol), when)


def check_step(ctx: RunContext, cfg: Any, p: _Prepared, when: str) -> bool:
    """The step to time once from poisoned buffers: ITS output (not forward()'s) and the
    system's device-side error words checked; False after a failure (recorded in the row)."""
    out = checked_call(ctx, p, p.step)
    p.system.check_errors()
    if not isinstance(out, (torch.Tensor, dict)):
        p.row.status, p.row.reason = "fail", f"{when}: the timed step returned no output tensor"
        return False
    return _checked(p.row, check(out, p.timed_ref(), cfg.measure.tol), when)


def arm_step(ctx: RunContext, cfg: Any, p: _Prepared) -> bool:
    """Eager or graph timing (harness/graphs.py): capture where chosen (a failed capture leaves
    the step eager, the reason in the row), then check the step once; False on a fail."""
    mode = graph_mode(getattr(cfg.measure, "graph", "false"))
    why = graph_choice(mode, ctx.device, p.system.capture_blocker())
    if why is None:
        try:
            p.step = capture(p.system.timed, ctx.device).replay
            p.row.graph = True
        except RuntimeError as exc:
            why = str(exc)
    p.row.graph_reason = why or ""
    when = "graph replay" if p.row.graph else "timed step"
    return check_step(ctx, cfg, p, when)


def set_latency(row: Row, t: Timing) -> None:
    """row's latency columns from t: median, p10, p90 and the median's 95% interval (ms)."""
    row.latency_ms, row.latency_p10_ms, row.latency_p90_ms = t.median_ms, t.p10_ms, t.p90_ms
    row.latency_ci_lo_ms, row.latency_ci_hi_ms = t.ci_lo_ms, t.ci_hi_ms


def guarded(ctx: RunContext, row: Row, fn) -> Any:
    """fn()'s result, else None and the row's `error` (a broken process group: CommFailure)."""
    try:
        return fn()
    except torch.cuda.OutOfMemoryError as exc:
        row.status, row.reason = "error", f"out of memory: {str(exc)[:200]}"
    except Exception as exc:  # noqa: BLE001 - a failing cell must not stop the sweep
        if is_comm_failure(exc):  # a peer is gone: stop the run, record nothing
            raise CommFailure(f"{type(exc).__name__}: {exc}") from exc
        row.status, row.reason = "error", f"{type(exc).__name__}: {exc}"[:500]
        if ctx.rank == 0 and os.environ.get("HYDRA_FULL_ERROR") == "1":
            traceback.print_exc()
    return None


def skip_reason(
    ctx: RunContext, spec: WorkloadSpec, info: Any, params: dict, played: list[int] | None
) -> str | None:
    """Why this run cannot measure the cell (a capability gate), or None."""
    reason = info.unavailable_reason(ctx, spec.world_size)
    if reason is not None:
        return reason
    if played is None:
        return (
            f"cell W={spec.world_size} needs {spec.world_size} processes, or 1 that plays every "
            f"rank; this run has {ctx.world_size}"
        )
    cls = info.load()
    reason = cls.unsupported(spec, {**cls.PARAMS, **params})
    if reason is not None:
        return reason
    if spec.ffn and not cls.layer_scope:
        return f"{info.name} has no layer scope (FFN experts timed from the tokens)"
    if spec.train and not cls.train_scope:
        return f"{info.name} has no train scope (forward + backward)"
    if len(played) > 1 and not cls.simulates_ranks:
        return (
            f"{info.name} cannot play {spec.world_size} ranks in one process; run the cell with "
            f"one process per rank (hardware.world_size={spec.world_size})"
        )
    return None


def prepare_cell(ctx: RunContext, cfg: Any, cell: dict) -> Row | _Prepared:
    """A cell's gates, setup, first check: its final Row (skipped, fail, error) or a _Prepared."""
    spec = spec_of(cell)
    row = base_row(cell, spec)
    info = get_system(cell["system"])
    played = played_ranks(ctx, spec)
    reason = skip_reason(ctx, spec, info, cell["params"], played)
    if reason is not None:
        row.status, row.reason = "skipped", reason
        return row
    cls = info.load()
    made: dict[str, Any] = {}

    def setup() -> None:
        inputs, ref = cell_inputs(ctx, spec, played)  # the harness's exchange comes first
        system = cls(ctx, cell["params"])
        system.setup(inputs)
        row.impl, row.transport = system.impl, system.transport
        row.scope = spec.scope if spec.ffn else system.scope
        row.params.update(system.resolved_params())
        made["p"] = _Prepared(row, system, ref, spec)

    if stage(ctx, row, "setup", setup) is None:
        return row
    p = made.pop("p")
    when = "first check" if ctx.world_size > 1 else ""
    if stage(ctx, row, "first check", lambda: check_forward(ctx, cfg, p, when)) is None:
        return row
    if stage(ctx, row, "step check", lambda: arm_step(ctx, cfg, p)) is None:
        return row
    return p


def _timing_kw(ctx: RunContext, cfg: Any, iters: int, warmup: int) -> dict:
    ahead = bool(getattr(cfg.measure, "queue_ahead", False))
    return dict(device=ctx.device, group=ctx.group, warmup=warmup, iters=iters, queue_ahead=ahead)


def time_prepared(ctx: RunContext, cfg: Any, p: _Prepared, iters: int, warmup: int) -> bool:
    """Add `iters` timed iterations of the cell to its samples; False after a failure."""
    kw = _timing_kw(ctx, cfg, iters, warmup)

    def timed_loop() -> None:  # a rank's samples count only where every rank ended it ok
        t = time_fn(p.step, **kw)
        p.system.check_errors()  # a wait that timed out in the loop: the cell's error
        p.samples.extend(t.samples)
        p.host_ms.append(t.host_ms)
        p.queued.append(t.queued)

    return stage(ctx, p.row, f"timed loop {len(p.host_ms) + 1}", timed_loop) is not None


def _timing_note(kw: dict, p: _Prepared) -> dict:
    """extra's `timing` (graph, queued, eager) and how many timed calls were not queued ahead."""
    if kw["device"].type != "cuda":
        return {}
    if p.row.graph:
        return {"timing": "graph"}
    if not kw["queue_ahead"]:
        return {"timing": "eager"}
    late = sum(q is False for q in p.queued)
    note = {"timing": "queued"}
    if late:
        note["timing_late"] = f"{late} of {len(p.queued)} timed calls were not queued ahead"
    return note


def _time_alone(ctx: RunContext, p: _Prepared, kw: dict, name: str, fn, put) -> bool:
    """Stage `name`: put(median ms of fn() timed from poisoned buffers); False on a failure."""

    def timed_alone() -> None:
        poison(ctx, p)
        put(time_fn(fn, **kw).median_ms)

    return stage(ctx, p.row, name, timed_alone) is not None


def _bounds(ctx: RunContext, p: _Prepared, kw: dict) -> bool:
    """Compute-only, comm-only bounds, overlap ratio (or why none), extra bounds; False: failed."""
    row, system, spec = p.row, p.system, p.spec
    if system.has_bounds():
        for what, fn in (("compute", system.compute_only), ("comm", system.comm_only)):
            put = partial(setattr, row, f"{what}_ms")
            if not _time_alone(ctx, p, kw, f"{what}-only bound", fn, put):
                return False
        if not system.overlaps:
            system.extra["overlap_ratio"] = f"{system.name} overlaps nothing: it runs its "
            system.extra["overlap_ratio"] += "communication after its compute"
        elif spec.ffn:  # the bounds leave the dispatch's metadata and host sync out
            system.extra["overlap_ratio"] = LAYER_RATIO_NOTE
        elif spec.world_size > 1:
            row.overlap_ratio = overlap_ratio(row.compute_ms, row.comm_ms, row.latency_ms)
        else:  # nothing to hide: a ratio of local copies would read as overlap
            system.extra["overlap_ratio"] = "undefined at W=1: no bytes leave the rank"
    for name, fn in system.extra_bounds().items():
        put = partial(row.metrics.__setitem__, f"{name}_ms")
        if not _time_alone(ctx, p, kw, f"{name} bound", fn, put):
            return False
    return True


def _serialized(ctx: RunContext, cfg: Any, p: _Prepared, kw: dict) -> bool:
    """Step.serialized where the step has one: captured where the step is, checked like the
    step, then timed (serialized_ms). Not in Triton's interpreter (it serializes anyway)."""
    fn, row = p.system.step.serialized, p.row
    if fn is None or os.environ.get("TRITON_INTERPRET") == "1":
        return True
    got: list = []

    def check_serialized() -> None:
        got.append(capture(fn, ctx.device).replay if row.graph else fn)
        out = checked_call(ctx, p, got[0])
        _checked(row, check(out, p.timed_ref(), cfg.measure.tol), "serialized")

    if stage(ctx, row, "serialized check", check_serialized) is None:
        return False
    return _time_alone(ctx, p, kw, "serialized", got[0], partial(setattr, row, "serialized_ms"))


def finish_cell(ctx: RunContext, cfg: Any, p: _Prepared) -> Row:
    """The latency from the samples (agreed over the ranks: the same everywhere), the bounds,
    the checks after timing (forward()'s and the step's: no reused buffer overwritten, no wait
    timed out), extra and metrics; each timed part and each check a stage of its own."""
    row, system = p.row, p.system
    if row.status != "ok":
        return row
    kw = _timing_kw(ctx, cfg, cfg.measure.iters, cfg.measure.warmup)
    guarded(ctx, row, lambda: set_latency(row, summarize(p.samples)))
    if row.status != "ok":
        return row
    after, step = "after timing", "after timing (step)"
    if not (
        _bounds(ctx, p, kw)
        and _serialized(ctx, cfg, p, kw)
        and stage(ctx, row, after, lambda: check_forward(ctx, cfg, p, after)) is not None
        and stage(ctx, row, step, lambda: check_step(ctx, cfg, p, step)) is not None
    ):
        if row.status == "fail":  # a failed check after timing: no latency
            set_latency(row, Timing(float("nan"), float("nan"), float("nan"), 0))
        return row
    counted = None
    if ctx.device.type == "cuda":  # the host synchronisations of one timed call (most on a rank)
        counted = stage(
            ctx, row, "host syncs", lambda: [float(count_host_syncs(p.step, ctx.device))], n=1
        )
        if counted is None:
            return row

    def results() -> None:  # no collective: rank 0's row is the one written
        # every timed iteration (ms, the max over ranks), so a bimodal cell shows in its row
        samples = {"samples_ms": [round(v, 4) for v in p.samples], **_timing_note(kw, p)}
        row.extra = json.dumps({**system.extra, **samples}, sort_keys=True, default=str)
        row.metrics.update(system.metrics)
        if p.host_ms and all(v == v for v in p.host_ms):  # GPU: the host's enqueue time
            row.metrics["host_ms"] = float(torch.tensor(p.host_ms).median())
        if counted is not None:
            row.metrics["host_syncs"] = counted[0]

    guarded(ctx, row, results)
    return row


def measure_cell(ctx: RunContext, cfg: Any, cell: dict) -> Row:
    """Run one system on one cell on this rank; every rank returns the same Row values."""
    p = prepare_cell(ctx, cfg, cell)
    if isinstance(p, Row):
        return p
    time_prepared(ctx, cfg, p, cfg.measure.iters, cfg.measure.warmup)
    return finish_cell(ctx, cfg, p)


def measure_workload(ctx: RunContext, cfg: Any, cells: list[dict]) -> list[Row]:
    """One row per cell of a workload, its systems timed in interleaved rounds (measure.rounds =
    r): all set up and checked, then r times each in turn runs iters / r timed iterations (its
    warm-up before round 1, one iteration before the others): slow drift spreads over all."""
    rounds = int(cfg.measure.rounds)
    per = max(1, -(-int(cfg.measure.iters) // rounds))
    done = [prepare_cell(ctx, cfg, c) for c in cells]
    live = [p for p in done if not isinstance(p, Row)]
    for r in range(rounds):
        for p in live:
            if p.row.status == "ok":
                time_prepared(ctx, cfg, p, per, cfg.measure.warmup if r == 0 else 1)
    for i, p in enumerate(done):
        if not isinstance(p, Row):
            p.system.extra["rounds"] = rounds
            done[i] = finish_cell(ctx, cfg, p)
            p.system = None  # free the device memory of the finished system
    return done


def workload_key(cell: dict) -> tuple:
    """What the systems of one workload share (the cell without system, params and hash)."""
    skip = ("system", "params", "cell_hash")
    return tuple(sorted((k, v) for k, v in cell.items() if k not in skip))
