"""The reference scan: a plain token loop in PyTorch, exact to the IR, differentiable, any dtype.

Every other implementation (the chunked and recurrent kernels) is tested against this one.
"""
from __future__ import annotations

import math

import sympy as sp
import torch

from lrdsl.frontend import ir, primitives
from lrdsl.runtime.tensors import L2NORM_EPS, Batch, MixerState, compute_dtype


def to_torch(e: sp.Expr):
    """Compile a sympy expression into a function of an environment {name: tensor}."""
    if isinstance(e, sp.Symbol):
        name = e.name
        return lambda env: env[name]
    if e.is_number:  # a constant such as 3/2 or log(3/2): evaluate it exactly, not in float32 torch
        val = float(e)
        return lambda env: val
    if isinstance(e, sp.Add):
        fs = [to_torch(a) for a in e.args]
        return lambda env: _fold(fs, env, lambda x, y: x + y)
    if isinstance(e, sp.Mul):
        fs = [to_torch(a) for a in e.args]
        return lambda env: _fold(fs, env, lambda x, y: x * y)
    if isinstance(e, sp.Pow):
        fb, fe = to_torch(e.base), to_torch(e.exp)
        if e.base.is_Number:  # b^x: keep it an exp so it is differentiable and exact in float64
            lb = math.log(float(e.base))
            return lambda env: torch.exp(lb * torch.as_tensor(fe(env)))
        return lambda env: torch.as_tensor(fb(env)) ** fe(env)
    prim = primitives.of(e)  # exp, log, abs, softplus, ...: the table's torch function
    if prim is not None and prim.torch is not None:
        fs = [to_torch(a) for a in e.args]
        return lambda env: prim.torch(*(f(env) for f in fs))
    if prim is not None and prim.expand is not None:
        return to_torch(prim.expand(e))
    raise TypeError(f"the reference cannot evaluate {e!r}")  # the lowering admits nothing else


def _fold(fs, env, op):
    acc = fs[0](env)
    for f in fs[1:]:
        acc = op(acc, f(env))
    return acc


def l2norm(x: torch.Tensor) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + L2NORM_EPS)


def prepare_inputs(m: ir.Mixer, b: Batch, dtype: torch.dtype) -> dict:
    """Cast to the compute dtype, repeat shared inputs over value heads, apply in-mixer l2norm."""
    out = {}
    G = b.HV // b.H
    for i in m.inputs:
        x = b.tensors[i.name].to(dtype)
        if not (i.l2norm or i.unit):  # outside its declared range a value is clamped into it
            x = _clamped(i, x)
        if i.shared and G > 1:
            x = x.repeat_interleave(G, dim=2)
        if i.l2norm:
            x = l2norm(x)
        if i.kind == "scalar":
            x = x.unsqueeze(-1)
        out[i.name] = x
    for p in m.params:  # [HV], [HV, K] or [HV, V], the same at every token: a broadcast view, no copy
        x = _clamped(p, b.tensors[p.name].to(dtype))
        out[p.name] = x.reshape(1, 1, b.HV, -1).expand(b.B, b.T, b.HV, 1 if p.kind == "scalar" else x.shape[-1])
    return out


def _clamped(i, x: torch.Tensor) -> torch.Tensor:
    """x clamped into i's declared range (as the kernels do); nan stays nan."""
    if i.lo.is_finite:
        x = torch.where(x < float(i.lo), torch.full_like(x, float(i.lo)), x)
    if i.hi.is_finite:
        x = torch.where(x > float(i.hi), torch.full_like(x, float(i.hi)), x)
    return x


def _right_transition(m: ir.Mixer, S, d, f_a, f_c, env):
    """S N for a value-side transition: N's [V] decay and erase act on the state's rows."""
    if m.delta is None:
        return S * d
    a, c = torch.as_tensor(f_a(env)).unsqueeze(-2), torch.as_tensor(f_c(env)).unsqueeze(-2)
    if m.delta.order == "left":  # S (I - a c^T) D
        return (S - (S * a).sum(-1, keepdim=True) * c) * d
    if m.delta.order == "sum":  # S (D - a c^T)
        return S * d - (S * a).sum(-1, keepdim=True) * c
    S = S * d  # S D (I - a c^T)
    return S - (S * a).sum(-1, keepdim=True) * c


def scan(m: ir.Mixer, b: Batch):
    """o [B, T, HV, V] (in v's dtype) and the final state [N, HV, K, V] (fp32, fp64 for fp64 inputs)."""
    dtype = compute_dtype(b)
    x = prepare_inputs(m, b, dtype)
    dev = b.tensors["q"].device
    f_aux = [(a.name, to_torch(a.decay), to_torch(a.write), a.kind) for a in m.aux]
    f_let = [(lt.name, to_torch(lt.expr)) for lt in m.lets]
    f_d, f_key, f_val = to_torch(m.decay.value), to_torch(m.write.key), to_torch(m.write.value)
    f_q, f_qp = to_torch(m.query), to_torch(m.query_prev)
    f_bonus = [(to_torch(bn.summand), to_torch(bn.value)) for bn in m.bonus]
    f_lam = to_torch(m.solve_lam) if m.solve_lam is not None else None
    f_a = to_torch(m.delta.a) if m.delta else None
    f_c = to_torch(m.delta.c) if m.delta else None
    right = m.right_part() if m.side == "both" else None  # a two-sided M S N: N after M
    if right is not None:
        f_nd = to_torch(right.decay.value)
        f_na, f_nc = (to_torch(right.delta.a), to_torch(right.delta.c)) if right.delta else (None, None)
    f_steps = [(to_torch(st.delta.a) if st.delta else None, to_torch(st.delta.c) if st.delta else None,
                to_torch(st.write.key), to_torch(st.write.value)) for st in m.steps]
    head = torch.arange(b.HV, device=dev, dtype=dtype).view(1, b.HV, 1)
    outs, finals, aux_finals = [], [], []
    for n, (bi, bos, eos) in enumerate(b.sequences()):
        S = torch.zeros(1, b.HV, b.K, b.V, device=dev, dtype=dtype)
        if b.initial_state is not None:
            S = b.initial_state[n:n + 1].to(dtype)
        gram = torch.zeros(1, b.HV, b.K, b.K, device=dev, dtype=dtype) if f_lam else None
        if f_lam and b.initial_gram is not None:
            gram = b.initial_gram[n:n + 1].to(dtype)
        aux = {name: torch.zeros(1, b.HV, b.K if kind == "K" else b.V, device=dev, dtype=dtype)
               if b.initial_aux is None else b.initial_aux[j][n:n + 1].to(dtype)
               for j, (name, _, _, kind) in enumerate(f_aux)}
        o_seq = []
        for t in range(bos, eos):
            env = {name: val[bi:bi + 1, t] for name, val in x.items()}
            env["h"] = head
            for name, fd, fw, _ in f_aux:
                aux[name] = fd(env) * aux[name] + fw(env)
                env[name] = aux[name]
            for name, f in f_let:
                env[name] = f(env)
            d = torch.as_tensor(f_d(env), dtype=dtype, device=dev)
            d = d.unsqueeze(-2 if m.side == "right" else -1) if d.dim() else d
            before = 0.0  # what the readout takes from before the update: S_prev^T x + (x^T y) z
            if m.query_prev != 0:
                before = (torch.as_tensor(f_qp(env)).unsqueeze(-1) * S).sum(-2) * b.scale
            for f_sum, f_z in f_bonus:
                dot = torch.as_tensor(f_sum(env), dtype=dtype, device=dev).sum(-1, keepdim=True)
                before = before + dot * torch.as_tensor(f_z(env)) * b.scale
            if m.side == "right":
                S = _right_transition(m, S, d, f_a, f_c, env)
            elif m.delta is None:
                S = d * S
            else:
                a, c = f_a(env), f_c(env)
                if m.delta.order == "left":
                    S = d * S
                    S = S - a.unsqueeze(-1) * (c.unsqueeze(-1) * S).sum(-2, keepdim=True)
                elif m.delta.order == "sum":  # (D - a c^T) S: the erase reads the state before the decay
                    S = d * S - a.unsqueeze(-1) * (c.unsqueeze(-1) * S).sum(-2, keepdim=True)
                else:
                    S = d * (S - a.unsqueeze(-1) * (c.unsqueeze(-1) * S).sum(-2, keepdim=True))
            if right is not None:
                dn = torch.as_tensor(f_nd(env), dtype=dtype, device=dev)
                S = _right_transition(right, S, dn.unsqueeze(-2) if dn.dim() else dn, f_na, f_nc, env)
            key, val = f_key(env), f_val(env)
            S = S + torch.as_tensor(key).unsqueeze(-1) * torch.as_tensor(val).unsqueeze(-2)
            for fa, fc, fk, fv in f_steps:  # a product's later steps: (I - a c^T) S + key value^T each
                if fa is not None:
                    S = S - torch.as_tensor(fa(env)).unsqueeze(-1) * (torch.as_tensor(fc(env)).unsqueeze(-1)
                                                                      * S).sum(-2, keepdim=True)
                S = S + torch.as_tensor(fk(env)).unsqueeze(-1) * torch.as_tensor(fv(env)).unsqueeze(-2)
            qv = torch.as_tensor(f_q(env)) * b.scale
            if gram is not None:  # offline solve: G shares S's decay and write key, k on its other side
                gram = d * gram + torch.as_tensor(key).unsqueeze(-1) * env["k"].unsqueeze(-2)
                lam = torch.as_tensor(f_lam(env), dtype=dtype, device=dev).expand(1, b.HV, b.K)
                qv = torch.linalg.solve(gram + torch.diag_embed(lam), qv.expand(1, b.HV, b.K))
            # a readout of S_prev alone has query 0, which to_torch gives as a number on the CPU
            now = (qv.unsqueeze(-1) * S).sum(-2) if m.query != 0 or gram is not None else 0.0
            o_seq.append(now + before)
        if o_seq:
            outs.append(torch.stack(o_seq, dim=1))
        else:
            outs.append(torch.zeros(1, 0, b.HV, b.V, device=dev, dtype=dtype))
        finals.append(S)
        if gram is not None:  # the offline solve's Gram state is part of the whole state
            aux["G"] = gram
        aux_finals.append(aux)
    if b.cu_seqlens is None:
        o = torch.cat(outs, dim=0)
    else:
        o = torch.cat(outs, dim=1)
    final = torch.cat(finals, dim=0) if b.output_final_state else None
    if final is not None and (f_aux or f_lam):  # the whole state
        names = [name for name, *_ in f_aux] + (["G"] if f_lam else [])
        final = MixerState(final, {name: torch.cat([a[name] for a in aux_finals], dim=0) for name in names})
    return o.to(b.tensors["v"].dtype), final
