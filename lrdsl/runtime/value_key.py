"""The chunked forward of a value-side transition on the key side's staged kernels (issue 40; the
math: codegen/value_key.py). The per-token vectors of T = S^T's transition (the erase's directions,
the write's key and value, the floored log-decay, the scaled query) are computed in PyTorch, the
transposed sub-mixer's staged stages 1 to 3 make the chunk-start states and the pseudo-values, and
templates/chunk_value_out.py.jinja reads o.

The backward (`grads`) runs the same sub-mixer once more, forward and backward, with do as its
query: o_t = T_t q_t makes the loss's linear part sum_t do_t . T_t q_t = sum_t (T_t^T do_t) . q_t,
the sub-mixer's own readout of query do_t dotted with q_t. So autograd through that call (the staged
backward kernels, on tensor cores) gives the gradients of every per-token vector and of the initial
state, and its output T_t^T do_t is q's gradient; autograd through the vectors' PyTorch chain
carries them to the inputs.

Where codegen/value_key.py's `direct` takes the spec, the sub-mixer is KDA on the raw inputs: stages
1 to 3 and the backward read them as they come (normalising, clamping and flooring in the kernels),
and PyTorch makes only the readout's write key b l2norm(c), floored g and scaled query, one op each in the
inputs' dtype (`direct_forward`, `direct_grads`)."""
from __future__ import annotations

import dataclasses
import functools

import torch

from lrdsl.frontend import ir
from lrdsl.runtime import valueside
from lrdsl.runtime.reference import to_torch
from lrdsl.runtime.tensors import L2NORM_EPS, Batch, compute_dtype

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
        inputs, query = sub_inputs(m, b, floor)
        c = inputs["k"]
        g = inputs.get("g")
        if g is None:
            g = torch.zeros_like(c, dtype=torch.float32)
        elif g.dim() == 3:  # one log-decay per head
            g = g[..., None].expand(*g.shape, b.V).contiguous()
        return _states_and_readout(sub, b, inputs, h0, c, g, query, b.tensors["v"].dtype)


def _states_and_readout(sub, b: Batch, inputs: dict, h0, c, g, query, out_dtype) -> tuple:
    """Both forms' forward once their inputs are made: the sub-mixer's stages 1 to 3 on `inputs`,
    then the readout of o from the write key c, the floored log-decay g and the scaled query;
    (o, the final state as S, or None)."""
    T0 = None if h0 is None else h0.to(torch.float32).transpose(-1, -2).contiguous()
    cu = None if b.cu_seqlens is None else b.cu_seqlens.to(torch.int64).contiguous()
    st = sub.kernels._staged_states(inputs, 1.0, T0, bool(b.output_final_state), cu)
    o = out_module(sub.kernels.STAGED_CHUNK).value_out(st["hs"], st["e"], c, g, query.contiguous(), st["chunks"],
                                                       cu, b.T, out_dtype)
    final = st["final_state"]
    return o, (None if final is None else final.transpose(-1, -2).contiguous())


def grads(m: ir.Mixer, b: Batch, names, leaves, h0, do, dht, *, sub, floor: float) -> tuple:
    """(the gradients of `leaves` (None where one needs none), dh0): valueside.Route.grads, through
    the transposed sub-mixer read with query do (module docstring); the leaves are finite copies."""
    h0l = None if h0 is None else h0.detach().to(torch.float32).requires_grad_(h0.requires_grad)
    with torch.enable_grad():
        inputs, query = sub_inputs(m, dataclasses.replace(b, tensors=dict(zip(names, leaves))), floor)
        q2 = do.to(inputs["k"].dtype).contiguous()
        rest = {n: t for n, t in inputs.items() if n not in ("q", "k", "v")}
        T0 = None if h0l is None else h0l.transpose(-1, -2)
        o2, final = sub.chunk(q2, inputs["k"], inputs["v"], scale=1.0, initial_state=T0,
                              output_final_state=dht is not None, cu_seqlens=b.cu_seqlens, **rest)
        loss = (o2.float() * query.float()).sum()
        if dht is not None:
            loss = loss + (final.float() * dht.float().transpose(-1, -2)).sum()
        want = [t for t in (*leaves, h0l) if t is not None and t.requires_grad]
        got = iter(torch.autograd.grad(loss, want, allow_unused=True) if want else [])
    out = [next(got) if t.requires_grad else None for t in leaves]
    dh0 = next(got) if h0l is not None and h0l.requires_grad else None
    return out, (None if dh0 is None else dh0.to(h0.dtype))


def _heads(t: torch.Tensor, HV: int) -> torch.Tensor:
    """t [B, T, H, ...] over the HV value heads (a shared input repeated for each of its value heads)."""
    return t if t.shape[2] == HV else t.repeat_interleave(HV // t.shape[2], dim=2)


def _direct_sub(d, x: dict, HV: int) -> dict:
    """The direct sub-mixer's inputs (codegen/value_key.py's names): m's raw tensors by d's names."""
    from lrdsl.codegen import value_key as vk
    pairs = ((vk.Q, d.c), (vk.C, d.c), (vk.U, d.k), (vk.G, d.log), (vk.GAIN, d.gain))
    return {n: _heads(x[src], HV).contiguous() for n, src in pairs}


def direct_forward(kernels, b: Batch, names, tensors, h0, *, m: ir.Mixer, sub, floor: float, d, gain: tuple):
    """`forward` for codegen/value_key.py's direct form d: the sub-mixer's stages on the raw inputs;
    gain: the gain's declared bounds (None where open-ended)."""
    from lrdsl.codegen import value_key as vk
    with torch.no_grad():
        x = dict(zip(names, tensors))
        inputs = _direct_sub(d, x, b.HV)
        v = inputs["k"]
        # the readout's write key on T and g as the kernels make them: b l2norm(v) (the gain b clamped,
        # one factor per row in fp32) and g clamped into [floor, 0] (clamp keeps nan)
        norm = torch.linalg.vector_norm(v, dim=-1, keepdim=True, dtype=torch.float32)
        beta = inputs[vk.GAIN].to(torch.float32).clamp(*gain)[..., None]
        c = v * (torch.rsqrt(norm * norm + L2NORM_EPS) * beta).to(v.dtype)
        g = inputs["g"].clamp(floor, 0.0)
        query = _heads(x[d.query], b.HV) * b.scale
        return _states_and_readout(sub, b, inputs, h0, c, g, query, x[d.c].dtype)


def direct_grads(m: ir.Mixer, b: Batch, names, leaves, h0, do, dht, *, sub, floor: float, d) -> tuple:
    """`grads` for the direct form d: the sub-mixer's chunk on the raw leaves read with query do;
    o' = T^T do, so the loss's linear part is sum (o' . q scale), whose gradients are q scale for
    o' and o' scale for q (summed over the value heads of a shared q)."""
    from lrdsl.codegen import value_key as vk
    h0l = None if h0 is None else h0.detach().to(torch.float32).requires_grad_(h0.requires_grad)
    x = dict(zip(names, leaves))
    q = x[d.query]
    with torch.enable_grad():
        inputs = _direct_sub(d, x, b.HV)
        rest = {n: t for n, t in inputs.items() if n not in (vk.Q, vk.C, vk.U)}
        T0 = None if h0l is None else h0l.transpose(-1, -2)
        o2, final = sub.chunk(do.to(inputs[vk.C].dtype).contiguous(), inputs[vk.C], inputs[vk.U], scale=1.0,
                              initial_state=T0, output_final_state=dht is not None, cu_seqlens=b.cu_seqlens, **rest)
        outs, wrt = [o2], [(_heads(q, b.HV) * b.scale).to(o2.dtype)]
        if dht is not None:
            outs.append(final)
            wrt.append(dht.to(final.dtype).transpose(-1, -2))
        want = [t for t in (*leaves, h0l) if t is not None and t.requires_grad and t is not q]
        got = iter(torch.autograd.grad(outs, want, wrt, allow_unused=True) if want else [])
    out = []
    for t in leaves:
        if not t.requires_grad:
            out.append(None)
        elif t is q:
            B, T, H, K = q.shape
            dq = o2.detach().view(B, T, H, b.HV // H, K).sum(3, dtype=torch.float32) if H != b.HV else o2.detach()
            out.append((dq * b.scale).to(q.dtype))
        else:
            out.append(next(got))
    dh0 = next(got) if h0l is not None and h0l.requires_grad else None
    return out, (None if dh0 is None else dh0.to(h0.dtype))


def modules(sub) -> tuple:
    """The generated modules the staged forward launches: the transposed mixer's and the readout's."""
    return sub.kernels, out_module(sub.kernels.STAGED_CHUNK)


def route(m: ir.Mixer, sub) -> valueside.Route:
    """valueside.chunk's route: this forward and backward (`grads`). Made once per mixer (the plan's
    sympy stays out of calls)."""
    from lrdsl.codegen.plan import plan
    from lrdsl.codegen.value_key import direct
    floor = plan(sub.ir).log_decay_floor
    d = direct(m)
    if d is not None:
        i = next(i for i in m.inputs if i.name == d.gain)
        gain = tuple(float(x) if x.is_finite else None for x in (i.lo, i.hi))
        return valueside.Route(functools.partial(direct_forward, m=m, sub=sub, floor=floor, d=d, gain=gain),
                               valueside.per_token, valueside.VECTORS, "value_chunk_bwd",
                               functools.partial(direct_grads, sub=sub, floor=floor, d=d))
    return valueside.Route(functools.partial(forward, m=m, sub=sub, floor=floor), valueside.per_token, valueside.VECTORS,
                           "value_chunk_bwd", functools.partial(grads, sub=sub, floor=floor))
