"""A faster tl.associative_scan for Triton's CPU interpreter, installed by conftest.py for the tests.

The interpreter runs a scan with a custom combine function (the auxiliary states' first-order scan,
`_first_order`) one element at a time: for a [64, 32] block that is 2048 calls of the combine
function, each building Triton tensors, which made a third of the time of every test of a spec with
an auxiliary state. A combine function of associative_scan is elementwise, so the same left-to-right
fold can run one step along the axis at a time on the whole slice across the other axes: the same
operations in the same order on each element, hence the same bits (tests/test_interpreter_scan.py
compares the two). Only the interpreter is touched; compiled kernels on a GPU never see this.
"""
from __future__ import annotations

import numpy as np


def sliced_generic_scan(self, input):
    """ScanOps.generic_scan with the combine function applied to whole slices across the axis."""
    data = [arg.handle.data for arg in input]
    out = [np.zeros(d.shape, dtype=d.dtype) for d in data]
    axis, n = self.axis, data[0].shape[self.axis]

    def at(i):
        index = [slice(None)] * data[0].ndim
        index[axis] = i
        return tuple(index)

    for o, d in zip(out, data):
        o[at(0)] = d[at(0)]
    for i in range(1, n):
        acc = tuple(self.to_tensor(o[at(i - 1)], arg.dtype) for o, arg in zip(out, input))
        cur = tuple(self.to_tensor(d[at(i)], arg.dtype) for d, arg in zip(data, input))
        ret = self.combine_fn.fn(*acc, *cur)
        ret = ret if isinstance(ret, tuple) else (ret,)
        for o, r in zip(out, ret):
            value, shape = np.asarray(r.handle.data if hasattr(r, "handle") else r), o[at(i)].shape
            o[at(i)] = value.reshape(shape) if value.size == np.prod(shape) else np.broadcast_to(value, shape)
    return [self.to_tensor(o, arg.dtype) for o, arg in zip(out, input)]


def install():
    """Swap the interpreter's element-by-element generic scan for the sliced one (idempotent)."""
    from triton.runtime import interpreter
    ops = getattr(interpreter, "ScanOps", None)
    if ops is None or not hasattr(ops, "generic_scan"):
        return False  # another Triton: leave its interpreter as it is
    if getattr(ops.generic_scan, "__name__", "") != sliced_generic_scan.__name__:
        ops.original_generic_scan = ops.generic_scan
        ops.generic_scan = sliced_generic_scan
    return True
