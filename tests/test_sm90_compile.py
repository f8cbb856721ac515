"""Kernels compile for Hopper (sm_90) on a CPU machine, with Triton's own ptxas: what the
interpreter tests cannot show (it runs Python, so a kernel it accepts may not compile).

The device plan's row kernel, whose last program runs the groups body (`_rows_kernel`, both
layouts): its code grows slowly with the experts per rank.

Built as [EP, EP] tiles in registers, the compact group kernel took about a minute to compile at
E=64, W=4 (50 thousand PTX lines against 3 thousand at E=4: Triton recomputed the [EP, WP] chains
of the pairwise sums for every element), and each new specialisation stalled a correctness run
by 80-90 s on the H200. The sums now read the other experts' values back from memory in chunks
(kernels/plan.py, `_sums_before`). Compiled in a fresh process (other test files import triton
under the interpreter) with Triton's own ptxas; no GPU needed.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("triton")

_SCRIPT = r"""
import json, sys
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from systems.overlap.kernels import plan as kplan

SCALARS = {"R", "rank", "E", "W", "tm", "mgb"}
out = {}
fn = kplan._rows_kernel
for layout in ("aligned", "compact"):
    for E, W in ((8, 4), (64, 4)):
        consts = dict(EP=E, WP=W, HAS_N=False, HAS_SEND=True, COMPACT=layout == "compact")
        consts["BLOCK"] = 1024
        sig = {}
        for p in fn.params:
            if p.is_constexpr:
                sig[p.name] = "constexpr"
                if p.name not in consts:
                    consts[p.name] = p.default
            else:
                sig[p.name] = "i32" if p.name in SCALARS else "*i64"
        k = triton.compile(
            ASTSource(fn=fn, signature=sig, constexprs=consts),
            target=GPUTarget("cuda", 90, 32),
            options={"num_warps": 4},
        )
        out[f"{layout} {E}"] = k.asm["ptx"].count("\n")
json.dump(out, sys.stdout)
"""


def _run(script: str) -> str:
    """The script's stdout, in a fresh process without the interpreter."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = root + os.pathsep + env.get("PYTHONPATH", "")
    proc = subprocess.run(
        [sys.executable, "-c", script],
        cwd=root,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout


def test_group_kernels_code_does_not_grow_with_experts_squared():
    lines = json.loads(_run(_SCRIPT))
    for layout in ("aligned", "compact"):
        small, large = lines[f"{layout} 8"], lines[f"{layout} 64"]
        assert large < 2 * small, f"{layout}: {large} PTX lines at E=64 against {small} at E=8"
