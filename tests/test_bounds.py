"""Every address a staged kernel loads or stores (mask on) lies inside one of its launch's tensors,
at each config of each kernel's tuning space, forward and backward (Triton's interpreter).

The interpreter reads and writes host memory unchecked, so an index past a tensor passes every
numerical test on CPU and faults on the GPU. This checks the source's arithmetic at each tile size
a space may pick. It cannot see faults of the compiled code (register or shared-memory addressing
made by Triton or ptxas): the illegal access that staged_dstate's BV 64 / one-stage candidates
raised on the H200 passed it (templates/staged_host.py.jinja).
"""
import numpy as np
import pytest
import torch
import triton

import lrdsl
from lrdsl.bench import Shape, draw
from lrdsl.codegen import schedule
from lrdsl.codegen.plan import plan

pytestmark = pytest.mark.slow


class Bounds:
    """Wraps the interpreter's launch (to note its tensors' extents) and its masked load/store."""

    def __init__(self, monkeypatch):
        from triton.runtime import interpreter as I
        self.extents, self.kernel, self.bad = [], None, []
        init, builder = I.GridExecutor._init_args_hst, type(I.interpreter_builder)
        load, store = builder.create_masked_load, builder.create_masked_store

        def init_args(executor, args_dev, kwargs):
            args, kw = init(executor, args_dev, kwargs)
            self.kernel, self.extents = executor.fn.__name__, []
            for name, t in [*zip(executor.arg_names, args), *kw.items()]:
                if isinstance(t, torch.Tensor) and t.numel():
                    span = sum((s - 1) * st for s, st in zip(t.shape, t.stride())) + 1
                    self.extents.append((name, t.data_ptr(), t.data_ptr() + span * t.element_size()))
            return args, kw

        def checked_load(b, ptrs, mask, *rest):
            self.check("load", ptrs.data, mask.data, np.dtype(I._get_np_dtype(ptrs.get_element_ty())).itemsize)
            return load(b, ptrs, mask, *rest)

        def checked_store(b, ptrs, value, mask, *rest):
            self.check("store", ptrs.data, mask.data, value.data.dtype.itemsize)
            return store(b, ptrs, value, mask, *rest)

        monkeypatch.setattr(I.GridExecutor, "_init_args_hst", init_args)
        monkeypatch.setattr(builder, "create_masked_load", checked_load)
        monkeypatch.setattr(builder, "create_masked_store", checked_store)

    def check(self, op, ptrs, mask, size):
        p = np.asarray(ptrs).astype(np.uint64)
        p = p[np.broadcast_to(np.asarray(mask, dtype=bool), p.shape)].ravel()
        inside = np.zeros(p.shape, dtype=bool)
        for _, lo, hi in self.extents:
            inside |= (p >= lo) & (p + size <= hi)
        if not inside.all():
            a = int(p[~inside][0])
            name, lo, _ = min(self.extents, key=lambda e: min(abs(a - e[1]), abs(a - e[2])))
            self.bad.append(f"{self.kernel} {op}: {int((~inside).sum())} addresses out, e.g. {a - lo:+d} bytes from {name}")
            raise IndexError(self.bad[-1])  # before the access: host memory past a tensor may be unmapped


@pytest.mark.parametrize("spec", ["gated_deltanet", "gla", "kda"])
def test_staged_kernels_stay_in_bounds(spec, monkeypatch):
    m = lrdsl.compile(f"examples/{spec}.lr")
    # bf16 inputs: bf16 intermediates and vector gradients, the GPU's path (the interpreter's bf16
    # dots are inexact, which does not matter here); the *_fp32 spaces serve fp32 and fp16 inputs
    space = {n: c for n, c in m.kernels.TUNING_SPACE.items() if not n.endswith("_fp32")}
    tuners = {n: getattr(m.kernels, n) for n in space}
    bounds = Bounds(monkeypatch)
    s = Shape(B=1, T=140, H=2, K=128, V=128)
    # packed sequences of uneven lengths (one over a chunk with its last chunk part full, two
    # shorter than a chunk), an initial state and a final-state gradient: every mask and every
    # optional pointer in use
    cu = torch.tensor([0, 37, 110, 140], dtype=torch.int32)
    # a forward kernel's configs need no backward beyond the first (the backward's kernels then
    # run their first configs, the same launches each time)
    backward = {l.wrapper for l in schedule.backward(plan(m.ir))}
    first = True
    try:
        for n in space:
            # the interpreter runs one stage whatever a config says: configs that differ only in
            # their stages run the same code here, once
            distinct = {}
            for c in space[n]:
                distinct.setdefault((tuple(sorted(c.kwargs.items())), c.num_warps), c)
            for cfg in distinct.values():
                for other, t in tuners.items():  # the interpreter runs one stage whatever a config says
                    c = cfg if other == n else space[other][0]
                    monkeypatch.setattr(t, "configs", [triton.Config(c.kwargs, num_warps=c.num_warps, num_stages=1)])
                    t.cache.clear()
                x = {k: t.requires_grad_() if t.is_floating_point() else t
                     for k, t in draw(m, s, dtype=torch.bfloat16, device="cpu", seed=5).items()}
                h0 = torch.randn(3, s.H, s.K, s.V, requires_grad=True)
                o, state = m.chunk(**x, initial_state=h0, output_final_state=True, cu_seqlens=cu)[:2]
                state = getattr(state, "S", state)
                if first or n in backward:
                    ((o.float() * torch.randn(o.shape)).sum() + (state * torch.randn_like(state)).sum()).backward()
                first = False
                assert not bounds.bad, (n, str(cfg), bounds.bad[:4])
    finally:
        for t in tuners.values():  # no choice made under a pinned config outlives the test
            t.cache.clear()
