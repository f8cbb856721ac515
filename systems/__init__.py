"""The catalogue of systems: one `SystemInfo` entry per system, read by the runner and the plots.

Targets are lazy "module:Class" strings, so importing this package imports no GPU code. Adding a
system = one module (a harness.system.System subclass with its PARAMS) + one entry here + (if an
experiment runs it) its entry under `experiment.systems` in conf/experiment/*.yaml.
"""

import os

from harness.system import SystemInfo, register


def package_version(name: str, default: str = "?") -> str:
    """An installed package's version (provenance only), `default` where its metadata is missing."""
    from importlib.metadata import version

    try:
        return version(name)
    except Exception:  # noqa: BLE001 - metadata missing or unreadable
        return default


#: a functional run (`make functional`): the overlap system's kernels in Triton's CPU interpreter,
#: checked, never timed. TRITON_INTERPRET=1 alone does not make one: the kernel tests set it for
#: their whole process, whose other runs must keep skipping the overlap system on the CPU.
FUNCTIONAL = (
    os.environ.get("HARNESS_FUNCTIONAL") == "1" and os.environ.get("TRITON_INTERPRET") == "1"
)

for _info in (
    SystemInfo(
        name="serial",
        label="Serial (GEMM, then all-to-all)",
        target="systems.serial:SerialSystem",
        description="Expert GEMMs with torch, then the combine all-to-all, then scale.",
    ),
    SystemInfo(
        name="overlap",
        label="Overlap (tile-level signalling, this paper)",
        target="systems.overlap.system:OverlapSystem",
        baseline=False,
        needs_gpu=not FUNCTIONAL,
        optional_imports=("triton",),
        description="Stage A plan, persistent Triton producer with per-band ready counters, "
        "flag-polling consumer on cCTA SMs (loopback / p2p / nvshmem / shm), scale.",
    ),
    SystemInfo(
        name="tutel",
        label="Tutel (native moe_layer)",
        target="systems.tutel:TutelSystem",
        needs_gpu=True,
        optional_imports=("tutel",),
        description="The tutel package's moe_layer fed our routing, dropless (capacity_factor "
        "0), a2a_ffn_overlap_degree tuned per cell; FFN cells use Tutel's FFN experts; times the "
        "whole layer.",
    ),
    SystemInfo(
        name="tutel_reimpl",
        label="Tutel strategy (our re-implementation)",
        target="systems.tutel_reimpl:TutelReimplSystem",
        description="Capacity-padded all-to-all split along capacity into d chunks; expert and "
        "combine of chunk i overlap later chunks; d tuned per cell.",
    ),
    SystemInfo(
        name="fastermoe",
        label="FasterMoE (native fmoe)",
        target="systems.fastermoe:FasterMoESystem",
        needs_gpu=True,
        optional_imports=("fmoe",),
        description="The fmoe package's smart schedule fed our routing (shadowing off); "
        "operator cells with K != N are skipped (its buffers need equal widths); FFN cells run "
        "the FFN as expert_fn; times the whole layer.",
    ),
    SystemInfo(
        name="fastermoe_reimpl",
        label="FasterMoE strategy (our re-implementation)",
        target="systems.fastermoe_reimpl:FasterMoEReimplSystem",
        description="Group-step point-to-point exchange; per-step expert GEMMs overlap the "
        "return steps; host-bound (one batch_isend_irecv per step and expert).",
    ),
    SystemInfo(
        name="megatron_cutlass",
        label="Megatron-core + CUTLASS GroupedGEMM",
        target="systems.megatron_cutlass:MegatronCutlassSystem",
        needs_gpu=True,
        optional_imports=("megatron",),
        description="megatron-core MoELayer, all-to-all dispatcher, GroupedMLP fc1 as the expert "
        "(grouped_gemm.gmm, else torch._grouped_mm); layer cells: the whole GroupedMLP.",
    ),
    SystemInfo(
        name="megatron_te",
        label="Megatron-core + Transformer Engine",
        target="systems.megatron_te:MegatronTESystem",
        needs_gpu=True,
        optional_imports=("megatron", "transformer_engine"),
        description="megatron-core MoELayer, all-to-all dispatcher, TE GroupedLinear as the "
        "expert; layer cells: the whole TEGroupedMLP.",
    ),
    SystemInfo(
        name="deepep",
        label="DeepEP low-latency (dispatch, grouped FFN, combine)",
        target="systems.deepep:DeepEPSystem",
        needs_gpu=True,
        optional_imports=("deep_ep",),
        description="deepseek-ai/DeepEP@567632d low-latency Buffer sized for the cell: "
        "low_latency_dispatch into worst-case per-expert buffers plus counts, the FFN experts "
        "over the real rows (torch._grouped_mm, device offsets), low_latency_combine with the "
        "gate; no host sync, graph-captured; layer cells only.",
    ),
    SystemInfo(
        name="megatron_deepep",
        label="Megatron-core + DeepEP (flex dispatcher)",
        target="systems.megatron_deepep:MegatronDeepEPSystem",
        needs_gpu=True,
        min_ranks=2,
        optional_imports=("megatron", "transformer_engine", "deep_ep"),
        description="megatron-core MoELayer, flex token dispatcher on deepseek-ai/DeepEP@567632d "
        "normal kernels (moe_flex_dispatcher_backend=deepep, fp32 router probs), TE grouped "
        "experts; layer cells only; DeepEP's normal kernels need 2+ ranks.",
    ),
):
    register(_info)
