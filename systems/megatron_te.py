"""Megatron-core with Transformer Engine grouped GEMM experts (TEGroupedMLP's GroupedLinear).

The same real MoELayer + all-to-all dispatcher + router stub as megatron_cutlass; the single-GEMM
expert is TEGroupedMLP's linear_fc1, Megatron's TEColumnParallelGroupedLinear wrapping
transformer_engine.pytorch.GroupedLinear, with weight{e} [N, K] = B_e^T copied in
(systems/megatron_common.py). TE's math is never imitated: without transformer_engine the
registry's optional import makes every cell a `skipped` row with the reason. (TE is not on
the development machine; the lent GPU machine gets TE 2.20.2 from the vendor wheels, slimmed to
sm_90: `make wheels-gpu`.)

Timed region (scope "gemm+combine"): as megatron_cutlass, with TE's grouped GEMM.

Layer cells (ffn = F > 0, scope "layer"): the real MoELayer with TEGroupedMLP as Megatron's TE
spec builds it (MLPSubmodules(linear_fc1=TEColumnParallelGroupedLinear,
linear_fc2=TERowParallelGroupedLinear)): fc1 weight{e} [F, H] = W1_e^T, gelu (config's
F.gelu, not TE's op) x probs, fc2 weight{e} [H, F] = W2_e^T; timed as the whole layer forward
x [T, 1, H] -> out [T, H] (megatron_common.MegatronLayer). Param `capacity` as megatron_cutlass:
"padded" runs Megatron's drop-and-pad route (TEGroupedMLP gets fixed host counts).
"""

from __future__ import annotations

from harness.system import CellInputs
from systems.megatron_cutlass import MegatronCutlassSystem


class MegatronTESystem(MegatronCutlassSystem):
    name = "megatron_te"
    layer_experts = "te"

    @classmethod
    def experts_unsupported(cls, spec) -> str | None:
        return None  # unlike GroupedMLP, TEGroupedMLP asserts no dtype

    def experts_cls(self, mc):
        return mc.single_gemm_te_grouped_mlp_cls()

    def impl_name(self, mc, inputs: CellInputs) -> str:
        import transformer_engine

        te = getattr(transformer_engine, "__version__", "?")
        return (
            f"native (mcore {mc.mcore_version()} MoELayer+alltoall; experts TE {te} GroupedLinear)"
        )
