"""Megatron-core's MoELayer with the flex token dispatcher on DeepEP (what Megatron users run at
scale): megatron-core 0.16.1, deepseek-ai/DeepEP at 567632d, Transformer Engine grouped experts.

megatron_common.MegatronLayer with the FLEX settings: DeepEP's normal (high-throughput) kernels
through megatron's fused_a2a (megatron's Buffer), moe_deepep_num_sms = 20 (Megatron's default).
Timed as the whole layer(x [T, 1, H]) -> [T, H]. No bounds: the flex dispatcher's expert step
consumes its dispatch's state (the top-k probs become the multihot map), so the experts cannot
be rerun on held rows. Cells the kernels refuse (`flex_limits`; W=1 among them) are skipped.
"""

from __future__ import annotations

from typing import Any, ClassVar

import torch

from harness.system import Step
from harness.workload import WorkloadSpec
from systems.deepep import UPSTREAM, deepep_version
from systems.megatron_te import MegatronTESystem

#: EP sizes DeepEP's normal kernels have a config for (deep_ep/buffer.py:245-259)
EP_SIZES = (2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 144, 160)
#: the intranode kernels' limits (one node, W <= 8): local experts per rank
#: (csrc/kernels/intranode.cu:154, kNumThreads 128) and a bf16 row's half plus its barrier in a
#: warp's 8192 TMA bytes (intranode.cu:290 with kNumTMABytesPerWarp at :563)
NVL_PEERS = 8
MAX_LOCAL_EXPERTS = 128
MAX_HIDDEN = 8192 - 8
#: the flex dispatcher's settings (megatron/core/transformer/moe/token_dispatcher.py)
FLEX: dict[str, Any] = dict(
    moe_token_dispatcher_type="flex", moe_flex_dispatcher_backend="deepep", moe_router_dtype="fp32"
)


def flex_limits(spec: WorkloadSpec) -> list[str]:
    """Every limit of the flex dispatcher on DeepEP's normal kernels the cell exceeds."""
    W = spec.world_size
    why = []
    if W not in EP_SIZES:
        why.append(
            f"W={W}: its normal kernels have configs for {list(EP_SIZES)} ranks only "
            f"(deep_ep/buffer.py:245-259, 'Unsupported number of EP ranks: {W}'); Megatron's "
            "flex dispatcher asserts TPxEP > 1"
        )
    if spec.dtype != "bfloat16":
        why.append(
            f"dtype {spec.dtype}: its combine takes bf16 only (SWITCH_TYPES, "
            "csrc/kernels/launch.cuh:105-112)"
        )
    if W <= NVL_PEERS and spec.experts_per_rank > MAX_LOCAL_EXPERTS:
        why.append(
            f"{spec.experts_per_rank} experts per rank > {MAX_LOCAL_EXPERTS} "
            "(csrc/kernels/intranode.cu:154)"
        )
    if W <= NVL_PEERS and (spec.hidden % 16 or spec.hidden > MAX_HIDDEN):
        why.append(
            f"hidden {spec.hidden}: a bf16 row of the intranode dispatch must be a multiple of 16 "
            f"elements and at most {MAX_HIDDEN} (half a row and its barrier in 8192 TMA bytes, "
            "csrc/kernels/intranode.cu:290, :563)"
        )
    return why


class FlexLayerStep(Step):
    """The whole MoELayer forward on MegatronLayer `op` (module doc) -> out [T, H]."""

    def __init__(self, op: Any) -> None:
        self.op = op

    def timed(self) -> torch.Tensor:
        return self.op.forward()

    def capture_blocker(self) -> str | None:
        return (
            "flex dispatcher on DeepEP's normal kernels: the dispatch waits on the host for the "
            "received counts, the permute reads their sum"
        )


class MegatronDeepEPSystem(MegatronTESystem):
    name = "megatron_deepep"
    scope = "layer"
    PARAMS: ClassVar[dict[str, Any]] = {"permute_fusion": "auto"}

    @classmethod
    def unsupported(cls, spec: WorkloadSpec, params: dict[str, Any]) -> str | None:
        if not spec.ffn:
            return (
                "megatron_deepep times the whole MoELayer (flex dispatch, experts, combine): "
                "operator cells (ffn=0) are not a layer"
            )
        why = flex_limits(spec)
        if why:
            return f"megatron_deepep (flex dispatcher on {UPSTREAM}): " + "; ".join(why)
        return None

    def _build(self, mc, inputs) -> Step:
        """The real MoELayer on the flex dispatcher (DeepEP's normal kernels)."""
        op = mc.MegatronLayer(inputs, "te", permute_fusion=self.fusion, config=FLEX)
        self._layer_facts(mc, op, f"flex/deepep {deepep_version()}", "flex (deepep)")
        self.extra |= dict(deep_ep=UPSTREAM, deepep_num_sms=op.config.moe_deepep_num_sms)
        return FlexLayerStep(op)

    @property
    def transport(self) -> str:
        """DeepEP's normal kernels: NVLink within a node, NVSHMEM (RDMA) across nodes."""
        return "nvlink" if self.ctx.world_size <= NVL_PEERS else "nvshmem"
