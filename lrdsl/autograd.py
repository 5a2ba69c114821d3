"""Differentiable chunked kernels: torch.autograd around the generated forward and backward.

The generated backward returns the gradients of the per-token vectors the kernels consume (erase
directions a and c, write key u and value z, scaled query r, log-decay gl) and of the initial
state. The chain rule from those vectors to the spec's inputs (elementwise, plus the auxiliary
scans and in-mixer L2 norms) runs through PyTorch autograd on the same expressions the reference
evaluates, so every expression a spec can write is differentiated the same way.
"""
from __future__ import annotations

import sympy as sp
import torch

from . import ir
from .reference import prepare_inputs, to_torch
from .tensors import Batch


def log_decay(m: ir.Mixer) -> sp.Expr:
    return sp.expand_log(sp.log(m.decay.value), force=True)


def _full(x, shape, dtype, device):
    t = torch.as_tensor(x, dtype=dtype, device=device)
    return t.expand(shape) if t.dim() else torch.full(shape, float(t), dtype=dtype, device=device)


def token_vectors(m: ir.Mixer, b: Batch, dtype=torch.float32) -> dict:
    """The per-token vectors of the chunked kernels, as differentiable tensors [B, T, HV, K|V]."""
    env = prepare_inputs(m, b, dtype)
    dev = b.tensors["q"].device
    env["h"] = torch.arange(b.HV, device=dev, dtype=dtype).view(1, 1, b.HV, 1)
    shp = {"K": (b.B, b.T, b.HV, b.K), "V": (b.B, b.T, b.HV, b.V), "scalar": (b.B, b.T, b.HV, 1)}
    starts = torch.zeros(b.T, dtype=torch.bool, device=dev)
    starts[[s for _, s, _ in b.sequences() if s < b.T]] = True
    for a in m.aux:
        alpha = _full(to_torch(a.decay)(env), shp[a.kind], dtype, dev)
        beta = _full(to_torch(a.write)(env), shp[a.kind], dtype, dev)
        p, out = torch.zeros_like(beta[:, 0]), []
        for t in range(b.T):
            p = beta[:, t] if starts[t] else alpha[:, t] * p + beta[:, t]
            out.append(p)
        env[a.name] = torch.stack(out, 1) if out else beta
    for lt in m.lets:
        env[lt.name] = to_torch(lt.expr)(env)
    out = {"u": _full(to_torch(m.write.key)(env), shp["K"], dtype, dev),
           "z": _full(to_torch(m.write.value)(env), shp["V"], dtype, dev),
           "r": _full(to_torch(m.query)(env), shp["K"], dtype, dev) * b.scale}
    if m.delta is not None:
        out["a"] = _full(to_torch(m.delta.a)(env), shp["K"], dtype, dev)
        out["c"] = _full(to_torch(m.delta.c)(env), shp["K"], dtype, dev)
    if m.decay.kind != "identity":
        gl = to_torch(log_decay(m))(env)
        out["gl"] = _full(gl, shp["K"], dtype, dev) if m.decay.kind == "diagonal" else \
            _full(gl, shp["scalar"], dtype, dev)[..., 0]
    return out


class ChunkFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, mixer_ir, module, batch, names, h0, *tensors):
        inputs = {n: t.contiguous() for n, t in zip(names, tensors)}
        cu = batch.cu_seqlens.to(torch.int64).contiguous() if batch.cu_seqlens is not None else None
        h0c = h0.to(torch.float32).contiguous() if h0 is not None else None
        o, ht = module.chunk_fwd(inputs, batch.scale, h0c, batch.output_final_state, cu)
        ctx.save_for_backward(h0c if h0c is not None else torch.empty(0), *tensors)
        ctx.info = (mixer_ir, module, batch, names, h0 is not None, cu)
        ctx.set_materialize_grads(False)
        return o, ht

    @staticmethod
    def backward(ctx, do, dht):
        mixer_ir, module, batch, names, has_h0, cu = ctx.info
        h0, *tensors = ctx.saved_tensors
        h0 = h0 if has_h0 else None
        inputs = {n: t.contiguous() for n, t in zip(names, tensors)}
        if do is None:
            do = torch.zeros(batch.B, batch.T, batch.HV, batch.V, device=tensors[0].device)
        vgrads, dh0 = module.chunk_bwd(inputs, batch.scale, h0, do, dht, cu)
        with torch.enable_grad():
            leaves = [t.detach().requires_grad_(need) for t, need in zip(tensors, ctx.needs_input_grad[5:])]
            live = dict(zip(names, leaves))
            b2 = Batch(live, batch.B, batch.T, batch.H, batch.HV, batch.K, batch.V, batch.scale, None,
                       False, batch.cu_seqlens)
            vecs = token_vectors(mixer_ir, b2, torch.float32)
            wanted = [l for l in leaves if l.requires_grad]
            pairs = [(vecs[k], g) for k, g in vgrads.items() if vecs[k].requires_grad]
            grads = iter(torch.autograd.grad([p for p, _ in pairs], wanted, [g for _, g in pairs],
                                             allow_unused=True) if wanted and pairs else [])
        out = []
        for leaf in leaves:
            g = next(grads) if leaf.requires_grad else None
            if leaf.requires_grad and g is None:
                g = torch.zeros_like(leaf)
            out.append(None if g is None else g.to(leaf.dtype))
        dh0 = dh0.to(ctx.saved_tensors[0].dtype) if (dh0 is not None and ctx.needs_input_grad[4]) else None
        return (None, None, None, None, dh0, *out)
