"""Host glue of the CUTLASS producer (kernels/cutlass_producer.cu): build, load, launch.

The kernel is a CUTLASS 3.x Hopper grouped GEMM (sm_90a; tile 128x256x64, cooperative warp
specialisation; groups = one band each in the producer's visiting order, or one expert's row
range each) whose epilogue releases the per-band ready counters after the tile's TMA stores
have completed. It is a kernel-benchmark variant (experiment=producer): it ties the Triton
producer there (results/reference/h200/producer_cutlass.parquet), so the overlap system keeps
the Triton one. It is built once with
nvcc from the C++ headers of the `nvidia-cutlass` wheel (`make cutlass`, or `build()`), as a
shared library with a C ABI loaded through ctypes: no torch extension build, so it compiles on
a machine without a GPU. The library is looked up at $MOE_CUTLASS_LIB, else
build/libmoe_cutlass_sm90.so under the repository root.

Readiness: a signalled band's counter grows by band_increment(N) = ceil(N / 256) per run (one
per finished tile), epoch values as for the Triton producer. Local bands can only be written to
Y (no epilogue scatter into the receive buffer): the runner keeps local="copy" with it.
"""

from __future__ import annotations

import ctypes
import importlib.util
import os
import subprocess
from pathlib import Path
from typing import Any

import torch

from systems.overlap.operands import check_producer_operands

ROOT = Path(__file__).resolve().parents[2]
SOURCE = ROOT / "systems" / "overlap" / "kernels" / "cutlass_producer.cu"
DEFAULT_LIB = ROOT / "build" / "libmoe_cutlass_sm90.so"
BLOCK_M, BLOCK_N = 128, 256
DTYPE_CODES = {torch.bfloat16: 0, torch.float16: 1}
#: cluster shapes (M x N CTAs) built into the library: 1x1; 1x2 (two N tiles share the A tile);
#: 2x1 (two M tiles share the weight tile: the per-expert grouping, as torch._grouped_mm)
CLUSTERS = {(1, 1): 11, (1, 2): 12, (2, 1): 21}
#: group = one band in the visiting order, or one expert's row range (experts in the order of
#: their first remote band)
GROUPINGS = {"band": 0, "expert": 1}


class CutlassUnavailable(RuntimeError):
    """The CUTLASS producer cannot run here (no library, no sm_90 GPU)."""


def band_increment(n: int) -> int:
    """What one run adds to a signalled band's counter: one per 256-column tile."""
    return -(-n // BLOCK_N)


def library_path() -> Path:
    return Path(os.environ.get("MOE_CUTLASS_LIB", str(DEFAULT_LIB)))


def nvcc_command(out: Path) -> list[str]:
    """The nvcc line that builds the library from the nvidia-cutlass wheel's headers."""
    spec = importlib.util.find_spec("cutlass_library")  # the headers only: no module import
    if spec is None or not spec.submodule_search_locations:
        raise CutlassUnavailable("pip install --no-deps nvidia-cutlass==4.2.0.0 (its C++ headers)")
    src = Path(spec.submodule_search_locations[0]) / "source"
    return [
        os.environ.get("NVCC", "nvcc"),
        "-std=c++17",
        "-O3",
        "-DNDEBUG",
        "-gencode=arch=compute_90a,code=sm_90a",
        "--expt-relaxed-constexpr",
        "-Xcompiler",
        "-fPIC",
        "-shared",
        f"-I{src / 'include'}",
        f"-I{src / 'tools' / 'util' / 'include'}",
        "-o",
        str(out),
        str(SOURCE),
    ]


def build(out: Path | None = None) -> Path:
    """Compile the library (about a minute: six instances, bf16/fp16 x three clusters)."""
    out = out or library_path()
    out.parent.mkdir(parents=True, exist_ok=True)
    subprocess.run(nvcc_command(out), check=True)
    return out


_LIB: ctypes.CDLL | None = None


def load() -> ctypes.CDLL:
    """The loaded library; CutlassUnavailable (with the reason) where it cannot run."""
    global _LIB
    if _LIB is not None:
        return _LIB
    path = library_path()
    if not path.exists():
        raise CutlassUnavailable(f"no {path}: build it with `make cutlass` (nvcc + nvidia-cutlass)")
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0):
        raise CutlassUnavailable("the CUTLASS producer is built for sm_90a (H100/H200) only")
    lib = ctypes.CDLL(str(path))
    i, i64, p, sz = ctypes.c_int, ctypes.c_int64, ctypes.c_void_p, ctypes.c_size_t
    lib.moe_cutlass_args_bytes.argtypes = [i, i]
    lib.moe_cutlass_args_bytes.restype = sz
    lib.moe_cutlass_workspace_bytes.argtypes = [i, i, i, i, ctypes.POINTER(sz)]
    lib.moe_cutlass_run.argtypes = [i, i, p, p, p, i, i, i, i, i] + [p] * 6 + [i64] + [p] * 4
    lib.moe_cutlass_run.argtypes += [i, p]
    lib.moe_cutlass_error.argtypes = [i]
    lib.moe_cutlass_error.restype = ctypes.c_char_p
    _LIB = lib
    return lib


def _ptr(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


def _i64(t: torch.Tensor) -> torch.Tensor:
    return t if t.dtype == torch.int64 and t.is_contiguous() else t.to(torch.int64).contiguous()


class CutlassProducer:
    """One rank's CUTLASS producer with its argument and workspace buffers (grown on demand).

    launch(x [P, K], weights [E, K, N], y [P, N], plan, band_ready [B] int32, ...) runs the
    group-preparation kernel and the grouped GEMM on the current stream; same plan contract as
    kernels/producer.py launch_producer (CombinePlan or DevicePlan, n_signal, order; `order`
    only applies to the per-band grouping)."""

    def __init__(self, cluster: tuple[int, int] = (1, 2), grouping: str = "band"):
        if tuple(cluster) not in CLUSTERS:
            raise ValueError(f"cluster must be one of {sorted(CLUSTERS)}, got {cluster}")
        if grouping not in GROUPINGS:
            raise ValueError(f"grouping must be one of {sorted(GROUPINGS)}, got {grouping}")
        self.cluster, self.grouping = tuple(cluster), grouping
        self._code = CLUSTERS[self.cluster]
        self._bufs: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}

    def _buffers(
        self, code: int, groups: int, bands: int, sms: int, device
    ) -> tuple[torch.Tensor, ...]:
        key = (code, groups, bands, sms, str(device))
        if key not in self._bufs:
            lib = load()
            size = ctypes.c_size_t(0)
            rc = lib.moe_cutlass_workspace_bytes(code, self._code, groups, sms, size)
            if rc != 0:
                raise RuntimeError(f"cutlass producer: {lib.moe_cutlass_error(rc).decode()}")
            nargs = lib.moe_cutlass_args_bytes(groups, bands)
            u8 = {"dtype": torch.uint8, "device": device}
            self._bufs[key] = (torch.empty(nargs, **u8), torch.empty(max(size.value, 16), **u8))
        return self._bufs[key]

    def launch(
        self,
        x: torch.Tensor,
        weights: torch.Tensor,
        y: torch.Tensor,
        plan: Any,
        band_ready: torch.Tensor,
        *,
        num_programs: int,
        n_signal: int | torch.Tensor | None = None,
        order: torch.Tensor | None = None,
    ) -> None:
        P, K, E, N = check_producer_operands("cutlass producer", x, weights, y, band_ready)
        if x.dtype not in DTYPE_CODES:
            raise ValueError(f"cutlass producer: dtype must be bf16/fp16, got {x.dtype}")
        if K % 8 or N % 8:
            raise ValueError(f"cutlass producer: K={K} and N={N} must be multiples of 8")
        bands = plan.schedule.numel()  # B, or the bound B' of a DevicePlan
        if bands == 0:
            return
        groups = bands if self.grouping == "band" else E
        n_signal = plan.n_remote_bands if n_signal is None else n_signal
        dev_counts = getattr(plan, "counts_on_device", False)
        n_bands_dev = plan.n_bands.reshape(1) if dev_counts else None
        sig_dev = _i64(n_signal.reshape(1)) if isinstance(n_signal, torch.Tensor) else None
        sig_host = 0 if sig_dev is not None else int(n_signal)
        code = DTYPE_CODES[x.dtype]
        args, ws = self._buffers(code, groups, bands, num_programs, x.device)
        keep = [_i64(a) for a in (plan.schedule, plan.band_expert, plan.band_row, plan.band_rows)]
        order64 = None if order is None else _i64(order)
        nb = None if n_bands_dev is None else _i64(n_bands_dev)
        lib = load()
        rc = lib.moe_cutlass_run(
            code,
            self._code,
            x.data_ptr(),
            weights.data_ptr(),
            y.data_ptr(),
            bands,
            N,
            K,
            groups,
            GROUPINGS[self.grouping],
            keep[0].data_ptr(),
            _ptr(order64),
            keep[1].data_ptr(),
            keep[2].data_ptr(),
            keep[3].data_ptr(),
            _ptr(nb),
            sig_host,
            _ptr(sig_dev),
            band_ready.data_ptr(),
            args.data_ptr(),
            ws.data_ptr(),
            num_programs,
            torch.cuda.current_stream(x.device).cuda_stream,
        )
        if rc != 0:
            raise RuntimeError(f"cutlass producer: {lib.moe_cutlass_error(rc).decode()}")


if __name__ == "__main__":  # make cutlass
    print(build())
