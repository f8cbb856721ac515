"""megatron_cutlass with Transformer Engine experts: operator cells run TEGroupedMLP's linear_fc1
(a TE GroupedLinear) as the single-GEMM expert, layer cells TEGroupedMLP as Megatron's TE spec
builds it. TE's math is never imitated: without transformer_engine every cell is skipped with the
reason (the GPU machine gets TE 2.20.2 from the vendor wheels, `make wheels-gpu`).
"""

from __future__ import annotations

from systems.megatron_cutlass import MegatronCutlassSystem


class MegatronTESystem(MegatronCutlassSystem):
    name = "megatron_te"
    layer_experts = "te"
