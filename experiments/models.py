"""Fig 4: the three models end to end, forward only, with each layer-scope system as the MoE.

Models, check and timing: docs/method.md, Models. One cell = (model, dtype, system, a point of
the system's sweep) on W = the processes of the run. Its MoE blocks call the system through
SystemMoE (h, ids and gate copied into the system's CellInputs, then system.timed()); setup goes
through the harness's path (WorkloadSpec: T = B x S, out = H, F = ffn_mult x H, G / W experts per
rank). The reference model (output, routing, imbalance) is computed once per model and process.
Options (experiment.options): models (name -> MODEL_KEYS), experts (64), top_k (2), ffn_mult
(4), model_tol (5e-2: the output check catches integration errors, O(1); bf16 MoE calls drift
1.0e-2 through 12 MoE blocks on the CPU, each call within 3.6e-3).
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch

from harness.check import CheckResult, check
from harness.graphs import capture, graph_choice, graph_mode
from harness.measure import (
    agree,
    cell_inputs,
    experiment_options,
    guarded,
    selected_systems,
    set_latency,
    system_points,
    workload_cells,
)
from harness.models import (
    ModelSpec,
    MoEModel,
    MoETimer,
    ReferenceMoE,
    SystemMoE,
    model_input,
    owned_inputs,
)
from harness.records import Row, cell_row
from harness.system import RunContext, get_system, int_param, list_param
from harness.timing import summarize, time_fn
from systems.tutel import INT32_MAX  # Tutel's encode/decode index its buffers with int32

#: the grid axes this experiment reads (the model sizes are options, W the number of processes)
GRID_AXES = ("dtype",)
OPTIONS: dict[str, Any] = dict(models={}, experts=64, top_k=2, ffn_mult=4, model_tol=5e-2)
MODEL_KEYS = ("blocks", "moe_blocks", "batch", "seq", "hidden", "heads", "causal")
#: the model's integer keys, and the options every model takes
INT_KEYS = ("blocks", "batch", "seq", "hidden", "heads")
OPTION_KEYS = ("experts", "top_k", "ffn_mult")


@dataclass
class ModelRow(Row):
    """A Row with the model's name (column `model`)."""

    model: str = ""


def options(cfg: Any) -> dict[str, Any]:
    """OPTIONS overridden by experiment.options (unknown keys: an error); preflight looks for it."""
    return experiment_options(cfg, "models", OPTIONS)


def model_specs(cfg: Any, dtype: str) -> list[ModelSpec]:
    """The experiment's models in their config order; a missing or unknown key is an error."""
    opt = options(cfg)
    if not opt["models"]:
        raise ValueError("models: experiment.options.models is empty; name at least one model")
    out = []
    for name, m in dict(opt["models"]).items():
        m = dict(m or {})
        missing = [k for k in MODEL_KEYS if k not in m]
        extra = sorted(set(m) - set(MODEL_KEYS))
        if missing or extra:
            raise ValueError(
                f"models: model {name} needs exactly the keys {list(MODEL_KEYS)}; "
                f"missing {missing}, unknown {extra}"
            )
        if not isinstance(m["causal"], bool):
            raise ValueError(f"models: model {name}: causal must be true or false")
        for key in INT_KEYS:
            int_param("models", f"model {name}: {key}", m[key], least=1)
        for b in list_param("models", f"model {name}: moe_blocks", m["moe_blocks"]):
            int_param("models", f"model {name}: moe_blocks", b, least=0)
        for key in OPTION_KEYS:
            int_param("models", key, opt[key], least=1)
        ints = {k: int(m[k]) for k in INT_KEYS} | {k: int(opt[k]) for k in OPTION_KEYS}
        blocks = tuple(int(b) for b in m["moe_blocks"])
        out.append(
            ModelSpec(name=str(name), moe_blocks=blocks, causal=m["causal"], dtype=dtype, **ints)
        )
    return out


def cells(cfg: Any, process_world: int) -> list[dict]:
    """Models x dtypes x every system's sweep points, in a seeded order per model (as
    harness.measure.expand_grid orders the systems of a workload)."""
    points = {name: system_points(name, conf) for name, conf in selected_systems(cfg).items()}
    rng = random.Random(cfg.seed)
    out = []
    for dtype in cfg.experiment.grid.dtype:
        for m in model_specs(cfg, str(dtype)):
            base = {"world_size": process_world, **m.as_dict(), "model": m.name}
            del base["name"]
            out += workload_cells(cfg, process_world, base, points, rng)
    return out


def spec_of(cell: dict) -> ModelSpec:
    kw = {k: cell[k] for k in ModelSpec.__dataclass_fields__ if k not in ("name", "moe_blocks")}
    return ModelSpec(**kw, name=cell["model"], moe_blocks=tuple(cell["moe_blocks"]))


def validate(cfg: Any, cells: list[dict], sm_count: int) -> None:
    """One-line errors before any process starts: options, every model, every system."""
    tol = float(options(cfg)["model_tol"])
    if not 0 < tol < 1:
        raise ValueError(f"models: model_tol must be in (0, 1), got {tol}")
    for cell in cells:
        m = spec_of(cell)
        m.validate(cell["world_size"])
        cls = get_system(cell["system"]).load()
        if not cls.layer_scope:
            raise ValueError(
                f"models: system {cell['system']} has no layer scope (its MoE call would not "
                "start from the tokens and routing); choose a layer-scope system"
            )
        params = {**cls.PARAMS, **cell["params"]}
        cls.validate(m.moe_spec(cell["world_size"], cell["seed"]), params, sm_count)


@dataclass
class Reference:
    """A model, this rank's input, the float32 MoE oracle and the reference output/routing."""

    key: tuple
    model: MoEModel
    x0: torch.Tensor  # [B, S, H]
    oracle: ReferenceMoE
    out: torch.Tensor  # [B, S, H] the reference model's output
    ids: dict[int, torch.Tensor]  # MoE block -> ids [T, k] of the reference's routing
    imbalance_rank: float
    imbalance_expert: float
    max_rows: int  # most rows any rank sends one expert, over ranks and MoE blocks


_REFERENCE: list[Reference] = []


def reference(ctx: RunContext, m: ModelSpec, seed: int) -> Reference:
    key = (m, seed, ctx.world_size, str(ctx.device))
    if _REFERENCE and _REFERENCE[0].key == key:
        return _REFERENCE[0]
    _REFERENCE.clear()  # one model's weights on the device at a time
    model = MoEModel(m, seed, ctx.device)
    x0 = model_input(m, seed, ctx.rank, ctx.device)
    oracle = ReferenceMoE(m.moe_spec(ctx.world_size, seed), ctx.device)
    out = model(x0, oracle)
    ids = dict(oracle.ids)
    imb_rank = imb_expert = 0.0
    max_rows = 0
    for b in m.moe_blocks:  # the global routing's imbalance, from every rank's counts
        counts = torch.bincount(ids[b].reshape(-1), minlength=m.experts).double()
        max_rows = max(max_rows, int(agree(ctx, float(counts.max()))))
        if torch.distributed.is_initialized():
            torch.distributed.all_reduce(counts)
        per_rank = counts.view(ctx.world_size, -1).sum(1)
        imb_rank = max(imb_rank, float(per_rank.max() / per_rank.mean()))
        imb_expert = max(imb_expert, float(counts.max() / counts.mean()))
    ref = Reference(key, model, x0, oracle, out, ids, imb_rank, imb_expert, max_rows)
    _REFERENCE.append(ref)
    return ref


def _row(cell: dict, m: ModelSpec) -> ModelRow:
    shape = dict(tokens_per_rank=m.tokens, hidden=m.hidden, out=m.hidden, ffn=m.ffn, dtype=m.dtype)
    shape |= dict(experts_per_rank=m.experts // cell["world_size"], top_k=m.top_k, model=m.name)
    return cell_row(cell, ModelRow, scope="model", routing="router", **shape)


def skip_reason(ctx: RunContext, cell: dict, m: ModelSpec) -> str | None:
    info = get_system(cell["system"])
    reason = info.unavailable_reason(ctx, cell["world_size"])
    if reason is None and cell["world_size"] != ctx.world_size:
        reason = f"the model runs one process per rank; cell W={cell['world_size']}"
    if reason is None:
        spec = m.moe_spec(cell["world_size"], cell["seed"])
        cls = info.load()
        reason = cls.unsupported(spec, {**cls.PARAMS, **cell["params"]})
    return reason


def tutel_reason(ref: Reference, m: ModelSpec) -> str | None:
    """Tutel's dropless buffers [G x capacity x max(H, F)] past int32 for this model's routing
    (capacity from the reference routing's busiest (rank, expert), with a 1.5x margin)."""
    elems = m.experts * int(1.5 * ref.max_rows) * max(m.hidden, m.ffn)
    if elems > INT32_MAX:
        return (
            f"tutel's dropless buffers for this model's routing (busiest expert {ref.max_rows} "
            f"rows, x1.5 margin) hold {elems / 2**31:.2f} x 2^31 elements; its kernels index "
            "with int32"
        )
    return None


def _agreed(ctx: RunContext, res: CheckResult) -> tuple[bool, float, float]:
    """(ok on every rank, worst whole error, worst row error) over the ranks."""
    ok = agree(ctx, 0.0 if res.ok else 1.0) == 0.0
    errs = (res.max_rel_err, res.max_row_rel_err)
    return ok, *(agree(ctx, v if v == v else 1e30) for v in errs)  # NaN: the worst


def gate_tolerances(cfg: Any, row: ModelRow) -> tuple[float, float]:
    """(measure.tol, model_tol), the two tolerances of the check, recorded in the row: `tol` is
    the one that gates its max_rel_err (the model output's), m_moe_tol that of each MoE call."""
    tol, model_tol = float(cfg.measure.tol), float(options(cfg)["model_tol"])
    row.tol, row.metrics["moe_tol"] = model_tol, tol
    return tol, model_tol


def _verdict(ctx: RunContext, row: ModelRow, calls: list[CheckResult], b: CheckResult, when: str):
    """Record (a), the worst MoE call (first failure, else largest error), and (b), the model
    output, agreed over the ranks; False after a failure (the row says which, `when` and why)."""
    bad = [r for r in calls if not r.ok]
    a = bad[0] if bad else max(calls, key=lambda r: r.max_rel_err)
    ok_a, err_a, row_a = _agreed(ctx, a)
    ok_b, err_b, row_b = _agreed(ctx, b)
    row.metrics.update(moe_max_rel_err=max(row.metrics.get("moe_max_rel_err", 0.0), err_a))
    row.metrics["moe_max_row_rel_err"] = max(row.metrics.get("moe_max_row_rel_err", 0.0), row_a)
    row.max_rel_err = max(err_b, row.max_rel_err) if row.max_rel_err == row.max_rel_err else err_b
    row.max_row_rel_err = row_b
    if not (ok_a and ok_b):
        what, res = ("a MoE call", a) if not ok_a else ("model output", b)
        at = f"{when}: " if when else ""
        row.status = "fail"
        row.reason = f"{at}{what}: {res.message or 'failed on another rank'}"
    return row.status == "ok"


def _output_check(out: torch.Tensor, ref: Reference, model_tol: float) -> CheckResult:
    H = out.shape[-1]
    return check(out.reshape(-1, H), ref.out.reshape(-1, H), model_tol)


def checked_forward(
    ctx: RunContext, cfg: Any, row: ModelRow, ref: Reference, moe: SystemMoE, when: str = ""
) -> list[tuple] | None:
    """One forward with every MoE block's top-k forced to the reference model's (a near-tie
    cannot flip a token between two bf16 runs): (a) every MoE call against the float32 oracle
    on its inputs, (b) the output against the reference model's (tolerances: gate_tolerances),
    both agreed over the ranks. None after a failure (the row says which and why, no latency),
    else every call's (block, h [T, H], ids [T, k], gate [T, k], oracle [T, H])."""
    tol, model_tol = gate_tolerances(cfg, row)
    calls: list[tuple] = []
    results: list[CheckResult] = []

    def checked(block: int, h, ids, gate):
        out, want = moe(block, h, ids, gate), ref.oracle(block, h, ids, gate)
        calls.append((block, h, ids, gate, want))
        results.append(check(out, want, tol))
        return out

    out = ref.model(ref.x0, checked, forced=ref.ids)
    ok = _verdict(ctx, row, results, _output_check(out, ref, model_tol), when)
    return calls if ok else None


def run_cell(ctx: RunContext, cfg: Any, cell: dict) -> list[Row]:
    m = spec_of(cell)
    row = _row(cell, m)
    gate_tolerances(cfg, row)
    reason = skip_reason(ctx, cell, m)
    if reason is not None:
        row.status, row.reason = "skipped", reason
        return [row]
    guarded(ctx, row, lambda: _measure(ctx, cfg, cell, m, row))
    return [row]


def _measure(ctx: RunContext, cfg: Any, cell: dict, m: ModelSpec, row: ModelRow) -> None:
    ref = reference(ctx, m, cell["seed"])
    row.imbalance_rank, row.imbalance_expert = ref.imbalance_rank, ref.imbalance_expert
    if cell["system"] == "tutel" and tutel_reason(ref, m):
        row.status, row.reason = "skipped", tutel_reason(ref, m)
        return
    spec = m.moe_spec(ctx.world_size, cell["seed"])
    inputs = owned_inputs(cell_inputs(ctx, spec, [ctx.rank])[0][0])
    system = get_system(cell["system"]).load()(ctx, cell["params"])
    system.setup([inputs])
    row.impl, row.transport = system.impl, system.transport
    row.params.update(system.resolved_params())
    calls = checked_forward(ctx, cfg, row, ref, SystemMoE(system, inputs))
    if calls is None:
        return
    mode = graph_mode(getattr(cfg.measure, "graph", "false"))
    why = graph_choice(mode, ctx.device, system.capture_blocker())
    graphs = None
    if why is None:
        try:
            graphs = _Graphs(ctx, ref, system, inputs, calls)
        except RuntimeError as exc:
            why = str(exc)
    row.graph, row.graph_reason = graphs is not None, why or ""
    if graphs:
        timings = _timed_graphs(ctx, cfg, row, ref, graphs)  # checked on replays after timing
    else:
        timings = _timed_eager(ctx, cfg, ref, system, inputs)
        if not checked_forward(ctx, cfg, row, ref, SystemMoE(system, inputs), "after timing"):
            timings = None
    if timings is None:
        return
    t, tm = timings
    copy_in = _copy_in_time(ctx, cfg, ref, m, SystemMoE(system, inputs))
    set_latency(row, t)
    row.metrics.update(moe_ms=tm.median_ms, moe_p10_ms=tm.p10_ms, moe_p90_ms=tm.p90_ms)
    row.metrics.update(moe_blocks=float(len(m.moe_blocks)), copy_in_ms=copy_in)
    row.extra = _extra(m, system, row.graph)


def _timed_eager(ctx: RunContext, cfg: Any, ref: Reference, system, inputs):
    """(forward, MoE) Timings, eager, as _extra describes them."""
    timer = MoETimer(ctx.device)
    moe = SystemMoE(system, inputs, timer)

    def forward():
        timer.new_forward()
        return ref.model(ref.x0, moe)

    kw = dict(device=ctx.device, group=ctx.group)
    t = time_fn(forward, warmup=cfg.measure.warmup, iters=cfg.measure.iters, **kw)
    system.check_errors()
    ms = timer.per_forward_ms()[-cfg.measure.iters :]
    ms = torch.tensor(ms, dtype=torch.float64, device=ctx.device)
    if torch.distributed.is_initialized():  # per iteration, the slowest rank's (as time_fn)
        torch.distributed.all_reduce(ms, op=torch.distributed.ReduceOp.MAX, group=ctx.group)
    return t, summarize(ms.cpu().tolist())


def _copy_in_time(ctx: RunContext, cfg: Any, ref: Reference, m: ModelSpec, moe: SystemMoE):
    """One copy-in of h, ids and gate, eager (ms): what latency_ms pays per MoE call beyond
    system.timed()."""
    h = ref.x0.reshape(-1, m.hidden)
    ids = ref.ids[m.moe_blocks[0]]
    gate = torch.full(ids.shape, 0.5, device=ids.device)  # any [T, k] float32: only copied
    kw = dict(device=ctx.device, group=ctx.group, warmup=1, iters=cfg.measure.iters)
    return time_fn(partial(moe.copy_in, h, ids, gate), **kw).median_ms


class _Graphs:
    """The forced-routing forward captured whole (`model`: its replay rewrites the output) and
    the system's step alone (`moe`, reading the CellInputs that `copy` fills), with the checked
    calls (block, h, ids, gate, oracle) the step is replayed on."""

    def __init__(self, ctx: RunContext, ref: Reference, system, inputs, calls) -> None:
        self.copy = SystemMoE(system, inputs)
        self.calls, self.system = calls, system
        self.model = capture(lambda: ref.model(ref.x0, self.copy, forced=ref.ids), ctx.device)
        _, h, ids, gate, _ = calls[0]
        self.copy.copy_in(h, ids, gate)
        self.moe = capture(system.timed, ctx.device)

    def check(self, ctx: RunContext, cfg: Any, row: ModelRow, ref: Reference, when: str) -> bool:
        """Check (b) on a replay of the model's graph, (a) on a replay of the step's graph per
        MoE call (its inputs copied in), then the system's error words."""
        tol, model_tol = gate_tolerances(cfg, row)
        b = _output_check(self.model.replay(), ref, model_tol)
        results = []
        for _, h, ids, gate, want in self.calls:
            self.copy.copy_in(h, ids, gate)
            results.append(check(self.moe.replay(), want, tol))
        self.system.check_errors()
        return _verdict(ctx, row, results, b, when)


def _timed_graphs(ctx: RunContext, cfg: Any, row: ModelRow, ref: Reference, g: _Graphs):
    """(forward, MoE) Timings under graphs, as _extra describes them; checked on a replay before
    and after timing (None after a failure)."""
    if not g.check(ctx, cfg, row, ref, "graph replay"):
        return None
    kw = dict(device=ctx.device, group=ctx.group)
    kw |= dict(warmup=cfg.measure.warmup, iters=cfg.measure.iters)
    t = time_fn(g.model.replay, **kw)
    per_call = []
    for _, h, ids, gate, _ in g.calls:
        g.copy.copy_in(h, ids, gate)
        per_call.append(time_fn(g.moe.replay, **kw).samples)
    g.system.check_errors()
    if not g.check(ctx, cfg, row, ref, "graph replay after timing"):
        return None
    return t, summarize([sum(s) for s in zip(*per_call)])


def _extra(m: ModelSpec, system, graph: bool) -> str:
    about = {
        "model": m.as_dict(),
        "attention": "data parallel, sdpa" + (" causal" if m.causal else ""),
        "router": f"softmax fp32, top-{m.top_k}, gates renormalised",
        "experts": "one set per model, shared by its MoE blocks",
        "timing": "eager: the plain forward (the model's own top-k)",
        "moe_ms": "events around system.timed() per MoE call, summed per forward",
        "copy_in": "h, ids, gate into the system's CellInputs per call: in latency_ms, "
        "not in m_moe_ms (m_copy_in_ms: one copy-in, eager)",
        "check": "top-k forced to the reference model's; each MoE call vs the fp32 oracle "
        "(measure.tol), the output vs the reference model (model_tol)",
    }
    if graph:
        about |= {
            "timing": "graph: the forward with the reference's top-k (forced; the router still "
            "runs) captured whole and replayed",
            "moe_ms": "the system's step captured alone, replayed on each MoE call's inputs, "
            "summed per forward",
        }
    return json.dumps(about | system.extra, sort_keys=True, default=str)
