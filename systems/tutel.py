"""Tutel, the real package (microsoft/tutel): `tutel.moe.moe_layer` fed the harness routing.

As Tutel users run it: a top-k gate with `capacity_factor` (0 = Tutel's dropless: capacity from
the busiest expert, so the output equals the reference) and a2a_ffn_overlap_degree d tuned per
cell. The router stub's logits (`router_logits`, rebuilt on every forward inside the timed
region, as Megatron's stub) give exactly the cell's routing. Experts: single-GEMM custom experts
(operator cells) or Tutel's FusedExpertsNetwork with our weights (`_tutel_ffn`). Timed region:
the whole moe_layer, x [T, K] -> out [T, N]. Needs CUDA and `tutel`.
"""

from __future__ import annotations

import functools
from typing import Any, ClassVar

import torch
import torch.distributed as dist

from harness.routing import owner_expert_counts
from harness.system import CellInputs, Step, System, int_param, list_param
from harness.timing import time_fn
from harness.workload import WorkloadSpec, routing_of
from systems import package_version

DEFAULT_DEGREES = (1, 2, 4, 8)
#: Tutel's encode / decode kernels index its buffers with 32-bit ints
INT32_MAX = 2**31 - 1


def buffer_width(spec: WorkloadSpec) -> int:
    """Row width of Tutel's widest per-expert buffer [experts x capacity x width]: max(K, N);
    FFN cells: max(H, F) (fc1's output [E, W*C, F] is as many rows as the dispatch buffer)."""
    return max(spec.hidden, spec.out, spec.ffn)


def expert_counts(spec: WorkloadSpec) -> torch.Tensor:
    """cnt [W, G]: rows source rank s sends to global expert g (from the seeded routing)."""
    return owner_expert_counts(routing_of(spec).expert_ids, spec.experts_per_rank)


class MoeLayerStep(Step):
    """Tutel's moe_layer on this rank's tokens x [T, K] at a2a_ffn_overlap_degree `degree`
    (set by the tuning) -> out [T, N], its router stub reading expert_ids [T, k] and gate
    [T, k] on every forward."""

    def __init__(self, layer: Any, inputs: CellInputs) -> None:
        self.layer, self.x = layer, inputs.x
        self.ids, self.gate = inputs.expert_ids, inputs.gate  # [T, k], read on every forward
        self.degree = 1
        G = inputs.spec.n_experts
        layer.gates[0].forward = lambda x: router_logits(self.ids, self.gate, G)

    def set_degree(self, d: int) -> None:
        self.degree = d

    def timed(self) -> torch.Tensor:
        with torch.no_grad():
            return self.layer(self.x, a2a_ffn_overlap_degree=self.degree)

    def capture_blocker(self) -> str | None:
        return "tutel: its step is not declared capturable"


class TutelSystem(System):
    name = "tutel"
    scope = "layer"
    layer_scope = True
    PARAMS: ClassVar[dict[str, Any]] = dict(
        degrees=list(DEFAULT_DEGREES), degree=0, tune_iters=3, capacity_factor=0.0
    )

    @classmethod
    def validate(cls, spec: WorkloadSpec, params: dict[str, Any], sm_count: int) -> None:
        check_tuning(params)
        cf = params["capacity_factor"]
        if isinstance(cf, bool) or not isinstance(cf, (int, float)):
            raise ValueError(f"tutel: capacity_factor must be a number, got {cf!r}")
        if float(cf) < 0:
            raise ValueError("tutel: capacity_factor must be >= 0 (0 = dropless)")

    @classmethod
    def unsupported(cls, spec: WorkloadSpec, params: dict[str, Any]) -> str | None:
        """Dropless buffers past 2^31 elements: Tutel's int32 indexing faults on them."""
        if float(params["capacity_factor"]) != 0:
            return None
        cap = int(expert_counts(spec).max())  # Tutel's dropless capacity: the busiest pair's rows
        width = buffer_width(spec)
        elems = spec.n_experts * cap * width
        if elems > INT32_MAX:
            what = "max(H, F)" if spec.ffn else "max(K, N)"
            return (
                f"tutel's dropless buffers [experts {spec.n_experts} x capacity {cap} x "
                f"{what} {width}] hold {elems / 2**31:.2f} x 2^31 elements; its "
                "encode/decode kernels index with int32 (measured: an illegal memory access at "
                "W=2 T=8192 K=2048 N=4096 E=64 stress_skew, which poisons the CUDA context)"
            )
        return None

    def build(self, ranks: list[CellInputs]) -> Step:
        """Tutel's moe_layer with the cell's experts, its degree tuned on the cell."""
        from tutel import moe as tutel_moe

        (inputs,) = ranks
        spec, ctx, dev = inputs.spec, self.ctx, inputs.x.device
        cf = float(self.params["capacity_factor"])
        if spec.ffn:
            fc1_w, fc2_w = tutel_ffn_weights(inputs.w1, inputs.weights)
            experts = {"type": "custom", "module": _tutel_ffn(), "fc1_w": fc1_w, "fc2_w": fc2_w}
        else:
            experts = {"type": "custom", "module": _TutelSingleGemm, "weight": inputs.weights}
        layer = tutel_moe.moe_layer(
            gate_type={"type": "top", "k": spec.top_k, "capacity_factor": cf, "fp32_gate": True},
            model_dim=spec.hidden,
            experts={**experts, "count_per_node": spec.experts_per_rank},
            group=ctx.group or dist.group.WORLD,
        ).to(dev)
        step = MoeLayerStep(layer, inputs)
        tune_degree(self, step, candidates(self.params))
        self.extra.update(
            capacity_factor=cf,
            dropless=cf == 0,
            tutel_version=package_version("tutel"),
            experts="tutel.experts.ffn.FusedExpertsNetwork" if spec.ffn else "single GEMM",
        )
        return step

    def resolved_params(self) -> dict[str, Any]:
        return {"degree_tuned": self.extra.get("degree", 0)}

    @property
    def impl(self) -> str:
        return f"native (tutel {package_version('tutel')} moe_layer, a2a_ffn_overlap_degree)"


def router_logits(ids: torch.Tensor, gate: torch.Tensor, n_experts: int) -> torch.Tensor:
    """The router stub's logits [T, G] float32 from ids [T, k] and gate [T, k] (rows summing to
    one): log(gate) at the chosen experts, -1e9 elsewhere, so Tutel's softmax, top-k and
    normalisation give back exactly (ids, gate)."""
    logits = torch.full((ids.shape[0], n_experts), -1e9, dtype=torch.float32, device=ids.device)
    return logits.scatter_(1, ids, gate.float().clamp_min(1e-30).log())


def tune_degree(system: System, step: Any, degrees: list[int]) -> None:
    """step.set_degree(d) for the candidate d with the lowest median step time (the max over
    ranks: all agree), into system.extra as degree and degree_ms (degree_oom: the d skipped
    because step.set_degree raised OutOfMemoryError, which it does on every rank at once)."""
    times: dict[int, float] = {}
    oom: list[int] = []
    if len(degrees) > 1:
        iters = int(system.params.get("tune_iters", 3))
        kw = dict(device=system.ctx.device, group=system.ctx.group, warmup=1, iters=iters)
        for d in degrees:
            try:
                step.set_degree(d)
            except torch.cuda.OutOfMemoryError:
                oom.append(d)  # every rank skips it: set_degree agrees on the failure
                continue
            times[d] = time_fn(step.timed, **kw).median_ms
        if not times:  # only tutel_reimpl's set_degree allocates
            raise torch.cuda.OutOfMemoryError(
                f"tutel padded buffers (capacity {step.cap_max}) fit for no degree in {oom}"
            )
    best = min(times, key=times.get) if times else degrees[0]
    step.set_degree(best)
    system.extra["degree"] = best
    system.extra["degree_ms"] = {str(d): round(v, 4) for d, v in times.items()}
    if oom:
        system.extra["degree_oom"] = oom


def check_tuning(params: dict[str, Any]) -> None:
    """degree (0 = tune), degrees and tune_iters are integers, and there is a degree to try."""
    int_param("tutel", "degree", params.get("degree", 0), least=0)
    int_param("tutel", "tune_iters", params.get("tune_iters", 3), least=1)
    for d in list_param("tutel", "degrees", params.get("degrees", DEFAULT_DEGREES)):
        int_param("tutel", "degrees", d, least=1)
    if not candidates(params):
        raise ValueError("tutel: degrees must be positive integers, got []")


def candidates(params: dict[str, Any]) -> list[int]:
    """The degrees to try: [degree] when fixed (> 0), else `degrees`."""
    fixed = int(params.get("degree", 0) or 0)
    return [fixed] if fixed else [int(d) for d in params.get("degrees", DEFAULT_DEGREES)]


class _TutelSingleGemm(torch.nn.Module):
    """Tutel custom expert: x [E, W*C, K] -> x @ B [E, W*C, N] (one GEMM per expert)."""

    def __init__(
        self, model_dim: int, num_experts_per_device: int, sharded_count: int, weight: torch.Tensor
    ) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(weight, requires_grad=False)

    def forward(self, x: torch.Tensor, ctx: Any = None) -> torch.Tensor:
        return torch.bmm(x.reshape(x.shape[0], -1, x.shape[-1]), self.weight)


def tutel_ffn_weights(w1: torch.Tensor, w2: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Our FFN weights in Tutel's FusedExpertsNetwork layout (x @ fc1_w.permute(0, 2, 1), then
    h @ fc2_w): w1 [E, H, F] -> batched_fc1_w [E, F, H]; w2 [E, F, H] as it is."""
    return w1.transpose(1, 2).contiguous(), w2.contiguous()


@functools.cache
def _tutel_ffn() -> type:
    """Tutel's FFN expert class, built with our weights (imports tutel on first use)."""
    from tutel.experts.ffn import FusedExpertsNetwork

    from harness.experts import activation

    class TutelFFN(FusedExpertsNetwork):
        """Tutel's FusedExpertsNetwork (experts type "ffn"): no biases, GELU (erf), weights
        fc1_w / fc2_w [E, F, H] from tutel_ffn_weights. x [E, W*C, H] -> [E, W*C, H]. Passed as
        a custom module only to skip Tutel's random init of weights we overwrite anyway."""

        def __init__(
            self, model_dim: int, num_experts_per_device: int, sharded_count: int, fc1_w, fc2_w
        ) -> None:
            kw = dict(activation_fn=activation, has_fc1_bias=False, has_fc2_bias=False)
            super().__init__(model_dim, fc1_w.shape[1], num_experts_per_device, sharded_count, **kw)
            self.batched_fc1_w = torch.nn.Parameter(fc1_w, requires_grad=False)
            self.batched_fc2_w = torch.nn.Parameter(fc2_w, requires_grad=False)

        def reset_parameters(self) -> None:
            """No random init: the weights are ours (set right after)."""

    return TutelFFN
