"""The catalogue of systems: one `SystemInfo` entry per system, read by the runner and the plots.

Targets are lazy "module:Class" strings, so importing this package imports no GPU code. Adding a
system = a harness.system.System subclass with its PARAMS + one entry here + (if an experiment
runs it) its entry under `experiment.systems` in conf/experiment/*.yaml.
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
    ),
    SystemInfo(
        name="overlap",
        label="Overlap (tile-level signalling, this paper)",
        target="systems.overlap.system:OverlapSystem",
        needs_gpu=not FUNCTIONAL,
        optional_imports=("triton",),
    ),
    SystemInfo(
        name="tutel",
        label="Tutel (native moe_layer)",
        target="systems.tutel:TutelSystem",
        needs_gpu=True,
        optional_imports=("tutel",),
    ),
    SystemInfo(
        name="tutel_reimpl",
        label="Tutel strategy (our re-implementation)",
        target="systems.tutel_reimpl:TutelReimplSystem",
    ),
    SystemInfo(
        name="fastermoe",
        label="FasterMoE (native fmoe)",
        target="systems.fastermoe:FasterMoESystem",
        needs_gpu=True,
        optional_imports=("fmoe",),
    ),
    SystemInfo(
        name="fastermoe_reimpl",
        label="FasterMoE strategy (our re-implementation)",
        target="systems.fastermoe_reimpl:FasterMoEReimplSystem",
    ),
    SystemInfo(
        name="megatron_cutlass",
        label="Megatron-core + CUTLASS GroupedGEMM",
        target="systems.megatron_cutlass:MegatronCutlassSystem",
        needs_gpu=True,
        optional_imports=("megatron",),
    ),
    SystemInfo(
        name="megatron_te",
        label="Megatron-core + Transformer Engine",
        target="systems.megatron_te:MegatronTESystem",
        needs_gpu=True,
        optional_imports=("megatron", "transformer_engine"),
    ),
    SystemInfo(
        name="deepep",
        label="DeepEP low-latency (dispatch, grouped FFN, combine)",
        target="systems.deepep:DeepEPSystem",
        needs_gpu=True,
        optional_imports=("deep_ep",),
    ),
    SystemInfo(
        name="megatron_deepep",
        label="Megatron-core + DeepEP (flex dispatcher)",
        target="systems.megatron_deepep:MegatronDeepEPSystem",
        needs_gpu=True,
        min_ranks=2,
        optional_imports=("megatron", "transformer_engine", "deep_ep"),
    ),
):
    register(_info)
