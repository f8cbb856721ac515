"""Tutel, the real package (microsoft/tutel): `tutel.moe.moe_layer` fed the harness routing.

The layer runs as Tutel users run it: a top-k gate with `capacity_factor` (0 = dropless, Tutel's
own semantics: capacity from the busiest expert, so no token is dropped and the output equals the
reference), single-GEMM custom experts (x [E, W*C, K] @ B [E, K, N]), and Tutel's adaptive
pipelining degree `a2a_ffn_overlap_degree` = d, tuned per cell: every candidate in `degrees` is
timed on the cell and the fastest kept (the choice and every candidate's time are in the row).
The router is a stub whose logits make the gate's top-k and normalised weights exactly the
harness routing (log w on the chosen experts, -1e9 elsewhere).

Timed region (scope "layer"): the whole moe_layer from this rank's tokens x [T, K]: gate stub,
Tutel's encode, dispatch all-to-all, experts, combine all-to-all and decode -> out [T, N].
Needs CUDA and the `tutel` package (the registry skips the system with the reason otherwise).
The re-implementation of the same strategy is the separate system `tutel_reimpl`.
"""

from __future__ import annotations

from typing import Any, ClassVar

import torch
import torch.distributed as dist

from harness.system import CellInputs, System
from harness.timing import time_fn
from harness.workload import WorkloadSpec, routing_of

DEFAULT_DEGREES = (1, 2, 4, 8)
#: Tutel's encode / decode kernels index its buffers with 32-bit ints
INT32_MAX = 2**31 - 1


def dropless_capacity(spec: WorkloadSpec) -> int:
    """Tutel's dropless capacity C: the busiest (source rank, global expert) pair's rows."""
    ids = routing_of(spec).expert_ids  # [W, T, k]
    return max(
        int(torch.bincount(ids[r].reshape(-1), minlength=spec.n_experts).max())
        for r in range(spec.world_size)
    )


class TutelSystem(System):
    name = "tutel"
    scope = "layer"
    PARAMS: ClassVar[dict[str, Any]] = {
        "degrees": list(DEFAULT_DEGREES),
        "degree": 0,
        "tune_iters": 3,
        "capacity_factor": 0.0,
    }

    @classmethod
    def validate(cls, spec: WorkloadSpec, params: dict[str, Any], sm_count: int) -> None:
        degrees = candidates(params)
        if not degrees or any(d < 1 for d in degrees):
            raise ValueError(f"tutel: degrees must be positive integers, got {degrees}")
        if float(params["capacity_factor"]) < 0:
            raise ValueError("tutel: capacity_factor must be >= 0 (0 = dropless)")

    @classmethod
    def unsupported(cls, spec: WorkloadSpec, params: dict[str, Any]) -> str | None:
        """Dropless buffers past 2^31 elements: Tutel's int32 indexing faults on them."""
        if float(params["capacity_factor"]) != 0:
            return None
        cap = dropless_capacity(spec)
        elems = spec.n_experts * cap * max(spec.hidden, spec.out)
        if elems > INT32_MAX:
            return (
                f"tutel's dropless buffers [experts {spec.n_experts} x capacity {cap} x "
                f"{max(spec.hidden, spec.out)}] hold {elems / 2**31:.2f} x 2^31 elements; its "
                "encode/decode kernels index with int32 (measured: an illegal memory access at "
                "W=2 T=8192 K=2048 N=4096 E=64 stress_skew, which poisons the CUDA context)"
            )
        return None

    def setup(self, ranks: list[CellInputs]) -> None:
        from tutel import moe as tutel_moe

        (inputs,) = ranks
        spec, ctx, dev = inputs.spec, self.ctx, inputs.x.device
        routing = routing_of(spec)
        ids = routing.expert_ids[ctx.rank].to(dev)  # [T, k]
        w = routing.gate_weights[ctx.rank].to(dev)  # [T, k]
        logits = torch.full(
            (spec.tokens_per_rank, spec.n_experts), -1e9, dtype=torch.float32, device=dev
        )
        logits.scatter_(1, ids, w.clamp_min(1e-30).log())
        cf = float(self.params["capacity_factor"])
        self.layer = tutel_moe.moe_layer(
            gate_type={"type": "top", "k": spec.top_k, "capacity_factor": cf, "fp32_gate": True},
            model_dim=spec.hidden,
            experts={
                "type": "custom",
                "module": _TutelSingleGemm,
                "count_per_node": spec.experts_per_rank,
                "weight": inputs.weights,
            },
            group=ctx.group or dist.group.WORLD,
        ).to(dev)
        self.layer.gates[0].forward = lambda x: logits  # router stub: the harness routing
        self.x = inputs.x
        self.degree = self._tune(candidates(self.params))
        self.extra.update(
            capacity_factor=cf,
            dropless=cf == 0,
            tutel_version=_version(),
        )

    def _tune(self, degrees: list[int]) -> int:
        """The candidate d with the lowest median layer time (max over ranks: all agree)."""
        times = {}
        if len(degrees) > 1:
            for d in degrees:
                self.degree = d
                t = time_fn(
                    self.forward,
                    device=self.ctx.device,
                    group=self.ctx.group,
                    warmup=1,
                    iters=int(self.params["tune_iters"]),
                )
                times[d] = t.median_ms
        best = min(times, key=times.get) if times else degrees[0]
        self.extra["degree"] = best
        self.extra["degree_ms"] = {str(d): round(v, 4) for d, v in times.items()}
        return best

    def forward(self) -> torch.Tensor:
        with torch.no_grad():
            return self.layer(self.x, a2a_ffn_overlap_degree=self.degree)

    def resolved_params(self) -> dict[str, Any]:
        return {"degree_tuned": self.degree}

    @property
    def impl(self) -> str:
        return f"native (tutel {_version()} moe_layer, a2a_ffn_overlap_degree)"


def candidates(params: dict[str, Any]) -> list[int]:
    """The degrees to try: [degree] when fixed (> 0), else `degrees`."""
    fixed = int(params.get("degree", 0) or 0)
    return [fixed] if fixed else [int(d) for d in params.get("degrees", DEFAULT_DEGREES)]


def _version() -> str:
    try:
        from importlib.metadata import version

        return version("tutel")
    except Exception:  # noqa: BLE001 - provenance only
        return "?"


class _TutelSingleGemm(torch.nn.Module):
    """Tutel custom expert: x [E, W*C, K] -> x @ B [E, W*C, N] (one GEMM per expert)."""

    def __init__(
        self, model_dim: int, local_experts: int, sharded_count: int, weight: torch.Tensor
    ) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(weight, requires_grad=False)

    def forward(self, x: torch.Tensor, ctx: Any = None) -> torch.Tensor:
        return torch.bmm(x.reshape(x.shape[0], -1, x.shape[-1]), self.weight)
