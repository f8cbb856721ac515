"""A fast path for tl.xor_sum in Triton 3.6's CPU interpreter, for the tests.

The interpreter reduces a combine it does not know one element at a time in Python
(ReduceOps.generic_reduce). tl.sort's bitonic network calls xor_sum at every stage, so the
interpreter tests of sort_meta (harness/kernels/dispatch.py) spent most of their time there
(test_layer's interpreter scripts: 33 s -> 7 s). install() reduces that one combine with numpy's
bitwise_xor, the same values (test_fast_interpreter.py checks both paths agree); every other
reduction takes the interpreter's own path. Call it after TRITON_INTERPRET=1 is set.
"""

from __future__ import annotations

import os


def install() -> bool:
    """Add the fast path where Triton's interpreter runs; True where it is in place."""
    if os.environ.get("TRITON_INTERPRET") != "1":
        return False
    import numpy as np
    import triton.language as tl
    from triton.runtime import interpreter

    ops = interpreter.ReduceOps
    if getattr(ops, "fast_xor", False):
        return True
    slow = ops.apply_impl

    def apply_impl(self, input):
        if self.combine_fn != tl.standard._xor_combine:
            return slow(self, input)
        x = input[0]
        data = np.bitwise_xor.reduce(x.handle.data, axis=self.axis, keepdims=self.keep_dims)
        return self.to_tensor(data, x.dtype)

    ops.apply_impl, ops.fast_xor = apply_impl, True
    return True
