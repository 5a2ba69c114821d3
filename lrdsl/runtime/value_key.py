"""The chunked forward of a value-side transition on the key side's staged kernels (issue 40; the
math: codegen/value_key.py). The per-token vectors of T = S^T's transition (the erase's directions,
the write's key and value, the floored log-decay, the scaled query) are computed in PyTorch, the
transposed sub-mixer's staged stages 1 to 3 make the chunk-start states and the pseudo-values, and
templates/chunk_value_out.py.jinja reads o. The backward stays runtime/valueside.py's (its kernel
recomputes everything from the inputs), so this is only a Route's forward."""
from __future__ import annotations

import dataclasses
import functools

import torch

from lrdsl.frontend import ir
from lrdsl.runtime import valueside
from lrdsl.runtime.reference import to_torch
from lrdsl.runtime.tensors import Batch, compute_dtype

BLOCK = 16  # tokens per block of the readout kernel (tensor-core products of 16 rows)


@functools.lru_cache(maxsize=None)
def out_module(chunk: int):
    """The readout kernel's module for chunks of `chunk` tokens (rendered and cached once)."""
    from lrdsl._version import __version__
    from lrdsl.codegen.render import render_value_out
    from lrdsl.runtime.loader import load_source
    return load_source("value_out", render_value_out(chunk, BLOCK, __version__))


def floor_log(g: torch.Tensor, floor: float) -> torch.Tensor:
    """The kernels' floor of a per-token log-decay (codegen/plan.py's _floored); nan stays nan."""
    return torch.where(g < floor, torch.full_like(g, floor), g)


def sub_inputs(m: ir.Mixer, b: Batch, floor: float) -> tuple:
    """(the transposed sub-mixer's inputs by codegen/value_key.py's names, the scaled query
    [B, T, HV, K] for the readout), each [B, T, HV, width] ([B, T, HV] a log-decay per head): T's
    erase writes along N's c (also the write key) and reads along N's a; the write's value is S's
    write key; the log-decay floored as the staged kernels floor it, in fp32; the vectors in v's
    dtype for bf16 and fp16 inputs (the staged kernels' tensor-core operands), else fp32."""
    from lrdsl.codegen import value_key as vk
    dtype = compute_dtype(b)
    env = valueside.token_env(m, b, dtype)
    ref = env["q"]
    v_in = b.tensors["v"].dtype
    low = v_in if v_in in (torch.bfloat16, torch.float16) else torch.float32
    shp = lambda w: (b.B, b.T, b.HV, w)
    vec = lambda e, w: valueside._tensor(to_torch(e)(env), ref, shp(w)).to(low).contiguous()
    c = vec(m.delta.c, b.V)
    out = {vk.Q: c, vk.C: c, vk.A: vec(m.delta.a, b.V), vk.U: vec(m.write.key, b.K)}
    if m.decay.kind != "identity":
        g = floor_log(valueside._tensor(to_torch(m.log_decay())(env), ref, shp(b.V)), floor)
        out[vk.G] = (g if m.decay.kind == "diagonal" else g[..., 0]).to(torch.float32).contiguous()
    query = valueside._tensor(to_torch(m.query)(env), ref, shp(b.K)) * b.scale
    return out, query.to(low).contiguous()


def forward(kernels, b: Batch, names, tensors, h0, *, m: ir.Mixer, sub, floor: float):
    """(o [B, T, HV, V] in v's dtype, the final state [N, HV, K, V] fp32 or None): Route.forward's
    signature (kernels, m's, unused), then m, the transposed sub-mixer (an lrdsl.Mixer) and its
    kernels' log-decay floor."""
    with torch.no_grad():
        b = dataclasses.replace(b, tensors=dict(zip(names, tensors)))
        mod = sub.kernels
        inputs, query = sub_inputs(m, b, floor)
        T0 = None if h0 is None else h0.to(torch.float32).transpose(-1, -2).contiguous()
        cu = None if b.cu_seqlens is None else b.cu_seqlens.to(torch.int64).contiguous()
        st = mod._staged_states(inputs, 1.0, T0, bool(b.output_final_state), cu)
        c = inputs["k"]
        g = inputs.get("g")
        if g is None:
            g = torch.zeros_like(c, dtype=torch.float32)
        elif g.dim() == 3:  # one log-decay per head
            g = g[..., None].expand(*g.shape, b.V).contiguous()
        o = out_module(mod.STAGED_CHUNK).value_out(st["hs"], st["e"], c, g, query, st["chunks"], cu, b.T,
                                                   b.tensors["v"].dtype)
        final = st["final_state"]
        return o, (None if final is None else final.transpose(-1, -2).contiguous())


def modules(sub) -> tuple:
    """The generated modules the staged forward launches: the transposed mixer's and the readout's."""
    return sub.kernels, out_module(sub.kernels.STAGED_CHUNK)


def route(m: ir.Mixer, sub) -> valueside.Route:
    """valueside.chunk's route: this forward, the value side's backward. Made once per mixer (the
    plan's sympy stays out of calls)."""
    from lrdsl.codegen.plan import plan
    floor = plan(sub.ir).log_decay_floor
    return valueside.Route(functools.partial(forward, m=m, sub=sub, floor=floor), valueside.per_token, valueside.VECTORS,
                           "value_chunk_bwd")
