"""The offline solve (Mesa) from the API: the whole state (S, the Gram state G and any auxiliary
states) in and out of the generated kernels, decoding in place, and the differentiable chunk.

The generated module (templates/mesa_*.py.jinja) takes states as tuples (S, G, [aux, ...]);
callers see lrdsl.MixerState(S, {"G": G, aux name: tensor, ...}).
"""
from __future__ import annotations

import math

import torch

from lrdsl.errors import InputError
from lrdsl.runtime import nonfinite
from lrdsl.runtime.tensors import MixerState


def zero_state(m, N, HV, K, V, device=None) -> MixerState:
    f32 = dict(dtype=torch.float32, device=device)
    aux = {a.name: torch.zeros(N, HV, a.width(K, V), **f32) for a in m.aux}
    aux["G"] = torch.zeros(N, HV, K, K, **f32)
    return MixerState(torch.zeros(N, HV, K, V, **f32), aux)


def state_in(m, batch) -> tuple | None:
    """(S, G, [aux, ...]) in fp32 to start from, zeros for the parts not given; None for none."""
    if batch.initial_state is None and batch.initial_gram is None and batch.initial_aux is None:
        return None
    N, HV, K, V = batch.N, batch.HV, batch.K, batch.V
    f32 = dict(dtype=torch.float32, device=batch.tensors["q"].device)

    def part(t, *shape):
        return torch.zeros(*shape, **f32) if t is None else t.to(torch.float32).contiguous()

    aux = batch.initial_aux if batch.initial_aux is not None else [None] * len(m.aux)
    return (part(batch.initial_state, N, HV, K, V), part(batch.initial_gram, N, HV, K, K),
            [part(t, N, HV, a.width(K, V)) for a, t in zip(m.aux, aux)])


def state_out(m, S, G, aux) -> MixerState:
    parts = {a.name: t for a, t in zip(m.aux, aux)}
    parts["G"] = G
    return MixerState(S, parts)


def host_inputs(mixer, batch):
    """The tensors the generated module takes (its INPUTS, by name, contiguous) and cu_seqlens."""
    inputs = {n: batch.tensors[n].contiguous() for n in mixer.kernels.INPUTS}
    cu = batch.cu_seqlens.to(torch.int64).contiguous() if batch.cu_seqlens is not None else None
    return inputs, cu


def refuse_singular_regulariser(m, batch) -> None:
    """Regulariser values the kernels cannot clamp into a solvable range, refused by chunk,
    recurrent and step (with or without check_ranges):
    - +inf: the exact solve's limit is x = 0 (o = 0, what the reference returns), but CG from the
      Jacobi start computes r - inf * 0 = nan there. Only a regulariser with no finite upper bound
      can be +inf here: a finite one clamps it to that bound.
    - lam <= 0 where lam is declared in (0, ...): the clamp puts it at the open end 0, where
      G + diag(lam) may be singular (outputs of 7.6e8 where the limit was 6.5).
    Only a regulariser that is itself an input or param is checked."""
    inp = next((i for i in (*m.inputs, *m.params) if i.symbol == m.solve_lam), None)
    if inp is None or torch.compiler.is_compiling():  # (a traced check breaks the graph)
        return
    x = batch.tensors[inp.name]
    checks = []
    if not inp.hi.is_finite:
        checks.append((torch.isposinf(x), f"{inp.name!r} is +inf at some token: the kernels' conjugate-gradient "
                       "solve gives nan there (the exact solve's limit is an output of 0); pass finite values, or "
                       f"declare a finite upper bound for {inp.name!r}, which clamps it there"))
    if inp.lo == 0 and inp.lo_open:
        checks.append((x <= 0, f"{inp.name!r} is at or below 0 at some token, outside its declared range (0, ...): "
                       "clamped to 0 the solve may be singular; pass positive values, or declare a positive lower "
                       f"bound for {inp.name!r}, which clamps it there"))
    for bad, what in checks:
        if x.device.type == "cpu":
            if bool(bad.any()):
                raise InputError(what)
        else:
            torch._assert_async(~bad.any(), what)  # no host synchronisation


def recurrent(mixer, batch):
    """mixer.recurrent for an offline-solve mixer: (o, MixerState or None)."""
    m = mixer.ir
    refuse_singular_regulariser(m, batch)
    inputs, cu = host_inputs(mixer, batch)
    o, final = mixer.kernels.recurrent_fwd(inputs, batch.scale, state_in(m, batch), batch.output_final_state, cu)
    return o, (state_out(m, *final) if batch.output_final_state else None)


def step(mixer, q, k, v, state, scale, inputs):
    """mixer.step for an offline-solve mixer: decodes the given tokens and updates the whole state
    (a MixerState of float32 contiguous tensors) in place."""
    m = mixer.ir
    if not isinstance(state, MixerState):
        raise InputError(f"mixer '{m.name}' reads its state through an offline solve, whose Gram state "
                         "decoding must carry: pass state=lrdsl.MixerState(S, {\"G\": G, ...}) "
                         "(mixer.zero_state(...) to start, or the final state of chunk(..., output_final_state=True))")
    batch = mixer._validate(q, k, v, inputs, scale, state, True, None)
    refuse_singular_regulariser(m, batch)
    parts = [batch.initial_state, batch.initial_gram, *(batch.initial_aux or ())]
    if any(t.dtype != torch.float32 or not t.is_contiguous() for t in parts):
        raise InputError("step() updates the state in place: S, G and every auxiliary state must be contiguous "
                         "float32 tensors")
    if torch.is_grad_enabled() and any(t.requires_grad for t in [*batch.tensors.values(), *parts]):
        raise InputError("step() is the decode path and is forward-only; call it under torch.no_grad()")
    inputs, _ = host_inputs(mixer, batch)
    S, G, aux = parts[0], parts[1], list(parts[2:])
    new = (S, torch.empty_like(G), [torch.empty_like(a) for a in aux])  # S in place: tiles are read first
    o, _ = mixer.kernels.recurrent_fwd(inputs, batch.scale, (S, G, aux), True, None, final=new)
    G.copy_(new[1])  # the Gram and auxiliary states are read whole by every value tile: written after
    for a, n in zip(aux, new[2]):
        a.copy_(n)
    return o


def chunk(mixer, batch):
    """mixer.chunk for an offline-solve mixer: (o, MixerState or None), differentiable in every
    input and every part of the initial whole state (S, G, auxiliary states), from o and every
    part of the final whole state."""
    m = mixer.ir
    refuse_singular_regulariser(m, batch)
    inputs, cu = host_inputs(mixer, batch)
    names = list(inputs)
    tensors = [batch.tensors[n] for n in names]
    starts = [batch.initial_state, batch.initial_gram]
    aux0 = list(batch.initial_aux or ())
    if torch.compiler.is_compiling():  # one opaque op: no graph break (offline_op.py)
        o, ST, GT, aux = mixer.chunk_op(tensors, *starts, aux0, batch.scale, batch.cu_seqlens, bool(batch.output_final_state))
        if not batch.output_final_state:
            return o, None
        widths = [a.width(batch.K, batch.V) for a in m.aux]
        return o, state_out(m, ST, GT, list(torch.split(aux, widths, dim=-1)) if widths else [])
    grad = torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in [*tensors, *starts, *aux0])
    if not grad:
        o, final = mixer.kernels.chunk_fwd(inputs, batch.scale, state_in(m, batch), batch.output_final_state, cu)
        return o, (state_out(m, *final) if final is not None else None)
    o, ST, GT, *aux = ChunkFunction.apply(mixer, batch, names, len(aux0), *starts, *tensors, *aux0)
    return o, (state_out(m, ST, GT, aux) if batch.output_final_state else None)


class ChunkFunction(torch.autograd.Function):
    """The chunked forward and backward of the offline solve (the forward keeps the solutions x and
    the chunk-start states for the backward). The auxiliary scans' part of the chain rule, their
    initial and final states included, goes through PyTorch (autograd.vector_chain_rule)."""

    @staticmethod
    def forward(ctx, mixer, batch, names, n_aux, S0, G0, *tensors_and_aux):
        n = len(tensors_and_aux) - n_aux
        tensors, aux0 = tensors_and_aux[:n], tensors_and_aux[n:]
        inputs, cu = dict(zip(names, (t.contiguous() for t in tensors))), batch.cu_seqlens
        cu = cu.to(torch.int64).contiguous() if cu is not None else None
        f32 = [None if t is None else t.detach().to(torch.float32).contiguous() for t in (S0, G0)]
        aux0 = [a.detach().to(torch.float32).contiguous() for a in aux0] if n_aux else None
        state = None if f32 == [None, None] and aux0 is None else (*f32, aux0)
        o, final, saved = mixer.kernels.chunk_fwd(inputs, batch.scale, state, batch.output_final_state, cu, keep=True)
        ctx.mixer, ctx.batch, ctx.names, ctx.saved, ctx.cu, ctx.state = mixer, batch, names, saved, cu, state
        ctx.starts, ctx.n = (S0, G0), n
        ctx.aux_dtypes = [a.dtype for a in tensors_and_aux[n:]]
        ctx.save_for_backward(*tensors, *(aux0 or ()))
        if final is None:
            return o, None, None
        return (o, final[0], final[1], *final[2])

    @staticmethod
    def backward(ctx, do, dST=None, dGT=None, *daux):
        stored = ctx.saved_tensors
        tensors, aux0 = stored[:ctx.n], (list(stored[ctx.n:]) if ctx.aux_dtypes else None)
        batch = ctx.batch
        inputs = dict(zip(ctx.names, (t.contiguous() for t in tensors)))
        if do is None:
            do = torch.zeros(batch.B, batch.T, batch.HV, batch.V, device=tensors[0].device)
        dht = (None if dST is None else dST.contiguous(), None if dGT is None else dGT.contiguous())
        # chunk_bwd frees the kept intermediates as it goes: handed over, not shared (a second
        # backward through a retained graph finds None and recomputes them)
        saved, ctx.saved = ctx.saved, None
        # non-finite inputs: the backward of their finite copies, the kept intermediates recomputed
        masks = nonfinite.bad_entries(ctx.mixer.ir, ctx.names, tensors)
        if masks is not None:
            tensors = nonfinite.finite_copies(ctx.mixer.ir, ctx.names, tensors, masks)
            inputs, saved = dict(zip(ctx.names, (t.contiguous() for t in tensors))), None
        vgrads, dS0, dG0 = ctx.mixer.kernels.chunk_bwd(inputs, batch.scale, ctx.state, do, dht, ctx.cu, saved)
        del saved
        needs = ctx.needs_input_grad[6:]
        grads, daux0 = input_grads(ctx.mixer, batch, inputs, tensors, needs[:ctx.n], vgrads, aux0, daux)
        if masks is not None:
            grads = nonfinite.nan_at(grads, masks)
        S0, G0 = ctx.starts
        dS0 = dS0.to(S0.dtype) if S0 is not None and ctx.needs_input_grad[4] else None
        dG0 = dG0.to(G0.dtype) if G0 is not None and ctx.needs_input_grad[5] else None
        daux0 = [g.to(d) if need else None for g, d, need in zip(daux0, ctx.aux_dtypes, needs[ctx.n:])]
        return (None, None, None, None, dS0, dG0, *grads, *daux0)


def input_grads(mixer, batch, inputs, tensors, needs, vgrads, aux0=None, daux=()):
    """(the inputs' gradients (None where not needed), the auxiliary initial states') from the
    per-token vectors' vgrads: the generated chain-rule kernel where the module has one (specs
    without auxiliary states), else PyTorch's (autograd.vector_chain_rule)."""
    if mixer.kernels.HAS_CHAIN_RULE and not mixer.ir.aux:  # (autograd.aux_chain_rule: staged only)
        g = mixer.kernels.chain_rule(inputs, batch.scale, vgrads)
        return [g[n] if need else None for n, need in zip(inputs, needs)], []
    from lrdsl.runtime.autograd import vector_chain_rule
    return vector_chain_rule(mixer.ir, batch, list(inputs), tensors, needs, vgrads, aux0, daux)


# ---- tolerances ------------------------------------------------------------------------------
FP32_EPS = 2.0 ** -24


def cg_tolerance(steps: int, K: int, kappa: float, tol: float) -> float:
    """The relative error the kernels' solve may show against the exact one, for a condition number
    kappa of G_t + diag(lam_t): CG reaches the solution within K steps in exact arithmetic, and fp32
    rounding costs about K eps kappa (a forward error of kappa times a backward error of K eps);
    with fewer steps than K, CG's rate adds ||x_n - x|| / ||x|| <= 2 sqrt(kappa) (1 + kappa) rho^n,
    rho = (sqrt(kappa) - 1) / (sqrt(kappa) + 1) (the A-norm bound, ||x_0|| <= kappa ||x|| for the
    Jacobi start). Never below tol."""
    extra = K * FP32_EPS * kappa
    if steps < K:
        root = math.sqrt(kappa)
        extra += 2 * root * (1 + kappa) * ((root - 1) / (root + 1)) ** steps
    return max(tol, extra)


def kappa_bound(m, batch) -> float:
    """An upper bound on the condition number of G_t + diag(lam_t) over a batch's tokens: G_t is
    positive semi-definite (the checker's proof), so lambda_min >= min lam; decays are at most 1, so
    ||G_t|| <= ||G_0|| + sum_j |u_j| |k_j| over the tokens before t (here: over the whole batch row)."""
    from lrdsl.runtime.autograd import token_vectors
    vec = token_vectors(m, batch, torch.float64)
    lam = vec["lam"]
    writes = (vec["u"].norm(dim=-1) * vec["kk"].norm(dim=-1)).sum(1).max().item()
    g0 = 0.0 if batch.initial_gram is None else torch.linalg.matrix_norm(batch.initial_gram.double(), 2).max().item()
    lo = lam.min().item() if lam.numel() else 1.0
    if not lo > 0:
        return math.inf
    return (g0 + writes + lam.max().item()) / lo
