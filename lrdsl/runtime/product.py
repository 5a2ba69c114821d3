"""Run a product of n steps per token (codegen/product.py) on its sub-mixer's kernels: every
per-token quantity of step j becomes sub-token n t + j of a sequence n times longer, the decay
sits on the first sub-token of each token (log-decay 0 on the others), the query on the last
(zero on the others), and o is read at the last. All of it differentiable torch operations around
the sub-mixer's calls, so chunk's backward is the sub-mixer's, through the gather.

What needs sympy (the expressions of each step, the inputs' declared ranges) is turned into plain
functions and numbers once per mixer (`Plan`): a call under torch.compile traces torch alone."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from lrdsl.codegen import product as cp
from lrdsl.frontend import ir
from lrdsl.runtime import nonfinite, sub_chunk
from lrdsl.runtime.autograd import eager
from lrdsl.runtime.reference import l2norm, to_torch


@dataclass(frozen=True)
class Plan:
    """The sub-mixer's inputs as functions of the spec's: per input (name, kind, shared, l2norm,
    lo, hi) with the clamp's finite bounds (None where open-ended or normalised); per param (name,
    kind, lo, hi); the lets in order; (a, c, u, z) of each step; the query; the log-decay and its
    kind ("K", "scalar", or None without decay); whether the sub-mixer reads a write key of its own."""
    inputs: tuple
    params: tuple
    lets: tuple
    steps: tuple
    query: object
    log_decay: object
    decay_kind: str | None
    separate: bool
    direct: tuple | None = None  # (query, keys, values, gains as functions, inputs they and the
    # log-decay read) of codegen.product.direct


def _bound(x, on: bool):
    return float(x) if on and x.is_finite else None


def plan_of(m: ir.Mixer, sub: ir.Mixer) -> Plan:
    ins = tuple((i.name, i.kind, i.shared, i.l2norm, _bound(i.lo, i.clamped), _bound(i.hi, i.clamped))
                for i in m.inputs)
    params = tuple((p.name, p.kind, _bound(p.lo, True), _bound(p.hi, True)) for p in m.params)
    kind = None if m.decay.kind == "identity" else "K" if m.decay.kind == "diagonal" else "scalar"
    d = cp.direct(m)
    if d is not None:
        read = set().union(*(b.free_symbols for b in d.gains))
        if kind is not None:
            read |= m.log_decay().free_symbols
        d = (d.query, d.keys, d.values, tuple(to_torch(b) for b in d.gains),
             frozenset(x.name for x in read) & {i.name for i in m.inputs})
    return Plan(ins, params, tuple((lt.name, to_torch(lt.expr)) for lt in m.lets),
                tuple(tuple(to_torch(e) for e in s) for s in cp.steps_of(m)), to_torch(m.query),
                None if kind is None else to_torch(m.log_decay()), kind,
                any(i.name == cp.U for i in sub.inputs), d)


def _clamp(x, lo, hi):
    """x clamped into [lo, hi] as every path clamps (nan stays nan)."""
    if lo is not None:
        x = torch.where(x < lo, torch.full_like(x, lo), x)
    if hi is not None:
        x = torch.where(x > hi, torch.full_like(x, hi), x)
    return x


def environment(plan: Plan, tensors: dict, H: int, HV: int, dtype, only=None) -> dict:
    """Every input (clamped, repeated over value heads, normalised), param, let and h, in dtype:
    [B, T, HV, K|V|1], as the reference prepares them; with `only`, those inputs, every param and h,
    no lets (what the direct form's gains and log-decay read)."""
    q = tensors["q"]
    B, T = q.shape[:2]
    env = {}
    for name, kind, shared, norm, lo, hi in plan.inputs:
        if only is not None and name not in only:
            continue
        x = _clamp(tensors[name].to(dtype), lo, hi)
        if shared and HV > H:
            x = x.repeat_interleave(HV // H, dim=2)
        if norm:
            x = l2norm(x)
        env[name] = x.unsqueeze(-1) if kind == "scalar" else x
    for name, kind, lo, hi in plan.params:
        x = _clamp(tensors[name].to(dtype), lo, hi)
        env[name] = x.reshape(1, 1, HV, -1).expand(B, T, HV, 1 if kind == "scalar" else x.shape[-1])
    env["h"] = torch.arange(HV, device=q.device, dtype=dtype).view(1, 1, HV, 1)
    for name, f in plan.lets if only is None else ():
        env[name] = f(env)
    return env


def interleave(xs: list) -> torch.Tensor:
    """[B, T, ...] tensors x_0 .. x_{n-1} -> [B, n T, ...]: x_j at sub-token n t + j."""
    B, T = xs[0].shape[:2]
    return torch.stack(xs, 2).reshape(B, len(xs) * T, *xs[0].shape[2:])


def sub_inputs(plan: Plan, tensors: dict, H: int, HV: int) -> dict:
    """The sub-mixer's inputs [B, n T, HV, ...]: the per-step vectors in the compute dtype, cast to
    q's dtype; the log-decay in float32 (float64 for float64 inputs)."""
    q = tensors["q"]
    low = torch.float64 if q.dtype == torch.float64 else torch.float32
    if plan.direct is not None:
        return _direct_inputs(plan, tensors, H, HV, low)
    env = environment(plan, tensors, H, HV, low)
    B, T = q.shape[:2]
    shape = {"K": (B, T, HV, q.shape[-1]), "V": (B, T, HV, tensors["v"].shape[-1]), "scalar": (B, T, HV, 1)}

    def ev(f, kind):
        return torch.as_tensor(f(env), dtype=low, device=q.device).expand(shape[kind])

    n = len(plan.steps)
    out = {cp.Q: interleave([torch.zeros(shape["K"], dtype=low, device=q.device)] * (n - 1) + [ev(plan.query, "K")]),
           cp.C: interleave([ev(c, "K") for _, c, _, _ in plan.steps]),
           cp.Z: interleave([ev(z, "V") for _, _, _, z in plan.steps]),
           cp.A: interleave([ev(a, "K") for a, _, _, _ in plan.steps])}
    if plan.separate:
        out[cp.U] = interleave([ev(u, "K") for _, _, u, _ in plan.steps])
    out = {name: x.to(q.dtype) for name, x in out.items()}
    return _with_decay(out, plan, ev, n)


def _with_decay(out: dict, plan: Plan, ev, n: int) -> dict:
    """The log-decay at the first sub-token of each token, 0 at the others."""
    if plan.decay_kind is not None:
        g = ev(plan.log_decay, plan.decay_kind)
        g = interleave([g] + [torch.zeros_like(g)] * (n - 1))
        out[cp.G] = g if plan.decay_kind == "K" else g[..., 0]
    return out


def _gains_and_decay(plan: Plan, tensors: dict, H: int, HV: int, low, n: int) -> dict:
    """The direct form's gains [B, n T, HV] (in the query's dtype) and log-decay (in `low`)."""
    query, keys, values, gains, read = plan.direct
    q = tensors[query]
    B, T = q.shape[:2]
    env = environment(plan, tensors, H, HV, low, only=read)

    def ev(f, kind):
        shape = (B, T, HV, q.shape[-1] if kind == "K" else 1)
        return torch.as_tensor(f(env), dtype=low, device=q.device).expand(shape)

    out = {cp.BETA: interleave([ev(b, "scalar")[..., 0] for b in gains]).to(q.dtype)}
    return _with_decay(out, plan, ev, n)


def _direct_inputs(plan: Plan, tensors: dict, H: int, HV: int, low) -> dict:
    """The direct form's sub-inputs: the spec's query (at every sub-token: o is read at the last),
    keys and values interleaved as they come (the kernels clamp nothing here and normalise what
    the spec normalises), the gains [B, n T, HV] and the log-decay computed in `low`."""
    query, keys, values, gains, read = plan.direct
    shared = {name for name, _, sh, *_ in plan.inputs if sh}
    q = tensors[query]
    n = len(keys)

    def group(names):  # all shared, or each at HV heads
        xs = [tensors[x] for x in names]
        if HV == H or all(x in shared for x in names):
            return interleave(xs)
        return interleave([x.repeat_interleave(HV // H, dim=2) if name in shared else x for name, x in zip(names, xs)])

    return {cp.Q: interleave([q] * n), cp.C: group(keys), cp.Z: group(values),
            **_gains_and_decay(plan, tensors, H, HV, low, n)}


def _per_step(mixer, batch):
    """The direct sub-mixer's inputs with no [B, n T, ...] copy of q, k or v (plan.sub_tokens: its
    staged chunk reads sub-token n t + j of the keys and values from step j's own tensor at token t,
    and the query once per token): (names for the kernels, names for the non-finite checks, tensors),
    or None where chunk takes the interleaved copies (sub_inputs): no sub-token kernels, K past the
    staged kernels, torch.compile or another transform or mode (the custom op's path), the
    non-finite checks' host mode, keep_intermediates (what the forward keeps holds the offsets of
    the tensors it read, not of the backward's finite copies), keys or values of different dtypes,
    keys shared by grouped value heads (their gradient per value head has no [n, ...] form here)."""
    plan, module = mixer.product_plan, mixer.product.kernels
    if (plan.direct is None or not getattr(module, "SUB_TOKENS", 0) or batch.K > module.STAGED_MAX_K
            or mixer.keep_intermediates):
        return None
    query, keys, values, _, _ = plan.direct
    t = batch.tensors
    if nonfinite.MODE != "device" or not eager(list(t.values())):
        return None
    shared = {name for name, _, sh, *_ in plan.inputs if sh}
    spread = batch.HV > batch.H

    def steps(names):  # each at the sub-mixer's heads: a shared one repeated where another is not
        if spread and all(x in shared for x in names):
            return None
        xs = [t[x].repeat_interleave(batch.HV // batch.H, dim=2) if spread and x in shared else t[x] for x in names]
        xs = [_rows(x) for x in xs]
        if len({x.stride(1) for x in xs}) != 1:
            xs = [x.contiguous() for x in xs]
        if len({x.dtype for x in xs}) != 1 or any((x.data_ptr() - xs[0].data_ptr()) % x.element_size() for x in xs):
            return None
        return xs
    ks, vs = steps(keys), steps(values)
    if ks is None or vs is None:
        return None
    low = torch.float64 if t[query].dtype == torch.float64 else torch.float32
    rest = _gains_and_decay(plan, t, batch.H, batch.HV, low, len(keys))
    names = [cp.Q, cp.C, cp.Z, *rest, *(f"{x}:{j}" for j in range(1, len(keys)) for x in (cp.C, cp.Z))]
    tensors = [_rows(t[query]), ks[0], vs[0], *(x.contiguous() for x in rest.values()),
               *(x for j in range(1, len(keys)) for x in (ks[j], vs[j]))]
    return names, [x.split(":")[0] for x in names], tensors


def _rows(x: torch.Tensor) -> torch.Tensor:
    """x [B, T, heads, D] as the sub-token kernels read it: each token's heads and channels
    contiguous, tokens any distance apart and batches T tokens apart (a slice of one [B, T, n, heads,
    D] tensor, FLA's interleaved layout, is read in place), else a contiguous copy."""
    B, T, heads, D = x.shape
    inner = (D == 1 or x.stride(3) == 1) and (heads == 1 or x.stride(2) == D)
    outer = x.stride(1) >= heads * D and (B == 1 or x.stride(0) == T * x.stride(1))
    return x if inner and outer else x.contiguous()


def _pick(g, x):
    """The gradient of the kernels' input x: "k:j" (step j's key) is slice j of the keys' [n, ...]
    gradient, "k" slice 0; the query's at its token (runtime/sub_chunk.py)."""
    name, _, j = x.partition(":")
    return g[name][int(j or 0)] if name in (cp.C, cp.Z) else g[name]


def last(o: torch.Tensor, n: int) -> torch.Tensor:
    """The sub-mixer's o [B, n T, HV, V] at the last sub-token of each token."""
    return o[:, n - 1::n]


def run(mixer, method: str, batch, cp_group=None, offsets=None):
    """chunk or recurrent of a product mixer through its sub-mixer."""
    sub, n = mixer.product, mixer.ir.n_steps
    if method == "chunk" and cp_group is None:
        per_step = _per_step(mixer, batch)
        if per_step is not None:
            return sub_chunk.run(mixer.product, _pick, batch, n, per_step)
    x = sub_inputs(mixer.product_plan, batch.tensors, batch.H, batch.HV)
    q, k, v = x.pop(cp.Q), x.pop(cp.C), x.pop(cp.Z)
    opts = dict(scale=batch.scale, initial_state=batch.initial_state, output_final_state=batch.output_final_state,
                cu_seqlens=None if batch.cu_seqlens is None else batch.cu_seqlens * n)
    if cp_group is not None:
        opts["cp_group"] = cp_group
    elif method == "chunk":  # the product's segments, if any, were cut before its steps
        opts["segments"] = 1
    if offsets is not None:
        opts["cu_seqlens_cpu"] = [n * int(c) for c in offsets]
    o, final = getattr(sub, method)(q, k, v, **opts, **x)
    return last(o, n).contiguous(), final


def step(mixer, batch, state, out=None, return_states=False, buf=None):
    """Decode: the sub-mixer's step over n sub-tokens per token, the state updated in place (Mixer.step's
    out and return_states; buf, checked by the caller before the state moves, gets the states after
    each token: the sub-mixer's after its last sub-token)."""
    x = sub_inputs(mixer.product_plan, batch.tensors, batch.H, batch.HV)
    q, k, v = x.pop(cp.Q), x.pop(cp.C), x.pop(cp.Z)
    n = mixer.ir.n_steps
    every = None
    if buf is not None:
        o, sub_every = mixer.product.step(q, k, v, state, batch.scale, return_states=True, **x)
        parts = ({"S": sub_every.S, **sub_every.aux} if hasattr(sub_every, "aux") else {"S": sub_every})
        dest = ({"S": buf.S, **buf.aux} if hasattr(buf, "aux") else {"S": buf})
        for name, t in dest.items():
            t.copy_(last(parts[name], n))
        every = buf
    else:
        o = mixer.product.step(q, k, v, state, batch.scale, **x)
    o = last(o, n)
    o = out.copy_(o) if out is not None else o.contiguous()
    return (o, every) if return_states else o


